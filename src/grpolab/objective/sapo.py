"""SAPO (Soft Adaptive Policy Optimization, Qwen 2025; TRL's loss_type "sapo"): the hard clip
replaced by a smooth gate, -sigmoid(tau * (ratio - 1)) * 4 / tau * A per token, with tau =
sapo_temperature_pos for A > 0 and sapo_temperature_neg otherwise. Its gradient is
-4 * ratio * s * (1 - s) * A (s the sigmoid): the plain policy gradient at ratio 1, faded
smoothly as the ratio leaves 1 instead of cut off at a bound. Normalised per sequence, as TRL
normalises it.

clip_frac under SAPO: the share of tokens whose update the gate has more than halved relative
to the unclipped surrogate (4 s (1 - s) < 1/2, i.e. |tau (ratio - 1)| > GATE_HALF)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpolab.check import Check, Mutant
from grpolab.objective.base import Option, Surrogate, masked_mean, max_abs
from grpolab.schema import Inert, above, key

# |tau (ratio - 1)| beyond which 4 s (1 - s) < 1/2: s = (1 + sqrt(1/2)) / 2.
GATE_HALF = 2 * math.atanh(math.sqrt(0.5))


@dataclass(frozen=True)
class SapoKeys:
    # The gate's temperatures (TRL's names and defaults): larger is a sharper gate.
    sapo_temperature_pos: float = key(1.0, **above(0))  # tokens with A > 0
    sapo_temperature_neg: float = key(1.05, **above(0))  # tokens with A <= 0


def per_token(
    ratio, adv, logp_new, mask, eps_low, eps_high, sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
):  # fmt: skip
    """([B, T] per-token loss, the masked share of tokens the gate more than halves)."""
    tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)  # [B, 1]
    gate = torch.sigmoid(tau * (ratio - 1))  # [B, T] or [B, 1]
    per_token = (-gate * 4 / tau * adv).expand_as(logp_new)
    with torch.no_grad():
        halved = (4 * gate * (1 - gate) < 0.5).float().expand_as(logp_new)
        return per_token, masked_mean(halved, mask)


def reference(ratio, A, new, valid, o):
    """float64: the per-token loss and the tokens whose update the gate more than halves."""
    tau = torch.where(
        A > 0,
        torch.tensor(o.sapo_temperature_pos, dtype=torch.float64),
        torch.tensor(o.sapo_temperature_neg, dtype=torch.float64),
    )
    x = tau * (ratio - 1)
    per_token = -(4 / tau) * A / (1 + torch.exp(-x))
    return per_token, x.abs() > GATE_HALF


def bounds(o) -> list[float]:
    """The ratios where the gate crosses one half (probes keep off them)."""
    taus = (o.sapo_temperature_pos, o.sapo_temperature_neg)
    return [r for tau in taus for r in (1 - GATE_HALF / tau, 1 + GATE_HALF / tau) if r > 0]


def _card(o) -> dict[str, str]:
    if o.policy_term != "sapo":
        return {}
    return {
        "clip": "SAPO: -sigmoid(tau * (ratio - 1)) * 4 / tau * A per token, tau = "
        f"{o.sapo_temperature_pos:g} for A > 0, {o.sapo_temperature_neg:g} otherwise (a soft "
        "gate, no hard clip) *"
    }


def sapo_gate(ctx):
    """Ratios on both sides of 1 and past the gate's half points, both signs of A."""
    case = ctx.ratio_case(
        [[0.3, 0.8, 1.0, 1.3, 2.0, 3.5], [0.5, 1.1, 1.6, 2.5, 4.0, 6.0]], [0.9, -1.2], [6, 5]
    )
    (values, _, grad), (ref, _, ref_grad) = ctx.values_and_grads(*case)
    valid = case[3].bool()
    gap = max(max_abs((values.double() - ref)[valid]), max_abs((grad.double() - ref_grad)[valid]))
    return ctx.result(
        "max |per_token or its grad - sigmoid(tau (ratio - 1)) * 4 / tau * A| with tau of "
        "A's sign, ratios 0.3 to 6",
        gap,
        "<= 1e-5",
        gap <= 1e-5,
    )


def _declared(o) -> bool:
    return o.policy_term == "sapo"


SURROGATE = Surrogate(
    name="sapo",
    aggregation="sequence",
    per_token=per_token,
    reference=reference,
    bounds=bounds,
)
SAPO = Option(
    name="sapo",
    trl={k: k for k in ("sapo_temperature_pos", "sapo_temperature_neg")},
    keys=SapoKeys,
    policy_term=SURROGATE,
    active=_declared,
    card=_card,
    inert=(
        Inert(
            ("objective.epsilon", "objective.epsilon_high"),
            ("objective.loss_type", "objective.surrogate"),
            lambda c: c.objective.policy_term == "sapo",
            "with the sapo surrogate: SAPO's soft gate has no clip range",
        ),
    ),
    checks=(
        Check(
            "sapo.gate",
            4,
            "SAPO: -sigmoid(tau * (ratio - 1)) * 4 / tau * A per token, tau = "
            "sapo_temperature_pos where A > 0 and sapo_temperature_neg elsewhere: not one "
            "temperature for both signs, not a hard clip",
            sapo_gate,
            when=lambda ctx: _declared(ctx.objective),
            mutants=(Mutant("sapo_one_temperature", {"loss_type": "sapo"}),),
            blame_before="clip.values",
            declared_only=True,
        ),
    ),
)
