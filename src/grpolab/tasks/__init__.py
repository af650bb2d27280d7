"""Tasks: prompts with reference answers. `load_task(TaskConfig(...))` -> Task."""

from __future__ import annotations

from grpolab.tasks.arithmetic import load_arithmetic
from grpolab.tasks.base import Example, Task, TaskConfig
from grpolab.tasks.files import FILE_TASK_DEFAULTS, SAMPLE_GSM8K, load_file_task

TASKS = ("arithmetic", *FILE_TASK_DEFAULTS)


def load_task(cfg: TaskConfig | None = None) -> Task:
    """Build the task `cfg` names: train and eval examples, disjoint, deterministic in cfg.seed."""
    cfg = cfg or TaskConfig()
    if cfg.name == "arithmetic":
        return load_arithmetic(cfg)
    if cfg.name in FILE_TASK_DEFAULTS:
        return load_file_task(cfg)
    raise ValueError(f"task.name={cfg.name!r} is not one of {list(TASKS)}")


__all__ = ["SAMPLE_GSM8K", "TASKS", "Example", "Task", "TaskConfig", "load_task"]
