"""Tasks: the arithmetic task's format, split and sampling."""

from __future__ import annotations

import random

import pytest
import torch

from grpolab.tasks import Example, TaskConfig, load_task


def test_arithmetic_default_format_and_answers():
    task = load_task(TaskConfig())
    assert len(task.train) == 90 * 90 - 500 and len(task.eval) == 500
    for ex in task.train[:200] + task.eval:
        a, b = ex.columns["a"], ex.columns["b"]
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert ex.prompt == f"{a}+{b}="
        assert ex.answer == str(a + b)


def test_arithmetic_split_disjoint_and_deterministic():
    a, b = load_task(TaskConfig(seed=3)), load_task(TaskConfig(seed=3))
    assert [e.prompt for e in a.train] == [e.prompt for e in b.train]
    assert [e.prompt for e in a.eval] == [e.prompt for e in b.eval]
    assert not {e.prompt for e in a.train} & {e.prompt for e in a.eval}
    c = load_task(TaskConfig(seed=4))
    assert [e.prompt for e in c.eval] != [e.prompt for e in a.eval]


def test_arithmetic_operators_and_negative_results():
    task = load_task(TaskConfig(operators="+-*", min_operand=1, max_operand=9, num_eval=20))
    ops = {e.columns["op"] for e in task.train}
    assert ops == {"+", "-", "*"}
    for ex in task.train + task.eval:
        a, op, b = ex.columns["a"], ex.columns["op"], ex.columns["b"]
        assert ex.prompt == f"{a}{op}{b}="
        assert int(ex.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
    assert any(ex.answer.startswith("-") for ex in task.train)


def test_arithmetic_large_space_is_sampled_not_enumerated():
    cfg = TaskConfig(min_operand=100, max_operand=999, operators="+-", num_eval=50, num_train=300)
    task = load_task(cfg)
    assert len(task.train) == 300 and len(task.eval) == 50
    assert not {e.prompt for e in task.train} & {e.prompt for e in task.eval}
    assert [e.prompt for e in load_task(cfg).train] == [e.prompt for e in task.train]


@pytest.mark.parametrize(
    "make", [lambda: torch.Generator().manual_seed(7), lambda: random.Random(7)]
)
def test_sample_reproducible_distinct_and_advances(make):
    task = load_task(TaskConfig())
    g1, g2 = make(), make()
    first = task.sample(16, g1)
    assert first == task.sample(16, g2)
    assert len({e.prompt for e in first}) == 16
    assert all(isinstance(e, Example) for e in first)
    assert task.sample(16, g1) != first  # the generator's state advanced
    assert set(e.prompt for e in first) <= {e.prompt for e in task.train}


def test_sample_leaves_global_rng_alone():
    task = load_task(TaskConfig())
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    task.sample(8, torch.Generator().manual_seed(1))
    task.sample(8, random.Random(1))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (TaskConfig(operators="/"), "task.operators"),
        (TaskConfig(min_operand=50, max_operand=10), "min_operand"),
        (TaskConfig(min_operand=1, max_operand=3, num_eval=9), "num_eval"),
        (TaskConfig(name="nope"), "task.name='nope'"),
    ],
)
def test_bad_arithmetic_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        load_task(cfg)


def test_sample_rejects_bad_n():
    task = load_task(TaskConfig(min_operand=1, max_operand=3, num_eval=2))
    with pytest.raises(ValueError, match="distinct"):
        task.sample(100, random.Random(0))
    with pytest.raises(ValueError, match="positive"):
        task.sample(0, random.Random(0))
