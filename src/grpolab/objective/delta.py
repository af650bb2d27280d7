"""Two-sided clip (TRL's `delta`, INTELLECT-2): the unclipped term's ratio capped at delta,
-min(min(ratio, delta) * A, clip(ratio) * A), so a negative advantage cannot push a token's
probability up without bound. One keyword of the seed's clipped surrogate
(core.policy_loss)."""

from __future__ import annotations

from dataclasses import dataclass

from grpolab.check import Check, Mutant
from grpolab.objective.base import ClipBound, Option, Passed
from grpolab.schema import above_or_off, key

BOUND = ClipBound("delta")


@dataclass(frozen=True)
class DeltaKeys:
    delta: float | None = key(None, **above_or_off(1, " (e.g. 1 + epsilon_high + 1)"))


def _card(o) -> dict[str, str]:
    if o.delta is None:
        return {}
    return {"clip": f"; unclipped ratio capped at delta = {o.delta:g} (two-sided) *"}


DELTA = Option(
    name="delta",
    trl={"delta": "delta"},
    keys=DeltaKeys,
    rules=BOUND.rules,
    loss=(Passed("delta", unless=None, policy=True),),
    card=_card,
    inert=(BOUND.inert,),
    checks=(
        Check(
            "clip.delta",
            4,
            "two-sided clip: only the unclipped term's ratio is capped at delta: "
            "-min(min(ratio, delta) * A, clip(ratio) * A)",
            BOUND.check,
            when=BOUND.declared,
            mutants=(Mutant("delta_positive_only", {"delta": 2.0}),),
            blame_before="clip.values",
            declared_only=True,
        ),
    ),
)
