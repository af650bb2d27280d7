"""mask_truncated_completions (TRL's): completions that hit max_completion_length without EOS
leave the loss and its normaliser, and their group's statistics (advantage 0)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpolab.check import Check, Mutant
from grpolab.objective.base import Option


@dataclass(frozen=True)
class TruncationKeys:
    mask_truncated_completions: bool = False


def truncation_mask(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """The loss mask without the completions that hit max_completion_length: mask [B, T],
    truncated [B] bool -> [B, T]."""
    if truncated.shape != mask.shape[:1]:
        raise ValueError(f"truncated {tuple(truncated.shape)} must be [B] = [{mask.shape[0]}]")
    return mask * (~truncated.bool()).unsqueeze(1).to(mask.dtype)


def loss_rows(o, fns, rollout) -> torch.Tensor:
    """[B]: 0 for the completions that hit max_completion_length, 1 for the others (the
    function table's truncation_mask, a user's where given)."""
    kept = fns.truncation_mask(torch.ones(rollout.batch_size, 1), rollout.truncated)
    return kept.view(-1)


def _card(o) -> dict[str, str]:
    if not o.mask_truncated_completions:
        return {}
    return {"truncated": "completions without EOS leave the loss and its normaliser"}


def truncation_check(ctx):
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0
    truncated = torch.tensor([True, False, False, True])
    got = ctx.impl.truncation_mask(mask, truncated)
    expected = mask * torch.tensor([0.0, 1, 1, 0])[:, None]
    wrong = float((got != expected).sum())
    return ctx.result(
        "loss-mask entries wrong after masking truncated completions (rows 0 and 3)",
        wrong,
        "0",
        wrong == 0,
    )


TRUNCATION = Option(
    name="truncation",
    keys=TruncationKeys,
    active=lambda o: o.mask_truncated_completions,
    card=_card,
    trl={"mask_truncated_completions": "mask_truncated_completions"},
    functions={"truncation_mask": truncation_mask},
    loss_rows=loss_rows,
    checks=(
        Check(
            "truncation.mask",
            0,
            "mask_truncated_completions: zero the loss mask of the rows that hit "
            "max_completion_length (truncated), and only those",
            truncation_check,
            when=lambda ctx: ctx.objective.mask_truncated_completions,
            mutants=(Mutant("truncation_inverted", {"mask_truncated_completions": True}),),
            declared_only=True,
        ),
    ),
)
