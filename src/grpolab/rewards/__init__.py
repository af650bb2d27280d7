"""Rewards: score each completion, combine several functions with weights, lose nothing.

    rewards = load_rewards(RewardsConfig(functions=["accuracy", "format"], weights=[1, 0.1]),
                           task="gsm8k", max_completion_length=256)
    result = score(rollout, examples, rewards)   # examples: one per prompt (or per sample)
    result.total          # [B] sum_k weight_k * reward_k (None counts 0, as TRL's nansum)
    result.per_function   # name -> [B] unweighted values; NaN where a function returned None
    result.scorable       # [B] bool: some function scored the sample (all None: out of the
                          # group statistics, advantage 0, TRL's convention)
    result.errors         # name -> samples that got the fallback in this call
    result.error_texts    # name -> that function's last failure in this call, one line
    result.metrics        # rewards/<name>/mean, reward_errors/<name>, frac_reward_zero_std, ...

A function that raises, returns a non-finite value or the wrong number of values, or runs past
its timeout is not fatal and not silent: the affected samples get the fallback value, the count
goes to reward_errors/<name>, and the first failure's traceback is logged once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grpolab.rewards.builtin import (
    ACCURACY_MODES,
    DEFAULT_FORMAT_PATTERN,
    make_accuracy,
    make_format,
    make_gym_score,
    make_overlong,
)
from grpolab.rewards.functions import (
    BUILTIN_REWARDS,
    RewardCallError,
    RewardFunction,
    resolve_function,
)
from grpolab.rewards.judge import remote
from grpolab.rewards.model import RewardModel, is_model_reference, model_display_name
from grpolab.rollout.base import Rollout
from grpolab.rollout.episodes import episode_metrics
from grpolab.tasks.base import Example, Task, TaskConfig
from grpolab.tasks.conversation import Conversation

# A group whose rewards' population std is at most this is flat: its advantages are 0.
ZERO_STD_EPS = 1e-4


@dataclass(frozen=True)
class RewardsConfig:
    """The `rewards` config section (TRL: reward_funcs / reward_weights)."""

    # Built-in names (accuracy, format, overlong), "package.module:function" or
    # "path/to/file.py:function" with the signature f(completions, **columns) -> list, or a
    # sequence-classification reward model: a directory or a hub id (rewards.model).
    functions: list[str] = field(default_factory=lambda: ["accuracy"])
    weights: list[float] | None = None  # one per function; None = all 1.0
    timeout: float | None = 30.0  # seconds per call of a user function; None = no limit
    fallback: float = 0.0  # the reward of a sample whose function failed
    # auto (the task's answer kind: number -> exact for arithmetic, else math; math; string;
    # choice) | exact | math
    accuracy_mode: str = "auto"
    format_pattern: str = DEFAULT_FORMAT_PATTERN  # re.search, DOTALL
    overlong_buffer: int | None = None  # DAPO's L_cache in tokens; None = max_length // 4


@dataclass
class RewardResult:
    total: torch.Tensor  # [B] float32, weighted sum
    per_function: dict[str, torch.Tensor]  # name -> [B] float32, NaN where not applicable
    errors: dict[str, int]  # name -> samples that got the fallback
    metrics: dict[str, float]
    error_texts: dict[str, str] = field(default_factory=dict)  # name -> its last failure
    scorable: torch.Tensor | None = None  # [B] bool; None: every sample
    # The samples the functions were called on, that `errors` counts among: B, or more when
    # the rows were kept from several scored rounds (gather_scores).
    samples: int | None = None

    def __post_init__(self) -> None:
        if self.scorable is None:
            self.scorable = torch.ones(self.total.shape, dtype=torch.bool)
        if self.samples is None:
            self.samples = self.total.shape[0]


class Rewards(list):
    """The resolved reward functions of a run (a list of RewardFunction, in config order)."""


RewardsLike = Rewards | RewardsConfig | Sequence[str | Callable[..., Any]]


def load_rewards(
    cfg: RewardsLike | None = None,
    task: Task | TaskConfig | str | None = None,
    max_completion_length: int | None = None,
) -> Rewards:
    """Resolve every reward function once, checking names, files and weights.

    task: the task, for accuracy_mode="auto": its answer kind is the accuracy's judge (a task
    config or a name gives only a declared kind, or the arithmetic task's number);
    max_completion_length: the rollout's, for the overlong reward.
    """
    if isinstance(cfg, Rewards):
        return cfg
    if cfg is None:
        cfg = RewardsConfig()
    elif not isinstance(cfg, RewardsConfig):
        cfg = RewardsConfig(functions=list(cfg))
    kind = _task_judge(task)[1]
    weights = _checked_weights(cfg)
    out = Rewards()
    seen: dict[str, int] = {}
    for ref, weight in zip(cfg.functions, weights, strict=True):
        builtin = isinstance(ref, str) and ref in BUILTIN_REWARDS
        if ref == "accuracy" and isinstance(task, Task) and not task.has_references:
            raise ValueError(
                "the 'accuracy' reward needs reference answers, and the task's rows have none "
                "(no 'answer' or 'solution' field; task.answer_field names another): name "
                "the reward functions that judge them (rewards.functions, reward_funcs)"
            )
        fn = _reward_callable(ref, cfg, task, kind, max_completion_length)
        name = _display(ref)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name}_{seen[name]}"
        out.append(
            RewardFunction(
                name=name,
                fn=fn,
                weight=float(weight),
                timeout=cfg.timeout,
                fallback=float(cfg.fallback),
                threaded=not builtin,
                needs_token_ids=ref == "overlong",
                learned=getattr(fn, "learned", False),
                reads_messages=not builtin,
            )
        )
    return out


def _checked_weights(cfg: RewardsConfig) -> list[float]:
    """The functions' weights (1 each unless given), after every rewards.* value is checked."""
    if not cfg.functions:
        raise ValueError("rewards.functions is empty: name at least one reward function")
    weights = cfg.weights if cfg.weights is not None else [1.0] * len(cfg.functions)
    if len(weights) != len(cfg.functions):
        raise ValueError(
            f"rewards.weights has {len(weights)} values for {len(cfg.functions)} functions "
            f"{list(map(_display, cfg.functions))}"
        )
    for i, w in enumerate(weights):
        if not math.isfinite(w):
            raise ValueError(f"rewards.weights[{i}]={w!r} is not finite")
    if cfg.timeout is not None and not cfg.timeout > 0:
        raise ValueError(f"rewards.timeout={cfg.timeout!r} must be > 0 (or null: no limit)")
    if not math.isfinite(cfg.fallback):
        raise ValueError(f"rewards.fallback={cfg.fallback!r} is not finite")
    if cfg.accuracy_mode not in ACCURACY_MODES:
        raise ValueError(
            f"rewards.accuracy_mode={cfg.accuracy_mode!r} is not one of {list(ACCURACY_MODES)}"
        )
    return weights


