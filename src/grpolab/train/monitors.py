"""Runtime monitors: the preflight's invariants, watched on every training step, and the
non-finite guard's streak.

Each monitor reads one quantity from a step's metrics and, when it leaves its normal range,
returns a warning that names the quantity, the value, the step and the range. The loop
prints them, records them in metrics.jsonl and, with `monitors.action: stop`, stops the run.
A run of `monitors.max_consecutive_nonfinite` skipped steps stops it too, with a replay
capsule of the last batch. `RewardDivergence` watches a trend rather than a step: the
training reward running ahead of the strict accuracy, the signature of a gamed reward.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from grpolab.model.precision import Precision
from grpolab.train.checkpoint import rng_state
from grpolab.train.setup import Run
from grpolab.train.step import StepBatch, logprobs_in_chunks


class MonitorStop(RuntimeError):
    """A monitored quantity left its normal range and monitors.action is "stop"."""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


@dataclass(frozen=True)
class MonitorLimits:
    ratio_dev: float = 1e-3  # |ratio - 1| before the first update (trainer's logp_old)
    kl_min: float = -1e-6  # k3 is never negative
    adv_group_sum: float = 1e-4  # |sum of a group's advantages| (relative to G)
    engine_gap: float = 1e-3  # max |engine logp - trainer logp| on the sampled tokens
    # What the step monitor allows of that max, and of its mean over the tokens: the max
    # under fp32; the mean under bf16, whose max is a tail of roundings (BF16_ENGINE_GAP).
    engine_gap_watched: float = 1e-3
    engine_gap_mean: float = math.inf
    clip_frac_max: float = 0.3  # a policy moving this far per step is unstable
    zero_std_max: float = 0.95  # groups with no reward variance teach nothing
    # Rewarded-as-right fraction minus strict accuracy, as a mean over `divergence_window`
    # steps. On numeric answers an honest reward and the strict check agree (the gap was 0 on
    # every step of the demo and of a chat model's first steps); on string and choice answers
    # the accuracy's judge and the strict one read every completion alike (0 on every step,
    # tests/test_answer_kinds.py); a reward that evaluated restated questions paid 11-19 % of
    # a chat model's samples beyond the right ones from step 1 on. Averaging over steps keeps
    # one lucky batch from warning. On symbolic answers (the math kind: \sqrt{8} written
    # 2\sqrt{2}) math-verify accepts what the text-exact strict check does not: raise the
    # limit there.
    reward_strict_gap: float = 0.1
    divergence_window: int = 8
    # objective.tis_cap: tokens (sequences) whose importance weight the cap truncated or
    # dropped. Before any update the trainer's and an fp32 engine's log-probs are ~1e-6 apart,
    # so no weight is near a cap; a share this large means stale weights or another
    # distribution (temperature, top-p) on one side.
    tis_capped_max: float = 0.2


# Under runtime.precision=bf16 the engine and the loss forward are two bf16 computations of
# the same weights (a KV-cache decode over LoRA-merged copies, a chunked lm-head over the
# adapters), each rounded its own way. The largest gap over a step's ~900 sampled tokens is
# a tail of those roundings: on SmolLM2-135M its median was 0.25 nats, and it reached 1.24 and
# 2.04 in 200 steps of the real-model example (largest early, when unlikely tokens are
# sampled), while a wrong temperature in the loss gave only 0.9-2.3 on a trained model. The
# preflight's probes keep BF16_ENGINE_GAP as their bound (engine.agreement holds the engine
# to the plain bf16 path's own error); the step monitor watches the mean gap per token, which
# separates: 0.0004-0.028 nats for the right engine (the base model the largest), 0.35-0.54
# for a temperature of 0.7 or 1.3 in the loss, 0.61-0.74 for unsynced weights, 1.7-1.9 for an
# engine on the base weights after training (bench: three 64-row rollouts each).
BF16_ENGINE_GAP = 2.0
BF16_ENGINE_GAP_MEAN = 0.1


def limits_for(monitors, model_dtype: str, precision: Precision) -> MonitorLimits:
    """The limits for a run (`monitors`: its config section): the engine gap a float32 stack
    keeps is far below a bf16 one's."""
    float32_stack = 1e-3 if model_dtype == "float32" else 5e-2
    engine_gap = BF16_ENGINE_GAP if precision.bf16 else float32_stack
    return MonitorLimits(
        engine_gap=engine_gap,
        engine_gap_watched=math.inf if precision.bf16 else float32_stack,
        engine_gap_mean=BF16_ENGINE_GAP_MEAN if precision.bf16 else math.inf,
        clip_frac_max=monitors.clip_frac_max,
        zero_std_max=monitors.zero_std_max,
        reward_strict_gap=monitors.reward_strict_gap,
        tis_capped_max=monitors.tis_capped_max,
    )


