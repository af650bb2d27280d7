"""examples/data/capitals.jsonl, a task whose answers are words: one row per country (the
UN members and the Vatican, without the countries with two or disputed capitals), ASCII
answers, judged as strings."""

from __future__ import annotations

import json
from pathlib import Path

from grpolab.tasks import load_task
from grpolab.tasks.base import TaskConfig

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data" / "capitals.jsonl"


def test_the_capitals_file_has_one_row_per_country():
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    prompts = [r["prompt"] for r in rows]
    assert len(rows) >= 180 and len(set(prompts)) == len(prompts)
    assert all(set(r) == {"prompt", "answer"} and r["answer"].strip() for r in rows)
    assert all(r["answer"].isascii() for r in rows)


def test_the_capitals_load_as_a_string_task():
    task = load_task(TaskConfig(name="jsonl", path=str(DATA), eval_fraction=0.3))
    assert task.answer_kind == "string", task.answer_kind_reason
    assert len(task.eval) == round(0.3 * (len(task.train) + len(task.eval)))


def test_the_capitals_reward_pays_in_full_only_what_the_strict_judge_calls_right():
    """examples/capitals_reward.py: 1 for the capital as the final answer, 0.1 for another city
    as a final answer after "answer is", 0 otherwise; its full credit goes exactly to what the
    strict judge (the example's accuracy) calls right."""
    import importlib.util

    from grpolab.tasks.strict import strict_equal

    path = ROOT / "examples" / "capitals_reward.py"
    spec = importlib.util.spec_from_file_location("capitals_reward", path)
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    cases = [
        ("Madrid", 1.0),
        ("The capital of Spain is Madrid. The answer is Madrid.", 1.0),
        ("The answer is: **Madrid**", 1.0),
        ("the answer is madrid", 1.0),
        ("It is Madrid.", 0.0),
        ("The capital of Spain is Madrid.", 0.0),
        ("The answer is Madrid, a big city.", 0.1),
        ("The answer is Barcelona. Not Madrid.", 0.1),
        ("The answer is Paris.", 0.1),
        ("Madridista", 0.0),
        ("", 0.0),
    ]
    texts = [text for text, _ in cases]
    got = reward.capital(completions=texts, answer=["Madrid"] * len(cases), prompts=texts)
    assert got == [expected for _, expected in cases]
    for text, paid in zip(texts, got, strict=True):
        assert (paid == 1.0) == strict_equal(text, "Madrid", "string"), text