def _reward_callable(ref, cfg: RewardsConfig, task, kind, max_completion_length):
    """What rewards.functions' entry `ref` names: a built-in made for this task, a reward
    model (loaded, or a hub id / directory), a function object, or one in a file or module."""
    task_name = _task_judge(task)[0]
    if isinstance(ref, str) and ref in BUILTIN_REWARDS:
        return {
            "accuracy": lambda: make_accuracy(cfg.accuracy_mode, task_name, kind),
            "format": lambda: make_format(cfg.format_pattern),
            "overlong": lambda: make_overlong(max_completion_length, cfg.overlong_buffer),
            "gym_score": lambda: make_gym_score(task),
        }[ref]()
    if isinstance(ref, torch.nn.Module):  # a loaded reward model (the Python API)
        return RewardModel(ref)
    if callable(ref):
        return ref
    if isinstance(ref, str) and is_model_reference(ref):
        return RewardModel(ref)
    if isinstance(ref, str):
        return resolve_function(ref)
    raise ValueError(f"rewards.functions: {ref!r} is neither a name nor a function")


def _task_judge(task: Task | TaskConfig | str | None) -> tuple[str | None, str | None]:
    """(the task's name, its answer kind or None when only a loaded task would know it)."""
    if isinstance(task, Task):
        return task.name, task.answer_kind
    if isinstance(task, TaskConfig):
        return task.name, task.answer_kind
    return task, None


