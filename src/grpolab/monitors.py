"""Runtime monitors: the preflight's invariants, watched on every training step.

Each monitor reads one quantity from a step's metrics and, when it leaves its normal range,
returns a warning that names the quantity, the value, the step and the range. The trainer
prints them, records them in metrics.jsonl and, with `trainer.monitor: stop`, stops the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MonitorLimits:
    ratio_dev: float = 1e-3  # |ratio - 1| before the first update of a step (scheme A)
    kl_min: float = -1e-6  # k3 is never negative
    adv_group_sum: float = 1e-4  # |sum of a group's advantages| (relative to G)
    engine_gap: float = 1e-3  # |engine logp - trainer logp| on the sampled tokens
    clip_frac_max: float = 0.3  # a policy moving this far per step is unstable
    zero_std_max: float = 0.95  # groups with no reward variance teach nothing


def limits_for(trainer_cfg, model_dtype: str) -> MonitorLimits:
    """The limits for a run: the engine gap a float32 stack keeps is far below a bf16 one's."""
    return MonitorLimits(
        engine_gap=1e-3 if model_dtype == "float32" else 5e-2,
        clip_frac_max=trainer_cfg.monitor_clip_frac_max,
        zero_std_max=trainer_cfg.monitor_zero_std_max,
    )


def check_step(step: int, metrics: dict, limits: MonitorLimits, scheme_a: bool) -> list[str]:
    """Warnings for the quantities of one step that are out of their normal range."""
    warnings: list[str] = []

    def out(name: str, value: float, expected: str, why: str) -> None:
        warnings.append(f"step {step}: {name} = {value:.3g}, expected {expected} ({why})")

    if metrics.get("skipped"):
        what = metrics.get("nonfinite", "a value")
        out("non-finite", float(metrics["skipped"]), "0 skipped updates", f"{what} went first")
    dev = metrics.get("monitor/ratio_dev")
    if scheme_a and _known(dev) and dev > limits.ratio_dev:
        out(
            "max |ratio - 1| before the first update",
            dev,
            f"<= {limits.ratio_dev:g}",
            "logp_old is not the sampling policy's log-probs: dropout, a stale copy or "
            "different inputs",
        )
    kl = metrics.get("kl")
    if _known(kl) and kl < limits.kl_min:
        out("kl", kl, ">= 0", "k3 cannot be negative: check the sign of d = logp_ref - logp_new")
    sums = metrics.get("monitor/adv_group_sum")
    if _known(sums) and sums > limits.adv_group_sum:
        out(
            "max |group sum of advantages|",
            sums,
            f"<= {limits.adv_group_sum:g}",
            "groups are not contiguous or not mean-centred",
        )
    gap = metrics.get("monitor/engine_gap")
    if _known(gap) and gap > limits.engine_gap:
        out(
            "max |engine logp - trainer logp|",
            gap,
            f"<= {limits.engine_gap:g}",
            "the engine samples from other weights or another temperature than the trainer",
        )
    clip = metrics.get("clip_frac")
    if _known(clip) and clip > limits.clip_frac_max:
        out(
            "clip_frac",
            clip,
            f"<= {limits.clip_frac_max:g}",
            "the policy moves too far per step: lower the learning rate or num_iterations",
        )
    zero = metrics.get("frac_reward_zero_std")
    if _known(zero) and zero > limits.zero_std_max:
        out(
            "frac_reward_zero_std",
            zero,
            f"<= {limits.zero_std_max:g}",
            "almost no group has reward variance, so almost nothing is learned",
        )
    return warnings


def _known(value) -> bool:
    return isinstance(value, int | float) and not math.isnan(value)
