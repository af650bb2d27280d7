"""Training on the high-entropy tokens only (TRL's `top_entropy_quantile`, after "Beyond the
80/20 Rule", Wang et al. 2025): of the step's completion tokens, only the top
`top_entropy_quantile` share by the entropy of the policy that sampled them carries policy
gradient; the other tokens' policy term is multiplied by 0 and the normaliser is unchanged
(TRL's convention).

The set is chosen once per step, before its first update, over every completion token of the
global batch (the paper's; TRL draws it per micro-batch from the policy being updated, so
there its gradient depends on the micro-batch split): the same threshold population under any
micro-batch, token budget or world size (only a token within the forward's rounding of the
threshold may fall either side), and the same tokens for every inner epoch, as logp_old."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpolab.check import Check, Mutant
from grpolab.objective.base import Needs, Option
from grpolab.schema import key


@dataclass(frozen=True)
class EntropyQuantileKeys:
    # The share of the step's completion tokens, highest entropy first, that the policy term
    # trains on (0.2: TRL's and the paper's 20 %); 1 = every token.
    top_entropy_quantile: float = key(
        1.0,
        check=lambda v: math.isfinite(v) and 0 < v <= 1,
        expected="a number in (0, 1] (1: every token)",
    )


def entropy_threshold(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The entropy at or above which a token is in the top `quantile` share: the (1 -
    quantile) quantile (linear interpolation, as torch.quantile) of `entropy` over the
    positions where `mask` is set; padding, prompts and rows out of the loss do not count.
    entropy, mask: the same shape -> a 0-dim float32 tensor."""
    values = entropy.detach().float()[mask.bool()]
    if values.numel() == 0:
        return torch.tensor(math.inf)
    return torch.quantile(values, 1.0 - quantile)


def _active(o) -> bool:
    return o.top_entropy_quantile < 1


def before_update(o, fns, tokens) -> dict[str, torch.Tensor]:
    """{"top_entropy": [B, T-1] 1.0 on the loss's tokens at or above the global threshold}."""
    flat_entropy, flat_mask = tokens.entropy.flatten(), tokens.mask.flatten()
    threshold = fns.entropy_threshold(
        tokens.gather(flat_entropy), tokens.gather(flat_mask), o.top_entropy_quantile
    )
    keep = (tokens.entropy >= threshold.to(tokens.entropy.device)) & tokens.mask.bool()
    return {"top_entropy": keep.to(tokens.mask.dtype)}


def token_weights(o, fns, micro) -> tuple[torch.Tensor, dict[str, float]]:
    keep = micro.before["top_entropy"]
    return keep, {"kept": float((keep * micro.mask).sum()), "tokens": float(micro.mask.sum())}


def metrics(o, sums: dict[str, float]) -> dict[str, float]:
    return {"entropy_quantile/kept_frac": sums["kept"] / max(sums["tokens"], 1.0)}


def needs(o) -> tuple[Needs, ...]:
    if not _active(o):
        return ()
    return (
        Needs("sequence_logprobs", "return_entropy", "top_entropy_quantile"),
        Needs("grpo_loss", "token_weights", "top_entropy_quantile"),
    )


def _card(o) -> dict[str, str]:
    if not _active(o):
        return {}
    return {
        "entropy": f"; trained tokens: the top {o.top_entropy_quantile:g} of the step's "
        "completion tokens by the sampling policy's entropy (the rest: policy term x 0)"
    }


# Designed entropies: 21 tokens in the loss with distinct entropies 0.05 apart, padding and
# rows out of the loss with entropies far above them (a threshold taken over every position
# lands among those), in an order that is not sorted.
def _designed() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    valid = 0.3 + 0.05 * torch.randperm(21, generator=g).float()
    entropy = torch.full((4, 8), 9.0)
    mask = torch.zeros(4, 8)
    entropy.view(-1)[:21] = valid
    mask.view(-1)[:21] = 1
    entropy[3, 5:] = 0.0  # padding of low entropy too: the threshold must not see it either
    return entropy, mask


def selection(ctx):
    """The tokens kept against a float64 reference of the declared quantile; a token
    within float32 rounding of the reference threshold may fall either side."""
    quantile = ctx.objective.top_entropy_quantile
    entropy, mask = _designed()
    threshold = ctx.impl.entropy_threshold(entropy, mask, quantile)
    got = (entropy >= threshold) & mask.bool()
    reference = torch.quantile(entropy.double()[mask.bool()], 1.0 - quantile)
    expected = (entropy.double() >= reference) & mask.bool()
    tie = (entropy.double() - reference).abs() <= 1e-5
    wrong = int(((got != expected) & ~tie).sum())
    kept = int(expected.sum())
    return ctx.result(
        f"tokens kept or dropped against the float64 top {quantile:g} by entropy (21 tokens in "
        f"the loss, {kept} of them kept; padding of entropy 9 and 0 around them)",
        wrong,
        "0",
        wrong == 0,
    )


ENTROPY_QUANTILE = Option(
    name="entropy_quantile",
    keys=EntropyQuantileKeys,
    active=_active,
    needs=needs,
    card=_card,
    trl={"top_entropy_quantile": "top_entropy_quantile"},
    functions={"entropy_threshold": entropy_threshold},
    before_update=before_update,
    reads_entropy=True,
    token_weights=token_weights,
    metrics=metrics,
    checks=(
        Check(
            "entropy_quantile.selection",
            0,
            "the threshold is the (1 - top_entropy_quantile) quantile of the entropies of the "
            "loss's tokens only (not of padding or prompt positions, not the quantile itself): "
            "the top share is kept, not the bottom",
            selection,
            when=lambda ctx: _active(ctx.objective),
            mutants=(
                Mutant("entropy_quantile_unmasked", {"top_entropy_quantile": 0.2}),
                Mutant("entropy_quantile_bottom", {"top_entropy_quantile": 0.2}),
            ),
            declared_only=True,
        ),
    ),
)
