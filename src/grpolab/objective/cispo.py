"""CISPO (MiniMax-M1; TRL's loss_type "cispo"): -sg(min(ratio, eps_high)) * A * logp_new per
token. The ratio is capped, not clipped out, and detached: every token keeps a gradient
-min(ratio, eps_high) * A. epsilon_high is the cap itself (e.g. 5), not a clip width; the
loss is normalised by the token count, as TRL does."""

from __future__ import annotations

import torch

from grpolab.check import Check, Mutant
from grpolab.objective.base import Option, Surrogate, masked_mean, max_abs
from grpolab.schema import Inert, SchemaError

CISPO_DECLARED = {"loss_type": "cispo", "epsilon_high": 5.0}


def per_token(ratio, adv, logp_new, mask, eps_low, eps_high):
    """([B, T] per-token loss, the masked share of tokens capped with A > 0)."""
    weight = ratio.clamp(max=eps_high).detach()  # [B, T] or [B, 1]
    per_token = -weight * adv * torch.where(mask.bool(), logp_new, torch.zeros_like(logp_new))
    with torch.no_grad():
        capped = ((ratio > eps_high) & (adv > 0)).float().expand_as(logp_new)
        return per_token, masked_mean(capped, mask)


def reference(ratio, A, new, valid, o):
    """float64: the per-token loss and the tokens the cap acts on (A > 0)."""
    weight = ratio.clamp(max=o.epsilon_high).detach()
    per_token = -weight * A * torch.where(valid, new, torch.zeros_like(new))
    return per_token, (ratio > o.epsilon_high) & (A > 0)


def rules(o) -> None:
    if o.policy_term == "cispo" and not o.epsilon_high > 1:
        raise SchemaError(
            "epsilon_high", o.epsilon_high, "> 1 with loss_type=cispo: it is the cap on the "
            "ratio itself (e.g. 5.0)"
        )  # fmt: skip


def _card(o) -> dict[str, str]:
    if o.policy_term != "cispo":
        return {}
    return {"clip": f"CISPO: -sg(min(ratio, {o.epsilon_high:g})) * A * logp_new per token *"}


def cispo_gradient(ctx):
    """Ratios below and above the cap, both signs of A."""
    hi = ctx.objective.epsilon_high
    case = ctx.ratio_case(
        [[0.5, 1.0, hi * 0.9, hi * 1.5], [0.7, 1.3, hi * 1.2, 2.0]], [0.8, -1.1], [4, 3]
    )
    (_, _, grad), (_, _, ref_grad) = ctx.values_and_grads(*case)
    gap = max_abs((grad.double() - ref_grad)[case[3].bool()])
    return ctx.result(
        "max |d loss / d logp_new - (-min(ratio, eps_high) * A)| per token",
        gap,
        "<= 1e-5",
        gap <= 1e-5,
    )


SURROGATE = Surrogate(
    name="cispo",
    aggregation="token",
    per_token=per_token,
    reference=reference,
    bounds=lambda o: [o.epsilon_high],
)
CISPO = Option(
    name="cispo",
    policy_term=SURROGATE,
    rules=rules,
    card=_card,
    inert=(
        Inert(
            ("objective.epsilon",),
            ("objective.loss_type", "objective.surrogate"),
            lambda c: c.objective.policy_term == "cispo",
            "with the cispo surrogate: CISPO caps the ratio at epsilon_high alone",
        ),
    ),
    checks=(
        Check(
            "cispo.gradient",
            4,
            "CISPO: -sg(min(ratio, eps_high)) * A * logp_new: the capped ratio is detached, so "
            "d loss / d logp_new = -min(ratio, eps_high) * A on every token",
            cispo_gradient,
            when=lambda ctx: ctx.objective.policy_term == "cispo",
            mutants=(Mutant("cispo_no_detach", CISPO_DECLARED),),
            blame_before="clip.values",
            declared_only=True,
        ),
    ),
)
