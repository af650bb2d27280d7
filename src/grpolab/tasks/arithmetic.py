"""The built-in task: integer arithmetic, prompts like "37+48=" with answer "85"."""

from __future__ import annotations

import dataclasses
import operator
import random

from grpolab.tasks.base import GENERATED_NUM_EVAL, Example, Task, TaskConfig

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# Spaces up to this many problems are enumerated in full; larger ones are sampled.
ARITHMETIC_ENUMERATE_LIMIT = 200_000
DEFAULT_SAMPLED_TRAIN = 100_000


def make_example(a: int, op: str, b: int, template: str | None = None) -> Example:
    """ "37+48=" -> "85"; a task.prompt_template such as "What is {a} {op} {b}?" words the
    prompt instead (the answer stays the number)."""
    answer = str(OPERATORS[op](a, b))
    prompt = f"{a}{op}{b}=" if template is None else template.format(a=a, op=op, b=b)
    return Example(prompt=prompt, answer=answer, columns={"a": a, "op": op, "b": b})


def load_arithmetic(cfg: TaskConfig) -> Task:
    if cfg.num_eval is None:
        cfg = dataclasses.replace(cfg, num_eval=GENERATED_NUM_EVAL)
    ops = validate_arithmetic(cfg)
    lo, hi = cfg.min_operand, cfg.max_operand
    span = hi - lo + 1
    total = len(ops) * span * span
    rng = random.Random(cfg.seed)
    if total <= ARITHMETIC_ENUMERATE_LIMIT:
        problems = [(a, op, b) for op in ops for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
        rng.shuffle(problems)
        if cfg.num_eval >= total:
            raise ValueError(
                f"task.num_eval={cfg.num_eval} leaves no training problems: operands "
                f"{lo}..{hi} with operators {cfg.operators!r} give only {total}"
            )
        eval_problems = problems[: cfg.num_eval]
        train_problems = problems[cfg.num_eval :]
        if cfg.num_train:
            train_problems = train_problems[: cfg.num_train]
    else:
        wanted = cfg.num_eval + (cfg.num_train or DEFAULT_SAMPLED_TRAIN)
        seen: dict[tuple[int, str, int], None] = {}
        while len(seen) < wanted:  # total > 2 * wanted here, so this ends quickly
            seen[(rng.randint(lo, hi), rng.choice(ops), rng.randint(lo, hi))] = None
        problems = list(seen)
        eval_problems, train_problems = problems[: cfg.num_eval], problems[cfg.num_eval :]
    return Task(
        name="arithmetic",
        train=[make_example(*p, cfg.prompt_template) for p in train_problems],
        eval=[make_example(*p, cfg.prompt_template) for p in eval_problems],
        config=cfg,
    )


def validate_arithmetic(cfg: TaskConfig) -> list[str]:
    ops = list(dict.fromkeys(cfg.operators))
    if cfg.prompt_template is not None:
        try:
            cfg.prompt_template.format(a=1, op="+", b=2)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"task.prompt_template={cfg.prompt_template!r}: arithmetic fills only {{a}}, "
                f"{{op}} and {{b}} ({e!r})"
            ) from None
    bad = [op for op in ops if op not in OPERATORS]
    if not ops or bad:
        raise ValueError(
            f"task.operators={cfg.operators!r}: use one or more of {''.join(OPERATORS)!r}"
        )
    for name in ("min_operand", "max_operand", "num_eval", "num_train"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"task.{name} must be an int, got {value!r}")
    if cfg.min_operand < 0 or cfg.max_operand < cfg.min_operand:
        raise ValueError(
            f"task.min_operand={cfg.min_operand}, task.max_operand={cfg.max_operand}: "
            "need 0 <= min_operand <= max_operand"
        )
    if cfg.num_eval < 0 or cfg.num_train < 0:
        raise ValueError(
            f"task.num_eval={cfg.num_eval}, task.num_train={cfg.num_train}: must be >= 0"
        )
    span = cfg.max_operand - cfg.min_operand + 1
    total = len(ops) * span * span
    if total > ARITHMETIC_ENUMERATE_LIMIT:
        wanted = cfg.num_eval + (cfg.num_train or DEFAULT_SAMPLED_TRAIN)
        if 2 * wanted > total:
            raise ValueError(
                f"task.num_eval + task.num_train = {wanted} is more than half of the {total} "
                "problems; lower them"
            )
    return ops