def _display(ref: str | Callable[..., Any]) -> str:
    if isinstance(ref, torch.nn.Module):
        return model_display_name(str(getattr(ref, "name_or_path", "") or type(ref).__name__))
    if callable(ref):
        return getattr(ref, "__name__", type(ref).__name__)
    if ":" in ref:
        return ref.rpartition(":")[2]
    return model_display_name(ref) if is_model_reference(ref) else ref


def score(
    rollout_or_completions: Rollout | Sequence[str],
    examples: Sequence[Example],
    rewards: RewardsLike | None = None,
    num_generations: int | None = None,
    zero_std_eps: float = ZERO_STD_EPS,
    completion_ids: Sequence[Sequence[int]] | None = None,
) -> RewardResult:
    """Reward every sample; combine with weights; report per-function means and errors.

    examples: one per prompt (repeated over its G samples) or one per sample, in rollout order.
    With plain completions, num_generations gives G (default: one group of all samples) and
    completion_ids their token ids (needed by the 'overlong' reward).
    """
    if not isinstance(rewards, Rewards):
        rewards = load_rewards(rewards)
    rollout, completions, G = _samples(rollout_or_completions, num_generations)
    B = len(completions)
    per_sample = _expand_examples(examples, B, G, rollout)
    columns, conversational = _reward_columns(per_sample, rollout, completion_ids, rewards, B)
    total, per_function, errors, metrics, error_texts = _run_rewards(
        rewards, completions, columns, conversational
    )
    if rollout is not None and rollout.episode_rewards is not None:
        total += _environment_reward(rollout.episode_rewards, per_function, metrics)
    # A sample every function scored None (a failure gets the fallback, not None) has no
    # reward: it counts 0 in the total but does not vote in its group's baseline.
    scorable = torch.zeros(B, dtype=torch.bool)
    for t in per_function.values():
        scorable |= ~t.isnan()
    if not per_function:
        scorable[:] = True
    metrics |= _batch_metrics(total, scorable, G, zero_std_eps, rollout)
    return RewardResult(
        total=total,
        per_function=per_function,
        errors=errors,
        metrics=metrics,
        error_texts=error_texts,
        scorable=scorable,
    )


def _samples(rollout_or_completions, num_generations: int | None):
    """(the Rollout or None, the completions' texts, G), G checked against the batch."""
    if isinstance(rollout_or_completions, Rollout):
        rollout = rollout_or_completions
        G = _group_size(rollout.group_ids)
        if num_generations is not None and num_generations != G:
            raise ValueError(f"num_generations={num_generations} but the rollout has G={G}")
        return rollout, list(rollout.completions), G
    completions = list(rollout_or_completions)
    B = len(completions)
    G = num_generations or B
    if B == 0 or B % G:
        raise ValueError(f"{B} completions are not a positive multiple of G={G}")
    return None, completions, G


def _reward_columns(per_sample, rollout, completion_ids, rewards, B: int):
    """(the keyword columns every reward function is given, one value per sample; whether
    the prompts are conversations)."""
    columns: dict[str, list] = {}
    for key in dict.fromkeys(k for ex in per_sample for k in ex.columns):
        columns[key] = [ex.columns.get(key) for ex in per_sample]
    # A conversational prompt reaches the functions as its messages, and then so does each
    # completion, as one assistant message (TRL's convention); the built-ins read text.
    conversational = any(isinstance(ex.prompt, Conversation) for ex in per_sample)
    columns["prompt"] = [
        ex.prompt.as_list() if isinstance(ex.prompt, Conversation) else ex.prompt
        for ex in per_sample
    ]
    columns["prompts"] = columns["prompt"]  # TRL's name
    columns["answer"] = [ex.answer for ex in per_sample]
    if rollout is not None:
        columns["completion_ids"] = _completion_ids(rollout)
    elif completion_ids is not None:
        if len(completion_ids) != B:
            raise ValueError(f"{len(completion_ids)} completion_ids for {B} completions")
        columns["completion_ids"] = [list(ids) for ids in completion_ids]
    elif any(fn.needs_token_ids for fn in rewards):
        raise ValueError("the 'overlong' reward needs token ids: score a Rollout")
    return columns, conversational


