"""The entropy bonus: entropy_coef x the policy's entropy (of its whole next-token
distribution at each completion position) subtracted from each token's loss, aggregated like
the rest, so that minimising the loss raises the entropy. The masked entropy is reported
whatever the coefficient."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpolab.check import Check, Mutant
from grpolab.objective.base import Needs, Option, Passed, max_abs
from grpolab.schema import at_least, key


@dataclass(frozen=True)
class EntropyKeys:
    entropy_coef: float = key(0.0, **at_least(0))


def needs(o) -> tuple[Needs, ...]:
    return (Needs("grpo_loss", "entropy", "entropy_coef"),) if o.entropy_coef else ()


def _card(o) -> dict[str, str]:
    if not o.entropy_coef:
        return {}
    return {"entropy": f"; bonus: entropy_coef = {o.entropy_coef:g} x entropy subtracted per token"}


def entropy_bonus(ctx):
    """d loss / d entropy is -entropy_coef times each token's aggregation weight."""
    o = ctx.objective
    g = torch.Generator().manual_seed(ctx.settings.seed + 4)
    logp_new, logp_old, adv, mask = ctx.clip_case()
    entropy = (torch.rand(mask.shape, generator=g) * 2).requires_grad_(True)
    loss, _ = ctx.loss(logp_new, logp_old, None, adv, mask, L=8, entropy=entropy)
    ctx.backward(loss)
    weights = torch.ones(mask.shape, dtype=torch.float64, requires_grad=True)
    ctx.aggregate(weights, mask.double(), 8).backward()
    expected = -o.entropy_coef * weights.grad
    grad = entropy.grad if entropy.grad is not None else torch.zeros_like(entropy)
    gap = max_abs((grad.double() - expected)[mask.bool()])
    return ctx.result(
        f"max |d loss / d entropy - (-{o.entropy_coef:g} x aggregation weight)|",
        gap,
        "<= 1e-6",
        gap <= 1e-6,
    )


def entropy_values(ctx):
    """The entropy the log-prob function returns against softmax(logits / T) in float64."""
    T = ctx.objective.temperature
    rows = ctx.unpadded_rows()
    with torch.no_grad():
        _, _, got = ctx.impl.sequence_logprobs(
            ctx.model, rows.input_ids, rows.attention_mask, rows.completion_mask, T,
            return_entropy=True,
        )  # fmt: skip
        logits = ctx.model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits
        logp = torch.log_softmax(logits[:, :-1].double() / T, dim=-1)
        expected = -(logp.exp() * logp).sum(-1)
    comp = rows.completion_mask[:, 1:].bool()
    gap = max_abs((got.double() - expected)[comp])
    return ctx.result(
        "max |entropy - float64 entropy of softmax(logits / T)| on completion tokens",
        gap,
        "<= 1e-4",
        gap <= 1e-4,
    )


def _declared(ctx) -> bool:
    return bool(ctx.objective.entropy_coef)


ENTROPY = Option(
    name="entropy",
    reads_every_row="entropy_coef",
    keys=EntropyKeys,
    loss=(Passed("entropy_coef", unless=0.0),),
    needs=needs,
    card=_card,
    checks=(
        Check(
            "entropy.bonus",
            0,
            "the entropy bonus is SUBTRACTED from the loss (loss - coef * entropy), aggregated "
            "like the rest: minimising the loss then raises the entropy",
            entropy_bonus,
            when=_declared,
            mutants=(Mutant("entropy_bonus_added", {"entropy_coef": 0.01}),),
            blame_before="ratio.initial",
            declared_only=True,
        ),
        Check(
            "entropy.values",
            0,
            "entropy = -sum_v p_v log p_v of softmax(logits / T) at each completion position, "
            "in float32",
            entropy_values,
            when=lambda ctx: _declared(ctx) and ctx.takes("sequence_logprobs", "return_entropy"),
            declared_only=True,
        ),
    ),
)
