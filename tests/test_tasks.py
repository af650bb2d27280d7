"""Tasks: the arithmetic task's format, split and sampling; the file loaders and their errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from grpolab.tasks import SAMPLE_GSM8K, Example, TaskConfig, load_task
from grpolab.tasks.answers import infer_answer_kind


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


# --- file-based tasks --------------------------------------------------------------------------


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_sample_loads_with_final_answers():
    task = load_task(TaskConfig(name="gsm8k", path=str(SAMPLE_GSM8K), num_eval=4))
    assert len(task.train) + len(task.eval) >= 10 and len(task.eval) == 4
    assert not {e.prompt for e in task.train} & {e.prompt for e in task.eval}
    rows = [json.loads(line) for line in SAMPLE_GSM8K.read_text().splitlines()]
    by_question = {r["question"]: r for r in rows}
    for ex in task.train + task.eval:
        row = by_question[ex.columns["question"]]
        assert ex.prompt.startswith(row["question"]) and '"####"' in ex.prompt
        final = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        assert ex.answer == final and ex.columns["solution"] == row["answer"]
    assert "2280" in {e.answer for e in task.train + task.eval}  # "#### 2,280"


def test_a_small_file_is_trained_on_whole_unless_a_hold_out_is_asked_for():
    rows = len(load_task(TaskConfig(name="gsm8k", path=str(SAMPLE_GSM8K))).train)
    a = load_task(TaskConfig(name="gsm8k", path=str(SAMPLE_GSM8K)))
    assert len(a.eval) == 0 and len(a.train) == rows  # 500 held out would leave < 90 %
    assert "no hold-out" in a.describe_split() and "task.num_eval" in a.describe_split()
    asked = load_task(TaskConfig(name="gsm8k", path=str(SAMPLE_GSM8K), num_eval=4))
    assert len(asked.eval) == 4 and len(asked.train) == rows - 4
    other_seed = load_task(TaskConfig(name="gsm8k", path=str(SAMPLE_GSM8K), num_eval=4, seed=1))
    assert [e.prompt for e in asked.eval] != [e.prompt for e in other_seed.eval]


def test_a_large_file_holds_out_500_rows_when_90_percent_still_train(tmp_path):
    for n, held in ((5000, 500), (4999, 0)):
        path = write_jsonl(tmp_path / f"{n}.jsonl",
                           [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(n)])  # fmt: skip
        task = load_task(TaskConfig(name="jsonl", path=str(path)))
        assert (len(task.eval), len(task.train)) == (held, n - held)
        assert {e.prompt for e in task.eval}.isdisjoint(e.prompt for e in task.train)


def test_jsonl_task_custom_fields_and_template(tmp_path):
    path = write_jsonl(
        tmp_path / "qa.jsonl",
        [{"q": f"What is {i} squared?", "a": i * i, "level": i % 3} for i in range(10)],
    )
    cfg = TaskConfig(
        name="jsonl",
        path=str(path),
        prompt_field="q",
        answer_field="a",
        prompt_template="[{level}] {prompt}",
        num_eval=2,
    )
    task = load_task(cfg)
    assert len(task.train) == 8 and len(task.eval) == 2
    ex = next(e for e in task.train if e.columns["q"] == "What is 3 squared?")
    assert ex.prompt == "[0] What is 3 squared?" and ex.answer == "9"
    assert ex.columns == {"q": "What is 3 squared?", "a": 9, "level": 0}


def test_jsonl_separate_eval_file(tmp_path):
    train = write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": f"p{i}", "answer": "x"} for i in range(5)]
    )
    evalf = write_jsonl(
        tmp_path / "eval.jsonl", [{"prompt": f"e{i}", "answer": "y"} for i in range(3)]
    )
    task = load_task(TaskConfig(name="jsonl", path=str(train), eval_path=str(evalf)))
    assert [e.prompt for e in task.train] == [f"p{i}" for i in range(5)]
    assert [e.prompt for e in task.eval] == ["e0", "e1", "e2"]


def test_parquet_via_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"Q{i}?", "answer": f"so\n#### {i}"} for i in range(6)]
    path = tmp_path / "gsm.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    task = load_task(
        TaskConfig(name="gsm8k", path=str(path), num_eval=2, prompt_template="{prompt}")
    )
    assert sorted(e.answer for e in task.train + task.eval) == [str(i) for i in range(6)]
    assert {e.prompt for e in task.train + task.eval} == {f"Q{i}?" for i in range(6)}


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (
            ['{"question": "q", "answer": "#### 1"}', '{"question": "q2"}'],
            r"line 2: no field 'answer'",
        ),
        (['{"question": "", "answer": "#### 1"}'], r"line 1: field 'question' is empty"),
        (
            ['{"question": "q", "answer": "no final"}'],
            r"line 1: field 'answer' has no final '#### <answer>'",
        ),
        (['{"question": "q", "answer": "#### 1"}', "{not json"], r"line 2: not valid JSON"),
        (["[1, 2]"], r"line 1: expected a JSON object"),
    ],
)
def test_bad_gsm8k_rows_name_file_line_and_field(tmp_path, lines, match):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=match) as info:
        load_task(TaskConfig(name="gsm8k", path=str(path)))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_missing_file_and_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match=r"task file .*nope.jsonl.* does not exist"):
        load_task(TaskConfig(name="jsonl", path=str(missing)))
    with pytest.raises(ValueError, match=r"needs task\.path"):
        load_task(TaskConfig(name="gsm8k"))


def test_bad_template_names_the_template(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "answer": "a"}])
    with pytest.raises(ValueError, match=r"task.prompt_template='\{nope\}'.*t.jsonl line 1"):
        load_task(TaskConfig(name="jsonl", path=str(path), prompt_template="{nope}"))


# --- answer kinds ---------------------------------------------------------------------------------

FIXTURES = Path(__file__).parent / "data"


def jsonl_task(name: str, **kw) -> TaskConfig:
    return TaskConfig(name="jsonl", path=str(FIXTURES / name), num_eval=6, **kw)


@pytest.mark.parametrize(
    ("cfg", "kind", "why"),
    [
        (TaskConfig(), "number", "the arithmetic task's answers are integers"),
        (
            TaskConfig(name="gsm8k", path=str(SAMPLE_GSM8K)),
            "number",
            "inferred from the data: all 16 reference answers are numbers, e.g.",
        ),
        (
            jsonl_task("capitals.jsonl"),
            "string",
            "inferred from the data: 40 of 40 reference answers are text, e.g.",
        ),
        (
            jsonl_task("choice.jsonl"),
            "choice",
            "inferred from the data: all 22 reference answers are single letters (ABCD), e.g.",
        ),
        (jsonl_task("capitals.jsonl", answer_kind="math"), "math", "task.answer_kind"),
    ],
)
def test_each_task_has_one_answer_kind_said_with_its_reason(cfg, kind, why):
    task = load_task(cfg)
    assert task.answer_kind == kind and why in task.answer_kind_reason
    assert task.describe_answers() == (
        f"task {cfg.name}: answers judged as {kind} ({task.answer_kind_reason})"
    )


@pytest.mark.parametrize(
    ("references", "kind"),
    [
        (["85", "-3", "2,280", "0.5", "1/2"], "number"),
        (["A", "b", "(C)", "J"], "choice"),
        (["\\frac{1}{2}", "3", "2\\sqrt{2}"], "math"),
        (["x^2+1", "(1, 2)", "pi/2", "7"], "math"),
        (["Paris", "Winston-Salem", "Route 66", "2nd"], "string"),
        (["Paris", "\\frac{1}{2}"], "string"),  # words among them: text
        (["K", "L"], "string"),  # past J: not an option letter
    ],
)
def test_the_kind_is_inferred_from_every_reference(references, kind):
    assert infer_answer_kind(references)[0] == kind


def test_a_declared_kind_must_fit_every_reference():
    with pytest.raises(ValueError) as info:
        load_task(jsonl_task("capitals.jsonl", answer_kind="number"))
    message = str(info.value)
    assert message.startswith("task.answer_kind='number': the answer of train row 0 ('What is")
    assert "is not a number (42, -3.5, 2,280, 1/2) (and 39 more rows)" in message
    with pytest.raises(ValueError, match=r"'choice'.* is not one letter A-J"):
        load_task(jsonl_task("capitals.jsonl", answer_kind="choice"))
    with pytest.raises(ValueError, match=r"task.answer_kind='word': expected one of number, "):
        load_task(TaskConfig(answer_kind="word"))
    # Any reference is text, and math-verify reads any text.
    assert load_task(jsonl_task("choice.jsonl", answer_kind="string")).answer_kind == "string"


def test_eval_fraction_holds_out_that_share_and_the_split_is_said(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n"
                            for i in range(200)))  # fmt: skip
    task = load_task(TaskConfig(name="jsonl", path=str(path), eval_fraction=0.1))
    assert (len(task.train), len(task.eval)) == (180, 20)
    assert {e.prompt for e in task.train}.isdisjoint(e.prompt for e in task.eval)
    assert task.describe_split().startswith("task jsonl: 180 training rows, 20 held out")
    assert "task.eval_fraction=0.1" in task.describe_split()
    # the default split is said too, with how to choose another
    default = load_task(TaskConfig(name="jsonl", path=str(path)))
    assert (len(default.train), len(default.eval)) == (200, 0)
    assert "task.eval_fraction or task.eval_path" in default.describe_split()


def test_a_file_with_many_bad_rows_names_them_all_up_to_a_limit(tmp_path):
    path = tmp_path / "rows.jsonl"
    good = [json.dumps({"prompt": "q", "answer": "1"})] * 3
    bad = [json.dumps({"prompt": "", "answer": "1"}), json.dumps({"prompt": "q"})] * 7
    path.write_text("\n".join(good + bad) + "\n")
    with pytest.raises(ValueError) as e:
        load_task(TaskConfig(name="jsonl", path=str(path)))
    text = str(e.value)
    assert text.startswith("14 of 17 rows are bad")
    assert f"{path} line 4:" in text and f"{path} line 5: no field 'answer'" in text
    assert text.count(str(path)) == 10 and text.endswith("... and 4 more")


def test_csv_rows_load_with_their_lines(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("prompt,answer,topic\nCapital of France?,Paris,geo\n,Rome,geo\n")
    with pytest.raises(ValueError, match=r"rows\.csv line 3: field 'prompt' is empty"):
        load_task(TaskConfig(name="jsonl", path=str(path)))
    path.write_text("prompt,answer,topic\nCapital of France?,Paris,geo\nOf Italy?,Rome,geo\n")
    task = load_task(TaskConfig(name="jsonl", path=str(path), eval_path=str(path)))
    assert [(e.prompt, e.answer, e.columns["topic"]) for e in task.train] == [
        ("Capital of France?", "Paris", "geo"), ("Of Italy?", "Rome", "geo")]  # fmt: skip