def _run_rewards(rewards: Rewards, completions: list[str], columns: dict, conversational: bool):
    """Each function on every sample: (weighted total [B], values per function [B] with NaN
    where it gave None, errors per function, its metrics, its last error's text)."""
    B = len(completions)
    total = torch.zeros(B, dtype=torch.float32)
    per_function: dict[str, torch.Tensor] = {}
    errors: dict[str, int] = {}
    metrics: dict[str, float] = {}
    error_texts: dict[str, str] = {}
    as_messages = [[{"role": "assistant", "content": c}] for c in completions]
    for fn in rewards:
        fn.last_error = None
        texts = as_messages if conversational and fn.reads_messages else completions
        values, n_errors = fn(texts, columns)
        if n_errors:
            error_texts[fn.name] = fn.last_error or "failed"
        t = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)
        per_function[fn.name] = t
        errors[fn.name] = n_errors
        total += fn.weight * torch.nan_to_num(t, nan=0.0)
        metrics |= _function_metrics(fn.name, t, n_errors)
    return total, per_function, errors, metrics, error_texts


def _function_metrics(name: str, values: torch.Tensor, n_errors: int) -> dict[str, float]:
    """A function's mean and spread over the samples it scored ([B], NaN: None), its errors,
    and the share it gave None (when any)."""
    valid = values[~values.isnan()]
    metrics = {
        f"rewards/{name}/mean": valid.mean().item() if valid.numel() else 0.0,
        f"rewards/{name}/std": valid.std(unbiased=False).item() if valid.numel() else 0.0,
        f"reward_errors/{name}": float(n_errors),
    }
    if valid.numel() < values.numel():
        metrics[f"rewards/{name}/none_frac"] = 1 - valid.numel() / values.numel()
    return metrics


def gather_scores(
    kept: Sequence[tuple[RewardResult, slice]],
    rounds: Sequence[RewardResult],
    rollout: Rollout,
    zero_std_eps: float = ZERO_STD_EPS,
) -> RewardResult:
    """The scores of rows kept from several scored rounds as one result for `rollout` (those
    rows in that order): kept = (a round's result, the rows taken from it) each. Every
    sample keeps the scores it was kept for (a stochastic reward scored again could make a
    kept group flat); `errors` counts every failure of every round's calls, out of all the
    samples they scored (`samples`)."""
    names = dict.fromkeys(n for r in rounds for n in r.per_function)  # in call order

    def column(name: str) -> torch.Tensor:
        return torch.cat([
            r.per_function[name][rows] if name in r.per_function
            else torch.full_like(r.total[rows], math.nan)
            for r, rows in kept
        ])  # fmt: skip

    total = torch.cat([r.total[rows] for r, rows in kept])
    per_function = {name: column(name) for name in names}
    scorable = torch.cat([r.scorable[rows] for r, rows in kept])
    errors = {n: sum(r.errors.get(n, 0) for r in rounds) for n in dict.fromkeys(
        n for r in rounds for n in r.errors)}  # fmt: skip
    metrics: dict[str, float] = {}
    for name, values in per_function.items():
        if name in errors:
            metrics |= _function_metrics(name, values, errors[name])
        else:  # the environment's reward, as _environment_reward reports it
            valid = values[~values.isnan()]
            metrics[f"rewards/{name}/mean"] = valid.mean().item() if valid.numel() else 0.0
    G = _group_size(rollout.group_ids)
    metrics |= _batch_metrics(total, scorable, G, zero_std_eps, rollout)
    error_texts = {n: t for r in rounds for n, t in r.error_texts.items()}
    samples = sum(r.samples for r in rounds)
    return RewardResult(
        total=total, per_function=per_function, errors=errors, metrics=metrics,
        error_texts=error_texts, scorable=scorable, samples=samples,
    )  # fmt: skip


def flat_groups(total: torch.Tensor, G: int, eps: float = ZERO_STD_EPS) -> torch.Tensor:
    """[B] rewards -> [B / G] bool: the groups whose rewards do not vary (nothing to learn)."""
    return total.view(-1, G).std(dim=1, unbiased=False) <= eps