@dataclass(frozen=True)
class Watch:
    """One monitored metric: its name in the warning, its upper (or lower) limit, the cause."""

    key: str  # in the step's metrics
    name: str
    limit: str  # the MonitorLimits field
    why: str
    lower: bool = False  # the limit is a minimum
    trainer_logp_old_only: bool = False  # the engine's logp_old is not the trainer's
    # The cause read off the step's metrics, where they tell causes apart (else `why`).
    explain: Callable[[dict], str | None] | None = None


def flat_cause(metrics: dict) -> str | None:
    """Why the groups are flat, when the step knows which samples are right: a task solved
    for these prompts, one out of the model's reach, or a reward that varies with neither."""
    right = metrics.get("frac_reward_zero_std/all_right")
    wrong = metrics.get("frac_reward_zero_std/all_wrong")
    flat = metrics.get("frac_reward_zero_std")
    if not (_known(right) and _known(wrong) and _known(flat)) or flat <= 0:
        return None
    if right >= 0.5 * flat:
        return (
            f"{right / flat:.0%} of the flat groups are all right: the model has solved these "
            "prompts, and what is left to learn is in the rest (harder prompts, or stop here)"
        )
    if wrong >= 0.5 * flat:
        return (
            f"{wrong / flat:.0%} of the flat groups are all wrong: the task is out of the "
            "model's reach for now (an easier task, a denser reward, more samples per prompt)"
        )
    return None


WATCHES = (
    Watch(
        "monitor/ratio_dev",
        "max |ratio - 1| before the first update",
        "ratio_dev",
        "logp_old is not the sampling policy's log-probs: dropout, a stale copy or different "
        "inputs",
        trainer_logp_old_only=True,
    ),
    Watch(
        "kl",
        "kl",
        "kl_min",
        "k3 cannot be negative: check the sign of d = logp_ref - logp_new",
        lower=True,
    ),
    Watch(
        "monitor/adv_group_sum",
        "max |group sum of advantages|",
        "adv_group_sum",
        "groups are not contiguous or not mean-centred",
    ),
    Watch(
        "monitor/engine_gap",
        "max |engine logp - trainer logp|",
        "engine_gap_watched",
        "the engine samples from other weights or another temperature than the trainer",
    ),
    Watch(
        "monitor/engine_gap_mean",
        "mean |engine logp - trainer logp|",
        "engine_gap_mean",
        "the engine samples from other weights or another temperature than the trainer",
    ),
    Watch(
        "clip_frac",
        "clip_frac",
        "clip_frac_max",
        "the policy moves too far per step: lower the learning rate or num_iterations",
    ),
    Watch(
        "tis/capped_frac",
        "share of tokens whose importance weight the cap truncated or dropped",
        "tis_capped_max",
        "the engine's log-probs are far from the trainer's: stale engine weights, another "
        "temperature or top-p on one side, or a tis_cap below the engine's own gap",
    ),
    Watch(
        "tis/capped_seq_frac",
        "share of sequences with an importance weight the cap truncated or dropped",
        "tis_capped_max",
        "the engine's log-probs are far from the trainer's: stale engine weights, another "
        "temperature or top-p on one side, or a tis_cap below the engine's own gap",
    ),
    Watch(
        "frac_reward_zero_std",
        "frac_reward_zero_std",
        "zero_std_max",
        "almost no group has reward variance, so almost nothing is learned",
        explain=flat_cause,
    ),
)


def check_step(
    step: int, metrics: dict, limits: MonitorLimits, trainer_logp_old: bool
) -> list[str]:
    """Warnings for the quantities of one step that are out of their normal range.
    trainer_logp_old: logp_old is the training model's (the ratio must start at 1)."""
    warnings = []
    if metrics.get("skipped"):
        what = metrics.get("nonfinite") or "a value"
        warnings.append(
            f"step {step}: non-finite = {metrics['skipped']} skipped update(s), expected 0 "
            f"({what} went first)"
        )
    for w in WATCHES:
        value, limit = metrics.get(w.key), getattr(limits, w.limit)
        if not _known(value) or (w.trainer_logp_old_only and not trainer_logp_old):
            continue
        if (value < limit) if w.lower else (value > limit):
            expected = f"{'>=' if w.lower else '<='} {limit:g}"
            why = (w.explain(metrics) if w.explain else None) or w.why
            warnings.append(f"step {step}: {w.name} = {value:.3g}, expected {expected} ({why})")
    return warnings


def zeroed_step(step: int, metrics: dict) -> str | None:
    """Why the step must stop the run whatever monitors.action says: every importance weight
    was dropped (tis_mode *_mask), so the loss was exactly 0 and the update had no gradient
    from the data, an error and not a loss of 0 (TRL PR #7120: whole stale batches masked)."""
    dropped = metrics.get("tis/dropped_frac")
    if not _known(dropped) or dropped < 1:
        return None
    return (
        f"step {step}: every token's importance weight was dropped above objective.tis_cap, so "
        "the loss was exactly 0 and nothing was learned from the batch: the engine samples from "
        "other weights or another distribution than the trainer (a failed weight sync, another "
        "temperature), or tis_cap is below the engine's own gap"
    )


