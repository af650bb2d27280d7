"""The log-ratio clamped to [-c, c] before exp (verl's and OpenRLHF's GRPO: 20), so that a
token whose probability collapsed cannot overflow the ratio. core.importance_ratio applies it;
the clip checks place their probe ratios off +-c (`bounds`), so they check it too."""

from __future__ import annotations

from dataclasses import dataclass

from grpolab.objective.base import Option, Passed
from grpolab.schema import above_or_off, key


@dataclass(frozen=True)
class LogRatioClampKeys:
    log_ratio_clamp: float | None = key(None, **above_or_off(0, " (verl: 20)"))


def bounds(o) -> list[float]:
    """The log-ratios at which the clamp starts to act."""
    c = o.log_ratio_clamp
    return [] if c is None else [-c, c]


def _card(o) -> dict[str, str]:
    if o.log_ratio_clamp is None:
        return {}
    return {"ratio": f"; log-ratio clamped to +-{o.log_ratio_clamp:g}" + o.mark("log_ratio_clamp")}


LOG_RATIO_CLAMP = Option(
    name="log_ratio_clamp",
    keys=LogRatioClampKeys,
    loss=(Passed("log_ratio_clamp", unless=None, convention=True, policy=True),),
    card=_card,
)