def flat_verdicts(total: torch.Tensor, correct: torch.Tensor, G: int) -> dict[str, float]:
    """The share of groups that are flat because every sample is right, and because every
    one is wrong ([B] rewards, [B] bool correct): a flat batch of a solved task is not one of
    a task out of reach."""
    flat = flat_groups(total.cpu(), G)
    right = correct.cpu().view(-1, G)
    return {
        "frac_reward_zero_std/all_right": (flat & right.all(dim=1)).float().mean().item(),
        "frac_reward_zero_std/all_wrong": (flat & ~right.any(dim=1)).float().mean().item(),
    }


def _batch_metrics(total, scorable, G: int, zero_std_eps: float, rollout) -> dict[str, float]:
    """The batch's reward spread, flat groups, and (for a Rollout) its lengths."""
    metrics = {"reward/unscorable": 1 - scorable.float().mean().item()}
    metrics["reward/mean"] = total.mean().item()
    metrics["reward/std"] = total.std(unbiased=False).item()
    metrics["frac_reward_zero_std"] = flat_groups(total, G, zero_std_eps).float().mean().item()
    if rollout is not None:
        lengths = rollout.completion_mask.sum(dim=1).float()
        metrics["truncated_frac"] = rollout.truncated.float().mean().item()
        metrics["completion_length/mean"] = lengths.mean().item()
        metrics["completion_length/max"] = lengths.max().item()
        metrics["completion_length/min"] = lengths.min().item()
        metrics |= episode_metrics(rollout)
    return metrics


def _environment_reward(
    values: Sequence[float | None], per_function: dict, metrics: dict
) -> torch.Tensor:
    """The environment's reward at the end of each episode (rollout.environment), added to
    the total as the function "environment"; 0 where it gives none."""
    if all(v is None for v in values):
        return torch.zeros(len(values))
    t = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
    per_function["environment"] = t
    valid = t[~t.isnan()]
    metrics["rewards/environment/mean"] = valid.mean().item() if valid.numel() else 0.0
    return torch.nan_to_num(t, nan=0.0)


def _group_size(group_ids: torch.Tensor) -> int:
    """G from contiguous group ids 0,0,..,1,1,..; anything else is a broken rollout."""
    B = group_ids.numel()
    n_groups = int(group_ids.max().item()) + 1 if B else 0
    G = B // n_groups if n_groups else 0
    expected = torch.arange(n_groups).repeat_interleave(G) if G else None
    if expected is None or expected.numel() != B or not torch.equal(group_ids.cpu(), expected):
        raise ValueError(
            "rollout.group_ids are not contiguous equal-size groups 0,0,..,1,1,..: "
            f"{group_ids.tolist()[:16]}"
        )
    return G


def _expand_examples(
    examples: Sequence[Example], B: int, G: int, rollout: Rollout | None
) -> list[Example]:
    n = len(examples)
    if n == B:
        per_sample = list(examples)
    elif n * G == B:
        per_sample = [ex for ex in examples for _ in range(G)]
    else:
        raise ValueError(
            f"{n} examples for {B} samples with G={G}: pass one example per prompt "
            f"({B // G}) or one per sample ({B})"
        )
    if rollout is not None:
        for i, (ex, prompt) in enumerate(zip(per_sample, rollout.prompts, strict=True)):
            if ex.prompt != prompt:
                raise ValueError(
                    f"examples do not line up with the rollout: sample {i} answers prompt "
                    f"{prompt!r} but its example's prompt is {ex.prompt!r}"
                )
    return per_sample


def _completion_ids(rollout: Rollout) -> list[list[int]]:
    mask = rollout.completion_mask.bool()
    return [row[m].tolist() for row, m in zip(rollout.input_ids, mask, strict=True)]


__all__ = [
    "BUILTIN_REWARDS",
    "RewardCallError",
    "RewardFunction",
    "RewardModel",
    "RewardResult",
    "Rewards",
    "RewardsConfig",
    "gather_scores",
    "load_rewards",
    "remote",
    "score",
]
