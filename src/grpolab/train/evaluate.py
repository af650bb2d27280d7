"""Held-out evaluation: greedy accuracy, and pass@k from n samples per problem.

Two accuracies are reported side by side: the reward-based one (the accuracy reward is 1) and
the strict one (grpolab.tasks.strict: the final answer as written is exactly the reference), an
independent check that a reward bug cannot also bend. They part ways when the reward is being
gamed. Both judge the task's answer kind (Task.answer_kind: number, string, choice or math).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from grpolab.rewards import (
    RewardResult,
    Rewards,
    RewardsConfig,
    flat_groups,
    load_rewards,
    score,
)
from grpolab.rollout.base import SamplingParams
from grpolab.tasks.base import Example
from grpolab.tasks.strict import strict_equal


def accuracy_rewards(rewards_cfg: RewardsConfig | None, task) -> Rewards:
    """The accuracy reward alone (1 = correct), in the run's accuracy mode, judging `task`'s
    answer kind (a Task; a TaskConfig or a name as load_rewards reads them)."""
    mode = getattr(rewards_cfg, "accuracy_mode", "auto")
    if not getattr(task, "has_references", True):
        return Rewards()  # nothing to be right about
    return load_rewards(RewardsConfig(functions=["accuracy"], accuracy_mode=mode), task=task)


def correct(
    completions: Sequence[str], examples: Sequence[Example], rewards: Rewards
) -> torch.Tensor:
    """[B] bool: the accuracy reward is 1. One example per completion."""
    result = score(list(completions), list(examples), rewards, num_generations=1)
    return torch.nan_to_num(result.per_function["accuracy"], nan=0.0) >= 1.0


def correct_answers(
    scores: RewardResult,
    completions: Sequence[str],
    examples: Sequence[Example],
    training: Rewards,
    accuracy: Rewards,
) -> torch.Tensor:
    """[B] bool: the accuracy reward is 1 for each completion. When the training rewards
    already ran that very function, its values are read from `scores` instead of parsing
    every completion again. examples: one per prompt or one per completion."""
    wanted = accuracy[0]
    for fn in training:
        if fn.fn is wanted.fn and fn.fallback == wanted.fallback:
            return torch.nan_to_num(scores.per_function[fn.name], nan=0.0) >= 1.0
    per_completion = list(examples)
    if len(per_completion) != len(completions):
        G = len(completions) // len(per_completion)
        per_completion = [e for e in per_completion for _ in range(G)]
    return correct(completions, per_completion, accuracy)


def strict_correct(
    completions: Sequence[str], answers: Sequence[str], kind: str = "number"
) -> torch.Tensor:
    """[B] bool: the final answer as written is exactly the reference (grpolab.tasks.strict, judging
    answers of `kind`)."""
    hits = [strict_equal(c, a, kind) for c, a in zip(completions, answers, strict=True)]
    return torch.tensor(hits, dtype=torch.bool)


def task_strict_correct(task, completions: Sequence[str], examples: Sequence[Example]):
    """[B] bool: the task's strict judge on each completion (examples: one per completion):
    its own where it has one (Task.strict_judge: a reasoning-gym generator's score_answer
    giving 1), else the strict check of its answer kind."""
    return torch.tensor(task.strict_hits(list(completions), list(examples)), dtype=torch.bool)


@dataclass(frozen=True)
class HeldOutAccuracy:
    accuracy: float  # percent: the accuracy reward is 1
    strict_accuracy: float  # percent: the final answer is exactly the reference


def evaluate_greedy(
    engine,
    examples: Sequence[Example],
    rewards: Rewards,
    max_completion_length: int,
    batch_size: int = 500,
    answer_kind: str = "number",
    on_batch: Callable[[int], None] | None = None,
    judge: Callable[[str, Example], bool] | None = None,
) -> HeldOutAccuracy:
    """Greedy reward-based and strict accuracy, in percent, on `examples` (the strict check
    judging answers of `answer_kind`: the task's, or the task's own `judge`,
    Task.strict_judge); on_batch(done): called after each batch with the problems evaluated
    so far."""
    hits = strict = 0
    params = SamplingParams(temperature=0.0, max_completion_length=max_completion_length)
    for s in range(0, len(examples), batch_size):
        chunk = list(examples[s : s + batch_size])
        rollout = engine.generate([e.prompt for e in chunk], 1, params)
        hits += int(correct(rollout.completions, chunk, rewards).sum())
        if judge is not None:
            pairs = zip(rollout.completions, chunk, strict=True)
            strict += sum(bool(judge(c, e)) for c, e in pairs)
        else:
            answers = [e.answer for e in chunk]
            strict += int(strict_correct(rollout.completions, answers, answer_kind).sum())
        if on_batch is not None:
            on_batch(s + len(chunk))
    n = max(1, len(examples))
    return HeldOutAccuracy(100.0 * hits / n, 100.0 * strict / n)


def evaluate_accuracy(
    engine,
    examples: Sequence[Example],
    rewards: Rewards,
    max_completion_length: int,
    batch_size: int = 500,
) -> float:
    """Greedy accuracy in percent on `examples` (the reward-based one)."""
    return evaluate_greedy(engine, examples, rewards, max_completion_length, batch_size).accuracy


def evaluate_rewards(
    engine,
    examples: Sequence[Example],
    rewards: Rewards,
    num_generations: int,
    params: SamplingParams,
    batch_size: int,
) -> dict[str, float]:
    """The training rewards of `num_generations` samples per prompt (`params`: the training
    sampling, its seed moved on per batch), in batches of at most `batch_size` sequences;
    the step's reward metrics (reward/mean|std, rewards/<name>/mean|std, reward_errors/<name>,
    frac_reward_zero_std, completion_length/mean|min|max, truncated_frac) over all of them."""
    G = num_generations
    per = max(1, batch_size // G)
    parts: dict[str, list[torch.Tensor]] = {}
    errors: dict[str, int] = {}
    for s in range(0, len(examples), per):
        chunk = list(examples[s : s + per])
        sampling = dataclasses.replace(params, seed=params.seed + s)
        rollout = engine.generate([e.prompt for e in chunk], G, sampling)
        result = score(rollout, chunk, rewards)
        named = {"total": result.total, "truncated": rollout.truncated.float().cpu(),
                 "length": rollout.completion_mask.sum(dim=1).float().cpu(),
                 **{f"fn:{k}": v for k, v in result.per_function.items()}}  # fmt: skip
        for key, values in named.items():
            parts.setdefault(key, []).append(values)
        for name, n in result.errors.items():
            errors[name] = errors.get(name, 0) + n
    every = {k: torch.cat(v) for k, v in parts.items()}
    total, length = every.pop("total"), every.pop("length")
    metrics = {
        "reward/mean": total.mean().item(),
        "reward/std": total.std(unbiased=False).item(),
        "frac_reward_zero_std": flat_groups(total, G).float().mean().item(),
        "completion_length/mean": length.mean().item(),
        "completion_length/min": length.min().item(),
        "completion_length/max": length.max().item(),
        "truncated_frac": every.pop("truncated").mean().item(),
    }
    for key, values in every.items():
        valid = values[~values.isnan()]
        name = key.removeprefix("fn:")
        metrics[f"rewards/{name}/mean"] = valid.mean().item() if valid.numel() else math.nan
        metrics[f"rewards/{name}/std"] = valid.std(unbiased=False).item() if valid.numel() else 0.0
        metrics[f"reward_errors/{name}"] = float(errors.get(name, 0))
    return metrics


def pass_at_k_estimate(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def evaluate_pass_at_k(
    engine,
    examples: Sequence[Example],
    rewards: Rewards,
    max_completion_length: int,
    k: int,
    n: int | None = None,
    temperature: float = 1.0,
    seed: int = 0,
    batch_prompts: int = 64,
    on_batch: Callable[[int], None] | None = None,
) -> float:
    """pass@k in percent from n >= k samples per problem at `temperature`; on_batch(done):
    called after each batch with the problems evaluated so far."""
    n = n or k
    if n < k:
        raise ValueError(f"pass@k needs n >= k samples, got n={n}, k={k}")
    total = 0.0
    for s in range(0, len(examples), batch_prompts):
        chunk = list(examples[s : s + batch_prompts])
        params = SamplingParams(
            temperature=temperature, max_completion_length=max_completion_length, seed=seed + s
        )
        rollout = engine.generate([e.prompt for e in chunk], n, params)
        per_sample = [e for e in chunk for _ in range(n)]
        hits = correct(rollout.completions, per_sample, rewards).view(-1, n).sum(1)  # [prompts]
        total += sum(pass_at_k_estimate(n, int(c), k) for c in hits)
        if on_batch is not None:
            on_batch(s + len(chunk))
    return 100.0 * total / max(1, len(examples))
