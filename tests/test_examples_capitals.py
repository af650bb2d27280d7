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
