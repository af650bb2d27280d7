"""What a task is: prompts with reference answers, a fixed eval split, reproducible sampling."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grpolab.tasks.strict import strict_equal

GENERATED_NUM_EVAL = 500  # a generated task's held-out problems, unless task.num_eval is given
AUTO_HOLD_OUT_KEEPS = 0.9  # a file's share that must still train for an unasked hold-out


@dataclass(frozen=True)
class TaskConfig:
    """Which prompts to train on. One flat section; the fields a task does not use are ignored.

    name: "arithmetic" (built in, generated), "reasoning_gym" (any of reasoning-gym's
    generators, grpolab.tasks.gym), "gsm8k" (question / "... #### 42" answer rows),
    "jsonl" (any rows, .jsonl/.json/.parquet or a dataset id; prompt_field / answer_field
    name the columns).
    """

    name: str = "arithmetic"
    # arithmetic: "a<op>b=" -> str(result); operands drawn from [min_operand, max_operand].
    min_operand: int = 10
    max_operand: int = 99
    operators: str = "+"  # any of "+-*"
    # reasoning_gym: a generator's name ("chain_sum"), or a list of names and mappings
    # {name, weight (default 1), config (its parameters)} drawn by weight; dataset_config:
    # a single generator's parameters (grpolab.tasks.gym).
    dataset: Any = None
    dataset_config: dict[str, Any] | None = None
    # Held-out prompts. None: a generated task holds out GENERATED_NUM_EVAL; a file task holds
    # out that many rows only when at least AUTO_HOLD_OUT_KEEPS of its rows still train (a
    # user's small file is trained on whole; task.num_eval, task.eval_fraction or
    # task.eval_path hold rows out when asked).
    num_eval: int | None = None
    # Arithmetic spaces larger than ARITHMETIC_ENUMERATE_LIMIT are sampled, not enumerated:
    # num_train (0 = all remaining) caps the training set.
    num_train: int = 0
    seed: int = 0
    # File-based tasks: a local .jsonl / .json / .parquet file, or a Hugging Face dataset id.
    path: str | None = None
    eval_path: str | None = None  # a separate eval file; else rows of task.path are held out
    # File tasks without eval_path: hold out this fraction of the rows (chosen by seed) instead
    # of num_eval. Either way the split is printed with its row counts at start.
    eval_fraction: float | None = None
    subset: str | None = None  # dataset config name for hub ids (e.g. "main" for openai/gsm8k)
    split: str = "train"
    eval_split: str | None = None  # with a hub id: take eval from this split
    # None: the task's default (gsm8k: question / answer; jsonl: prompt / answer).
    prompt_field: str | None = None
    answer_field: str | None = None
    # Formatted with the row's fields; "{prompt}" is the prompt field's text. None: the task's
    # default ("{prompt}"; gsm8k adds an instruction to end with "#### <answer>"; arithmetic
    # writes "{a}{op}{b}=" and fills {a}, {op}, {b} in a template such as "What is {a} {op} {b}?").
    prompt_template: str | None = None
    chat_template: bool = False  # render prompts through the tokenizer's chat template
    system_prompt: str | None = None  # with chat_template: a system message first
    # How a completion's final answer is judged against the reference: number | string |
    # choice | math (grpolab.tasks.answers). None: number for arithmetic; a file task's is
    # inferred from its reference answers, and printed with the reason at start.
    answer_kind: str | None = None
    # The rows themselves, given in Python (GivenRows: a list of dicts, read as a file's rows
    # are) instead of task.path / task.eval_path; config.yaml records them as a line
    # (GivenRows.record), which names them as not on disk when read back.
    rows: Any = None
    eval_rows: Any = None


class GivenRows(list):
    """Rows a Python caller gave (dicts), and the argument that gave them (`label`, which
    errors name: "train_dataset row 3: ...")."""

    def __init__(self, rows: Any, label: str):
        super().__init__(rows)
        self.label = label

    def record(self) -> str:
        """What config.yaml says of them: how many, who gave them and a digest (a resume with
        other rows is a change of task)."""
        text = json.dumps(self, sort_keys=True, default=str)
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        return f"({len(self)} rows given in Python as {self.label}, sha256 {digest})"

    def __repr__(self) -> str:  # a message naming the key shows the line, not every row
        return f"GivenRows{self.record()}"


@dataclass
class Example:
    """One prompt. `answer` is the reference the rewards compare against; `columns` holds the
    example's other fields (passed to user reward functions as keyword arguments)."""

    prompt: str
    answer: str
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass
class Task:
    name: str
    train: list[Example]
    eval: list[Example]
    config: TaskConfig | None = None
    # The task's judge: how every accuracy (the strict check, the accuracy reward, the reward
    # probes, the evaluation) reads a final answer. One of tasks.answers.ANSWER_KINDS.
    answer_kind: str = "number"
    answer_kind_reason: str = ""  # why: declared, or what the inference saw
    split_reason: str = ""  # where the held-out rows come from (describe_split)
    # False: the rows have no reference answers (a file task with neither field): the
    # rewards alone judge; no accuracy, strict check, held-out evaluation or reward probes.
    has_references: bool = True
    # A generated suite's own scoring (reasoning_gym: its generator's score_answer(answer,
    # entry)) and the strict judge built on it (completion, example) -> bool; None: the
    # strict check of the answer kind (grpolab.tasks.strict) judges.
    score_answer: Any = None
    strict_judge: Any = None

    def strict_hits(self, completions: Sequence[str], examples: Sequence[Example]) -> list[bool]:
        """The task's strict verdict on each completion (one example per completion)."""
        pairs = list(zip(completions, examples, strict=True))
        if self.strict_judge is not None:
            return [bool(self.strict_judge(c, e)) for c, e in pairs]
        return [strict_equal(c, e.answer, self.answer_kind) for c, e in pairs]

    def describe_split(self) -> str:
        """The line the commands print at start: how many rows train, how many are held out."""
        why = f" ({self.split_reason})" if self.split_reason else ""
        return f"task {self.name}: {len(self.train)} training rows, {len(self.eval)} held out{why}"

    def describe_answers(self) -> str:
        """The line the commands print at start: which judge and why."""
        return f"task {self.name}: answers judged as {self.answer_kind} ({self.answer_kind_reason})"

    def sample(self, n: int, generator: torch.Generator | random.Random) -> list[Example]:
        """n distinct training examples drawn with `generator` (its state advances; the same
        state gives the same draw, so a resumed run draws what the original would have)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if n > len(self.train):
            raise ValueError(
                f"cannot sample {n} distinct prompts from task {self.name!r}: "
                f"it has {len(self.train)} training examples"
            )
        if isinstance(generator, random.Random):
            indices = generator.sample(range(len(self.train)), n)
        elif isinstance(generator, torch.Generator):
            indices = torch.randperm(len(self.train), generator=generator)[:n].tolist()
        else:
            raise TypeError(
                f"generator must be a torch.Generator or random.Random, got {type(generator)}"
            )
        return [self.train[i] for i in indices]
