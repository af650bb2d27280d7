"""The reward probes of the preflight: hand-written completions for real task rows, scored by
the configured rewards through `score`. The built-in rewards pass on every task; a reward that
accepts the echoed question, a wrong answer or beats the reference fails the check named for
it, and the message names the function, the probe and the row."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from grpolab.checks.rewards import PROBES, check_reward_probes
from grpolab.model.policy import build_char_tokenizer
from grpolab.rewards import RewardsConfig, load_rewards
from grpolab.rewards.probes import (
    NO_ANSWERS,
    build_probes,
    probe_rows,
    probe_task,
    reward_scale,
)
from grpolab.tasks import SAMPLE_GSM8K, Example, TaskConfig, load_task

MUTANT = Path(__file__).parent / "mutants" / "reward_accepts_echo.py"
INACTION = Path(__file__).parent / "mutants" / "reward_pays_inaction.py"
FIXTURES = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def what_is_task(tmp_path_factory):
    """'What is 59 + 63?' rows: the prompts a chat model was trained on when it learned to
    answer '59 + 63 ='."""
    path = tmp_path_factory.mktemp("task") / "what.jsonl"
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(40):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    return TaskConfig(name="jsonl", path=str(path), num_eval=10)


TASKS = {
    "arithmetic": lambda _: TaskConfig(),
    "what_is": lambda what_is_task: what_is_task,
    "gsm8k": lambda _: TaskConfig(name="gsm8k", path=str(SAMPLE_GSM8K), num_eval=0),
    # Words and option letters: the judges of the string and choice kinds.
    "capitals": lambda _: TaskConfig(name="jsonl", path=str(FIXTURES / "capitals.jsonl")),
    "choice": lambda _: TaskConfig(name="jsonl", path=str(FIXTURES / "choice.jsonl")),
}


def probe(task_cfg, functions, tokenizer=None, **rewards_cfg):
    task = load_task(task_cfg)
    rewards = load_rewards(
        RewardsConfig(functions=functions, **rewards_cfg), task=task, max_completion_length=8
    )
    report = probe_task(task, rewards, tokenizer)
    return report, {r.id: r for r in check_reward_probes(report)}


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("functions", [["accuracy"], ["accuracy", "format"], ["format"]])
def test_the_builtin_rewards_pass_on_every_task(task, functions, what_is_task):
    report, results = probe(TASKS[task](what_is_task), functions)
    assert set(results) == {d.check.id for d in PROBES}
    assert all(r.passed for r in results.values()), [r.what for r in results.values()]
    assert len(report.rows) == 8 and all(e.prompt for _, e in report.rows)
    # accuracy checks answers; a format reward pays right and wrong answers alike and is
    # asked only that nothing beats the reference
    assert report.answer_checking() == [f for f in functions if f == "accuracy"]


def test_the_probes_of_a_row():
    rows = [(3, Example("What is 88 + 22?", "110")), (9, Example("7+5=", "12"))]
    probes = build_probes(rows)
    texts = {(p.row, p.kind): [] for p in probes}
    for p in probes:
        texts[(p.row, p.kind)].append(p.text)
    assert "The answer is 110." in texts[(0, "reference")]
    assert "\\boxed{111}" in texts[(0, "wrong")]
    assert texts[(0, "echo")] == ["What is 88 + 22?"]
    assert texts[(0, "restated")] == [
        "88 + 22 =",
        "The answer is 88+22",
        "\\boxed{88 + 22}",
        "#### 88 + 22",
    ]
    assert "7 + 5 =" in texts[(1, "restated")]


def test_a_prompt_that_ends_with_its_answer_is_not_a_wrong_probe():
    # "0 + 22 =" ends with 22, its answer: the strict check says it answers, so it is left out
    # (a boxed or #### restatement is still one: its marked answer is not the number).
    probes = build_probes([(0, Example("What is 0 + 22?", "22"))])
    left = [p.text for p in probes if p.kind in ("echo", "restated")]
    assert left == ["\\boxed{0 + 22}", "#### 0 + 22"]


def test_the_gsm8k_rows_are_probed_with_their_solutions():
    rows = probe_rows(load_task(TASKS["gsm8k"](None)))
    probes = build_probes(rows)
    solution = rows[0][1].columns["solution"]
    assert any(p.text == solution for p in probes if p.kind == "reference")
    wrong = rows[0][1].answer
    wrong_solution = solution.rsplit("####", 1)[0] + f"#### {int(wrong) + 1}"
    assert any(p.text == wrong_solution for p in probes if p.kind == "wrong")


def test_a_reward_that_accepts_the_echoed_question_fails_rewards_echo(what_is_task):
    report, results = probe(what_is_task, [f"{MUTANT}:evaluated_accuracy"])
    echo = results["rewards.echo"]
    assert not echo.passed and echo.measured == 8 and echo.expected == "0 of 8"
    assert results["rewards.reference"].passed and results["rewards.wrong_answer"].passed
    # The failure names the function, the probe and the row.
    first = report.rows[0]
    a, b = first[1].prompt.removeprefix("What is ").removesuffix("?").split(" + ")
    assert (
        f"first: reward 'evaluated_accuracy' gives the question restated as an expression "
        f"'{a} + {b} =' 1, as much as the reference '{first[1].answer}' (1), on train row "
        f"{first[0]} ('What is {a} + {b}?')"
    ) in echo.what
    assert "math-verify" in echo.hint


def test_a_reward_that_accepts_a_wrong_answer_fails_rewards_wrong_answer(tmp_path, what_is_task):
    user = tmp_path / "loose.py"
    user.write_text(
        "def any_close(completions, answer, **_):\n"
        "    # accepts the reference and anything within 1 of it on odd answers\n"
        "    out = []\n"
        "    for c, a in zip(completions, answer):\n"
        "        digits = ''.join(ch for ch in c if ch.isdigit())\n"
        "        close = digits and abs(int(digits) - int(a)) <= 1\n"
        "        ok = digits == a or (int(a) % 2 == 1 and close)\n"
        "        out.append(1.0 if ok else 0.0)\n"
        "    return out\n"
    )
    report, results = probe(what_is_task, [f"{user}:any_close"])
    wrong = results["rewards.wrong_answer"]
    odd = [i for i, e in report.rows if int(e.answer) % 2 == 1]
    assert odd and not wrong.passed and wrong.measured == len(odd)
    assert "reward 'any_close' gives a wrong answer" in wrong.what
    assert f"on train row {odd[0]} " in wrong.what


def test_a_reward_paying_the_echo_more_than_the_answer_fails_rewards_reference(what_is_task):
    def asks(completions, **_):  # a "format" reward that pays for the question's words
        return [1.0 if "What is" in c else 0.0 for c in completions]

    report, results = probe(what_is_task, [asks])
    ref = results["rewards.reference"]
    assert not ref.passed and ref.measured == 8
    assert "reward 'asks' gives the prompt echoed 'What is" in ref.what and "more than" in ref.what
    assert report.answer_checking() == []  # so the echo check does not apply to it
    assert results["rewards.echo"].passed


def test_a_reward_that_raises_on_the_probes_fails(what_is_task):
    def broken(completions, answer, **_):
        return [float(int(c) == int(a)) for c, a in zip(completions, answer, strict=True)]

    _, results = probe(what_is_task, [broken])
    ref = results["rewards.reference"]
    assert not ref.passed and "reward 'broken' failed on" in ref.what


def test_user_columns_reach_the_function(what_is_task):
    seen = {}

    def spy(completions, prompt, answer, **columns):
        seen.update(columns, prompt=prompt[0])
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    _, results = probe(TASKS["gsm8k"](None), [spy])
    assert "question" in seen and "solution" in seen and "Let's think" in seen["prompt"]
    assert all(r.passed for r in results.values())


def test_token_id_rewards_need_a_tokenizer(what_is_task):
    report, results = probe(what_is_task, ["accuracy", "overlong"])
    assert report.not_probed == ["overlong"] and "not probed" in results["rewards.echo"].what
    report, results = probe(what_is_task, ["accuracy", "overlong"], build_char_tokenizer())
    assert report.not_probed == [] and "overlong" in report.values
    assert all(r.passed for r in results.values())


def test_the_reward_scale_of_the_total(what_is_task):
    task = load_task(what_is_task)

    def scale(functions, weights=None):
        return reward_scale(task, load_rewards(RewardsConfig(functions, weights), task=task.name))

    assert scale(["accuracy"]) == (0.0, 1.0)
    # A boxed wrong answer earns the format reward: wrong 0.1, right 1.1.
    wrong, right = scale(["accuracy", "format"], [1.0, 0.1])
    assert wrong == pytest.approx(0.1) and right == pytest.approx(1.1)
    assert scale(["format"]) is None  # pays right and wrong alike: no scale


# --- Other answer kinds, and no answer ------------------------------------------------------------


@pytest.mark.parametrize("task", ["capitals", "choice"])
def test_the_wrong_answer_is_another_rows_answer_of_the_same_kind(task):
    report, results = probe(TASKS[task](None), ["accuracy"])
    answers = {e.answer for _, e in report.rows}
    for row, (_, example) in enumerate(report.rows):
        wrong = {p.text for p in report.probes if p.row == row and p.kind == "wrong"}
        # written as the reference is: bare, in a sentence, boxed, after ####, in tags
        (bare,) = wrong & answers
        assert bare != example.answer and f"The answer is {bare}." in wrong
    # So the accuracy reward is asked, and passes, every question on words and letters too.
    assert report.answer_checking() == ["accuracy"]
    assert all(r.passed for r in results.values())


def test_a_reward_that_pays_inaction_fails_rewards_no_answer(what_is_task):
    report, results = probe(what_is_task, [f"{INACTION}:answer_or_penalty"])
    failed = [id for id, r in results.items() if not r.passed]
    assert failed == ["rewards.no_answer"]
    no_answer = results["rewards.no_answer"]
    assert no_answer.measured == 8 and no_answer.expected == "0 of 8"
    index, first = report.rows[0]
    assert (
        f"first: reward 'answer_or_penalty' gives no answer '' 0, more than a wrong answer "
        f"'{int(first.answer) + 1}' (-1), on train row {index} ({first.prompt!r})"
    ) in no_answer.what
    assert "pays inaction" in no_answer.hint


def test_no_answer_on_a_words_task():
    def graded(completions, answer, **_):  # +1 right, -1 any other attempt, 0 for silence
        out = []
        for c, a in zip(completions, answer, strict=True):
            said = c.strip().removeprefix("The answer is ").strip(".")
            out.append(0.0 if c in NO_ANSWERS else 1.0 if said == a else -1.0)
        return out

    _, results = probe(TASKS["capitals"](None), [graded])
    assert [id for id, r in results.items() if not r.passed] == ["rewards.no_answer"]
    # Silence scored as a wrong answer is not paying inaction.
    _, results = probe(TASKS["capitals"](None), ["accuracy"])
    assert results["rewards.no_answer"].passed
