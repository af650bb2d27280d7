"""Dual-clip (verl's clip_ratio_c, Ye et al. 2020): for a negative advantage the per-token
loss is at most -A * c, bounding how hard a very unlikely token is pushed down. One keyword of
the seed's clipped surrogate (core.policy_loss); verl's profile sets c = 3."""

from __future__ import annotations

from dataclasses import dataclass

from grpolab.check import Check, Mutant
from grpolab.objective.base import ClipBound, Option, Passed
from grpolab.schema import above_or_off, key

BOUND = ClipBound("dual_clip")


@dataclass(frozen=True)
class DualClipKeys:
    dual_clip: float | None = key(None, **above_or_off(1, " (verl: 3.0)"))


def _card(o) -> dict[str, str]:
    if o.dual_clip is None:
        return {}
    return {"clip": f"; A < 0: loss at most {o.dual_clip:g} * |A| (dual-clip) *"}


DUAL_CLIP = Option(
    name="dual_clip",
    keys=DualClipKeys,
    rules=BOUND.rules,
    loss=(Passed("dual_clip", unless=None, convention=True, policy=True),),
    card=_card,
    inert=(BOUND.inert,),
    checks=(
        Check(
            "clip.dual_clip",
            4,
            "dual-clip bounds only negative advantages: where A < 0, loss = "
            "min(ppo_loss, -A * dual_clip); positive advantages are untouched",
            BOUND.check,
            when=BOUND.declared,
            mutants=(Mutant("dual_clip_both_signs", {"dual_clip": 3.0}),),
            blame_before="clip.values",
            declared_only=True,
        ),
    ),
)