class RewardDivergence:
    """The training reward against the strict accuracy of the same samples, both judging the
    task's answer kind (Task.answer_kind: the step's `accuracy` and `strict_accuracy`).

    A gamed reward pays for completions whose final answer is not the reference (the question
    restated as "88 + 22 =", a number anywhere in the text), so the share of samples it rewards
    as right runs ahead of the share that are right. Two gaps per step, each a fraction of the
    step's samples:

      accuracy  `accuracy` (the accuracy reward is 1) - `strict_accuracy`
      reward    the training reward as a fraction of the way from a wrong answer to the right
                one, (reward/mean - wrong) / (right - wrong) clipped to [0, 1], -
                `strict_accuracy`; `scale` = (wrong, right) is the run's total reward for a wrong
                and for the reference answer on real task rows (grpolab.rewards.probes). Not
                watched without a scale: a reward that pays a right and a wrong answer alike
                (format only) says nothing about correctness.

    Each gap is averaged over the last `limits.divergence_window` steps (recorded as
    monitor/accuracy_strict_gap and monitor/reward_strict_gap); once the window is full, an
    average above `limits.reward_strict_gap` is a warning. Only the reward running ahead is
    one: an exact-match reward is stricter than the strict check, never looser.
    """

    GAPS = (
        (
            "monitor/accuracy_strict_gap",
            "accuracy - strict_accuracy",
            "the accuracy reward accepts final answers that are not the reference",
        ),
        (
            "monitor/reward_strict_gap",
            "rewarded-as-right fraction - strict_accuracy",
            "the training reward pays for final answers that are not the reference",
        ),
    )

    def __init__(self, limits: MonitorLimits, scale: tuple[float, float] | None = None):
        self.limits = limits
        self.scale = scale
        self.history = {key: deque(maxlen=limits.divergence_window) for key, _, _ in self.GAPS}

    def update(self, step: int, metrics: dict) -> tuple[dict[str, float], list[str]]:
        """(the windowed gaps to record, warnings) after one step's metrics."""
        strict = metrics.get("strict_accuracy")
        if not _known(strict):
            return {}, []
        # The fraction of the step's samples each measure calls right.
        called_right = {"monitor/accuracy_strict_gap": metrics.get("accuracy")}
        reward = metrics.get("reward/mean")
        if self.scale is not None and _known(reward):
            wrong, right = self.scale
            fraction = (reward - wrong) / (right - wrong)
            called_right["monitor/reward_strict_gap"] = min(1.0, max(0.0, fraction))
        recorded, warnings = {}, []
        for key, name, why in self.GAPS:
            if not _known(called_right.get(key)):
                continue
            window = self.history[key]
            window.append(called_right[key] - strict)
            recorded[key] = mean = sum(window) / len(window)
            limit = self.limits.reward_strict_gap
            if len(window) == window.maxlen and mean > limit:
                warnings.append(
                    f"step {step}: {name} = {mean:.3g} over the last {len(window)} steps, "
                    f"expected <= {limit:g} ({why}: the signature of a gamed reward; read the "
                    "completions beside their reference answers)"
                )
        return recorded, warnings


def _known(value) -> bool:
    return isinstance(value, int | float) and not math.isnan(value)


def count_nonfinite(run: Run, skipped: int) -> None:
    """The non-finite guard's counters after a step that skipped `skipped` updates."""
    if skipped:
        run.skipped_steps += 1
        run.consecutive_nonfinite += 1
    else:
        run.consecutive_nonfinite = 0


def write_capsule(path: Path, run: Run, batch: StepBatch, what: str | None) -> None:
    """Everything needed to replay the failing step: its batch, old/ref log-probs, rewards,
    advantages and the RNG and prompt-draw states. The weights are still the sampler's (no
    update of the step went through), so an on-policy logp_old is recomputed from them."""
    logp_old = batch.logp_old
    if logp_old is None:
        logp_old, _ = logprobs_in_chunks(run, run.model, batch)
    cpu = _on_cpu
    torch.save(
        {
            "step": batch.step,
            "what": what,
            "input_ids": cpu(batch.input_ids),
            "attention_mask": cpu(batch.attention_mask),
            "completion_mask": cpu(batch.completion_mask),
            "rewards": cpu(batch.rewards),
            "advantages": cpu(batch.advantages),
            "logp_old": cpu(logp_old),
            "logp_ref": cpu(batch.logp_ref),
            "prompts": batch.rollout.prompts,
            "completions": batch.rollout.completions,
            "answers": batch.answers(),
            "rng": rng_state(),
            "data_generator": run.prompt_generator.get_state(),
        },
        path,
    )


def _on_cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu()
