"""Tasks: prompts with reference answers. `load_task(TaskConfig(...))` -> Task."""

from __future__ import annotations

from grpolab.tasks.answers import ANSWER_KINDS, check_answer_kind, infer_answer_kind
from grpolab.tasks.arithmetic import load_arithmetic
from grpolab.tasks.base import GENERATED_NUM_EVAL, Example, GivenRows, Task, TaskConfig
from grpolab.tasks.files import FILE_TASK_DEFAULTS, SAMPLE_GSM8K, load_file_task
from grpolab.tasks.gym import load_gym

TASKS = ("arithmetic", "reasoning_gym", *FILE_TASK_DEFAULTS)
# Tasks that generate their problems: each holds out GENERATED_NUM_EVAL unless told.
GENERATED_TASKS = ("arithmetic", "reasoning_gym")


def load_task(cfg: TaskConfig | None = None) -> Task:
    """Build the task `cfg` names: train and eval examples, disjoint, deterministic in cfg.seed."""
    cfg = cfg or TaskConfig()
    if cfg.answer_kind is not None and cfg.answer_kind not in ANSWER_KINDS:
        raise ValueError(
            f"task.answer_kind={cfg.answer_kind!r}: expected one of {', '.join(ANSWER_KINDS)}"
        )
    if cfg.name == "arithmetic":
        task = load_arithmetic(cfg)
    elif cfg.name == "reasoning_gym":
        task = load_gym(cfg)
    elif cfg.name in FILE_TASK_DEFAULTS:
        task = load_file_task(cfg)
    else:
        raise ValueError(f"task.name={cfg.name!r} is not one of {list(TASKS)}")
    task.answer_kind, task.answer_kind_reason = answer_kind(cfg, task)
    return task


def answer_kind(cfg: TaskConfig, task: Task) -> tuple[str, str]:
    """The task's judge and why: declared (and fitting every reference), the arithmetic
    task's own (number), or inferred from the references."""
    splits = (("train", task.train), ("eval", task.eval))
    if not task.has_references:
        return cfg.answer_kind or "string", "no reference answers: nothing is judged by it"
    if cfg.answer_kind is not None:
        references = [
            (f"{split} row {i} ({_short(e.prompt)})", e.answer)
            for split, rows in splits
            for i, e in enumerate(rows)
        ]
        check_answer_kind(cfg.answer_kind, references)
        return cfg.answer_kind, "task.answer_kind"
    if cfg.name == "arithmetic":
        return "number", "the arithmetic task's answers are integers"
    kind, why = infer_answer_kind([e.answer for _, rows in splits for e in rows])
    return kind, f"inferred from the data: {why}; task.answer_kind=... to choose"


def _short(text, width: int = 40) -> str:
    text = " ".join(str(text).split())
    return repr(text if len(text) <= width else text[: width - 3] + "...")


__all__ = [
    "ANSWER_KINDS",
    "GENERATED_NUM_EVAL",
    "GENERATED_TASKS",
    "SAMPLE_GSM8K",
    "TASKS",
    "Example",
    "GivenRows",
    "Task",
    "TaskConfig",
    "load_task",
]
