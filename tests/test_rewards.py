"""Rewards: built-ins, user functions, weighting, metrics, and that no failure is lost."""

from __future__ import annotations

import inspect
import json
import logging
import math
import random
import time
from pathlib import Path

import pytest
import torch

from grpolab.model.policy import build_char_tokenizer
from grpolab.rewards import RewardsConfig, load_rewards, score
from grpolab.rewards.builtin import (
    accuracy_exact,
    accuracy_math,
    choice_equal,
    make_accuracy,
    text_equal,
)
from grpolab.rollout.common import assemble_rollout
from grpolab.tasks import SAMPLE_GSM8K, Example, TaskConfig, load_task
from grpolab.tasks.strict import strict_equal

TOK = build_char_tokenizer()
FIXTURES = Path(__file__).parent / "data"


def ex(answer: str, prompt: str = "p", **columns) -> Example:
    return Example(prompt=prompt, answer=answer, columns=columns)


def char_rollout(prompts, completions, G, stop=True):
    """A Rollout built from texts with the char tokenizer (EOS appended when stop)."""
    eos = TOK.eos_token_id
    ids = [TOK(c)["input_ids"] + ([eos] if stop else []) for c in completions]
    return assemble_rollout(
        prompts,
        [TOK(p)["input_ids"] for p in prompts],
        ids,
        None,
        G,
        [eos],
        TOK.pad_token_id,
        TOK,
    )


# --- accuracy ------------------------------------------------------------------------------------


def test_accuracy_exact_for_arithmetic():
    task = load_task(TaskConfig())
    examples = task.eval[:2]
    a, b = examples[0].answer, examples[1].answer
    completions = [a, " " + a + " ", a + "0", "x" + a, b, str(int(b) + 1)]
    rewards = load_rewards(["accuracy"], task="arithmetic")
    result = score(completions, examples, rewards, num_generations=3)
    assert result.per_function["accuracy"].tolist() == [1, 1, 0, 0, 1, 0]
    assert result.total.tolist() == [1, 1, 0, 0, 1, 0]
    # "85abc" is not "85" for arithmetic: exact, not extraction
    assert score([a + "abc"], [examples[0]], rewards).total.item() == 0


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("half: \\boxed{0.5}", "\\frac12", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("3 + 4 = 7 apples, then 7 * 2 = 14.\n#### 14", "14", 1.0),
        ("4 * 5 = 20\n#### 20", "14", 0.0),
        ("He earns 2,280 dollars.\n#### 2,280", "2280", 1.0),
        ("first 3, then \\boxed{5}", "3", 0.0),
        ("no answer at all", "42", 0.0),
        ("", "7", 0.0),
        # The final answer as written, never an expression evaluated from text that restates
        # the question (math-verify alone parses "88 + 22 =" as 110).
        ("88 + 22 =", "110", 0.0),
        ("The answer is 56+91", "147", 0.0),
        ("\\boxed{88 + 22}", "110", 0.0),
        ("#### 88 + 22", "110", 0.0),
        ("\\boxed{5x}", "5", 0.0),
        ("88 + 22 = 110", "110", 1.0),
        ("The answer is 110.", "110", 1.0),
        ("37-48=-11", "-11", 1.0),
        ("She pays $18.\n#### $18", "18", 1.0),
        ("#### 18 dollars", "18", 1.0),
        ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
        ("\\boxed{25\\%}", "25", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ],
)
def test_accuracy_math_mode(completion, reference, expected):
    rewards = load_rewards(RewardsConfig(functions=["accuracy"], accuracy_mode="math"))
    assert score([completion], [ex(reference)], rewards).total.item() == expected


def test_accuracy_on_the_gsm8k_sample():
    task = load_task(TaskConfig(name="gsm8k", path=str(SAMPLE_GSM8K), num_eval=0))
    examples = task.train
    assert len(examples) >= 10
    right_solution = [e.columns["solution"] for e in examples]  # "... #### 14"
    boxed = [f"The answer is \\boxed{{{e.answer}}}." for e in examples]
    wrong = [f"#### {int(float(e.answer)) + 1}" for e in examples]
    rewards = load_rewards(["accuracy", "format"], task="gsm8k")
    completions = [c for trio in zip(right_solution, boxed, wrong, strict=True) for c in trio]
    result = score(completions, examples, rewards, num_generations=3)
    acc = result.per_function["accuracy"].view(-1, 3)
    assert acc[:, 0].eq(1).all() and acc[:, 1].eq(1).all() and acc[:, 2].eq(0).all()
    assert result.per_function["format"].eq(1).all()  # "####" and \boxed both match
    assert result.metrics["rewards/accuracy/mean"] == pytest.approx(2 / 3)
    assert result.metrics["frac_reward_zero_std"] == 0.0
    assert result.errors == {"accuracy": 0, "format": 0}


def test_the_accuracy_judges_the_tasks_answer_kind():
    capitals = load_task(TaskConfig(name="jsonl", path=str(FIXTURES / "capitals.jsonl")))
    choice = load_task(TaskConfig(name="jsonl", path=str(FIXTURES / "choice.jsonl")))
    for task, completions, right in (
        (capitals, ["Paris.", "The answer is paris", "**PARIS**", "Rome", "It is Paris."], "Paris"),
        (choice, ["The answer is (B)", "B)", "**B**", "Answer: b", "C", "B because"], "B"),
    ):
        rewards = load_rewards(["accuracy"], task=task)
        values = score(completions, [ex(right)] * len(completions), rewards).total.tolist()
        assert values == [1.0] * (len(completions) - 2) + [0.0, 0.0]
    # The number kind is today's judge, function for function: exact for arithmetic, math
    # (the final number as written) for any other task.
    assert make_accuracy("auto", "arithmetic", "number") is accuracy_exact
    assert make_accuracy("auto", "gsm8k", "number") is accuracy_math
    assert make_accuracy("auto", "jsonl", "math") is accuracy_math
    assert make_accuracy("auto", "arithmetic", "math") is accuracy_math
    assert make_accuracy("auto", "arithmetic") is accuracy_exact  # no kind: the name decides
    # An explicit mode wins over the kind.
    assert make_accuracy("exact", "jsonl", "string") is accuracy_exact


# Pieces of completions: answers, markers, markup, punctuation and space of every sort.
PIECES = [
    "Paris", "paris", "New York", "London", "B", "b", "(B)", "B)", "B.", "A", "(A)", " ", "\n",
    "\t", "\u00a0", "**", "_", "`", "'", '"', "\u201c", ".", ",", "!", "?", ":", "(", ")", "{",
    "}", "$", "The answer is ", "Answer: ", "answer is:", "ANSWER IS", "**Answer:** ",
    "answers ", "####", "#### ", "\\boxed{", "\\text{", "<answer>", "</answer>", "because",
    "I don't know", "\u00df", "SS",
]  # fmt: skip


def test_the_reward_and_the_strict_check_agree_on_string_and_choice_answers():
    # Two implementations of one judge, sharing no code: on any completion they must agree, so
    # that an honest reward on such a task keeps the reward-vs-strict gap at exactly 0.
    rng = random.Random(0)
    judges = (("string", text_equal, ["Paris", "New York", "ss"]), ("choice", choice_equal, ["B"]))
    right = dict.fromkeys(["Paris", "New York", "ss", "B"], 0)
    for _ in range(20_000):
        completion = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6)))
        for kind, reward_judge, references in judges:
            for reference in references:
                same = strict_equal(completion, reference, kind)
                assert reward_judge(completion, reference) == same, (completion, reference)
                right[reference] += same
    assert min(right.values()) >= 100, right  # both verdicts were given, many times


# --- format, overlong, weights, metrics ----------------------------------------------------------


def test_format_regex_configurable():
    cfg = RewardsConfig(functions=["format"], format_pattern=r"^<answer>\d+</answer>$")
    out = score(["<answer>12</answer>", "<answer>x</answer>", "12"], [ex("1")] * 3, cfg)
    assert out.total.tolist() == [1, 0, 0]
    with pytest.raises(ValueError, match=r"rewards\.format_pattern='\(' is not a valid regex"):
        load_rewards(RewardsConfig(functions=["format"], format_pattern="("))


def test_overlong_soft_penalty_dapo():
    # max 8 tokens, buffer 4: no penalty up to 4 tokens, then -(n - 4) / 4, -1 at 8.
    texts = ["abc", "abcdef", "abcdefg"]  # 4, 7, 8 tokens with EOS
    rollout = char_rollout(["q"], texts, 3)
    truncated = char_rollout(["q"], ["abcdefgh", "a", "ab"], 3, stop=False)
    cfg = RewardsConfig(functions=["overlong"], overlong_buffer=4)
    rewards = load_rewards(cfg, max_completion_length=8)
    assert score(rollout, [ex("", "q")], rewards).total.tolist() == [0.0, -0.75, -1.0]
    out = score(truncated, [ex("", "q")], rewards)
    assert out.total.tolist()[0] == -1.0 and out.metrics["truncated_frac"] == 1.0
    with pytest.raises(ValueError, match="needs max_completion_length"):
        load_rewards(cfg)
    with pytest.raises(ValueError, match="needs token ids"):
        score(["abc"], [ex("")], rewards)


def test_weights_combine_and_metrics():
    rollout = char_rollout(["1+1=", "2+2="], ["2", "3", "4", "4"], 2)
    examples = [ex("2", "1+1="), ex("4", "2+2=")]
    cfg = RewardsConfig(functions=["accuracy", "format"], weights=[1.0, 0.5], format_pattern="^2$")
    result = score(rollout, examples, load_rewards(cfg, task="arithmetic"))
    assert result.per_function["accuracy"].tolist() == [1, 0, 1, 1]
    assert result.per_function["format"].tolist() == [1, 0, 0, 0]
    assert result.total.tolist() == [1.5, 0, 1, 1]
    m = result.metrics
    assert m["rewards/accuracy/mean"] == 0.75 and m["rewards/format/mean"] == 0.25
    assert m["reward/mean"] == pytest.approx(3.5 / 4)
    assert m["frac_reward_zero_std"] == 0.5  # the second group is all-correct
    assert m["truncated_frac"] == 0.0
    assert m["completion_length/mean"] == 2.0 and m["completion_length/max"] == 2.0
    assert m["reward_errors/accuracy"] == 0 and m["reward_errors/format"] == 0


def test_examples_must_line_up_with_the_rollout():
    rollout = char_rollout(["1+1=", "2+2="], ["2", "3", "4", "4"], 2)
    with pytest.raises(ValueError, match=r"sample 0 answers prompt '1\+1=' but its example"):
        score(rollout, [ex("4", "2+2="), ex("2", "1+1=")], ["accuracy"])
    with pytest.raises(ValueError, match="3 examples for 4 samples"):
        score(rollout, [ex("2", "1+1=")] * 3, ["accuracy"])


# --- user functions ------------------------------------------------------------------------------

USER_MODULE = """
def contains_answer(completions, answer, **kwargs):
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]

def echo_columns(completions, **kwargs):
    echo_columns.seen = kwargs
    return [float(len(ids)) for ids in kwargs["completion_ids"]]

def only_long(completions, **kwargs):
    return [None if len(c) < 3 else 1.0 for c in completions]
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_user_function_module_and_file(user_module):
    file_ref = f"{user_module / 'my_rewards_mod.py'}:contains_answer"
    rewards = load_rewards(["my_rewards_mod:contains_answer", file_ref])
    assert [r.name for r in rewards] == ["contains_answer", "contains_answer_2"]
    out = score(["it is 42", "41"], [ex("42")], rewards, num_generations=2)
    assert out.per_function["contains_answer"].tolist() == [1, 0]
    assert out.per_function["contains_answer_2"].tolist() == [1, 0]
    assert out.total.tolist() == [2, 0]


def test_user_function_gets_trl_columns(user_module):
    import my_rewards_mod

    rollout = char_rollout(["1+1="], ["2", "22"], 2)
    examples = [Example("1+1=", "2", {"a": 1, "op": "+", "b": 1})]
    out = score(rollout, examples, ["my_rewards_mod:echo_columns"])
    seen = my_rewards_mod.echo_columns.seen
    assert seen["answer"] == ["2", "2"] and seen["prompt"] == ["1+1=", "1+1="]
    assert seen["prompts"] == seen["prompt"]
    assert seen["a"] == [1, 1] and seen["op"] == ["+", "+"]
    eos = TOK.eos_token_id
    assert seen["completion_ids"] == [TOK("2")["input_ids"] + [eos], TOK("22")["input_ids"] + [eos]]
    assert out.total.tolist() == [2.0, 3.0]


def test_none_means_not_applicable(user_module):
    out = score(
        ["ab", "abcd"], [ex("x")], ["my_rewards_mod:only_long", "format"], num_generations=2
    )
    assert math.isnan(out.per_function["only_long"][0].item())
    assert out.total.tolist() == [0.0, 1.0]  # None adds 0; format matches neither
    assert out.metrics["rewards/only_long/mean"] == 1.0
    assert out.metrics["rewards/only_long/none_frac"] == 0.5
    assert out.errors["only_long"] == 0


# --- nothing silently lost ------------------------------------------------------------------------


def raises_on_second(completions, **kwargs):
    out = []
    for c in completions:
        if c == "boom":
            raise RuntimeError("kaput in user code")
        out.append(1.0)
    return out


def non_finite(completions, **kwargs):
    return [float("nan"), float("inf"), 1.0, "x"]


def wrong_length(completions, **kwargs):
    return [1.0]


def test_raising_function_counted_fallback_and_logged_once(caplog):
    cfg = RewardsConfig(functions=[raises_on_second, "format"], fallback=-0.5)
    rewards = load_rewards(cfg)
    with caplog.at_level(logging.WARNING, logger="grpolab.rewards"):
        out = score(["ok", "boom"], [ex("1")], rewards, num_generations=2)
        again = score(["boom", "ok"], [ex("1")], rewards, num_generations=2)
    assert out.per_function["raises_on_second"].tolist() == [-0.5, -0.5]
    assert out.errors["raises_on_second"] == 2 and out.errors["format"] == 0
    assert out.metrics["reward_errors/raises_on_second"] == 2.0
    assert again.errors["raises_on_second"] == 2
    logged = [r for r in caplog.records if "raises_on_second" in r.getMessage()]
    assert len(logged) == 1  # the first failure only
    message = logged[0].getMessage()
    # one line at the user's own code: its file, line and source, no trainer frame
    assert logged[0].exc_info is None and "\n" not in message
    assert "RuntimeError: kaput in user code" in message
    lines, first = inspect.getsourcelines(raises_on_second)
    raised = first + next(i for i, line in enumerate(lines) if "raise RuntimeError" in line)
    assert f'test_rewards.py:{raised} in raises_on_second: raise RuntimeError("kaput' in message


def returns_nothing(completions, **kwargs):
    [1.0 for _ in completions]


def returns_a_scalar(completions, **kwargs):
    return 0.5


@pytest.mark.parametrize(
    "fn, got",
    [(returns_nothing, "got None (no return statement?)"), (returns_a_scalar, "got float 0.5")],
)
def test_a_reward_that_returns_no_list_says_what_it_must_return(fn, got, caplog):
    with caplog.at_level(logging.WARNING, logger="grpolab.rewards"):
        out = score(["a", "b"], [ex("1")], [fn], num_generations=2)
    assert out.errors[fn.__name__] == 2
    (logged,) = [r for r in caplog.records if fn.__name__ in r.getMessage()]
    message = logged.getMessage()
    assert "must return a list of 2 floats (or None for rows it cannot score)" in message
    assert got in message and f"(test_rewards.py:{fn.__code__.co_firstlineno})" in message


def test_non_finite_and_wrong_length_counted():
    out = score(["a", "b", "c", "d"], [ex("1")], [non_finite, wrong_length], num_generations=4)
    assert out.per_function["non_finite"].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert out.errors == {"non_finite": 3, "wrong_length": 4}
    assert torch.isfinite(out.total).all()


def test_slow_function_stopped_and_counted():
    def slow(completions, **kwargs):
        time.sleep(0.8)
        return [1.0] * len(completions)

    rewards = load_rewards(RewardsConfig(functions=[slow, "format"], timeout=0.1))
    start = time.perf_counter()
    out = score(["a", "b"], [ex("1")], rewards, num_generations=2)
    assert time.perf_counter() - start < 0.6
    assert out.errors["slow"] == 2 and out.per_function["slow"].tolist() == [0.0, 0.0]
    # While the late call still runs, the next call is not started (and counted too).
    again = score(["a", "b"], [ex("1")], rewards, num_generations=2)
    assert again.errors["slow"] == 2
    time.sleep(0.8)
    rewards[0].timeout = 5.0
    assert score(["a", "b"], [ex("1")], rewards, num_generations=2).errors["slow"] == 0


# --- bad reward names and files: one-line errors naming the thing --------------------------------


def test_bad_reward_references(tmp_path):
    cases = []
    bad_syntax = tmp_path / "broken.py"
    bad_syntax.write_text("def f(completions, **kw):\n    return [1.0 for c in completions\n")
    cases.append((f"{bad_syntax}:f", r"reward file .*broken\.py.* has a syntax error at line"))
    missing = tmp_path / "missing.py"
    cases.append((f"{missing}:f", r"reward file .*missing\.py.* does not exist"))
    ok = tmp_path / "ok.py"
    ok.write_text("def f(completions, **kw):\n    return [1.0] * len(completions)\nX = 3\n")
    cases.append((f"{ok}:g", r"has no function 'g'"))
    cases.append((f"{ok}:X", r"'X' in file .* is not callable"))
    cases.append(("acuracy", r"unknown reward 'acuracy': not a built-in"))
    cases.append(("no_such_pkg.mod:f", r"cannot import module 'no_such_pkg.mod'"))
    for ref, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            load_rewards([ref])
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (RewardsConfig(functions=["accuracy", "format"], weights=[1.0]), "2 functions"),
        (RewardsConfig(functions=[]), "rewards.functions is empty"),
        (RewardsConfig(timeout=0), r"rewards\.timeout=0"),
        (RewardsConfig(accuracy_mode="fuzzy"), r"rewards\.accuracy_mode='fuzzy'"),
        (RewardsConfig(weights=[float("nan")]), r"rewards\.weights\[0\]"),
    ],
)
def test_bad_rewards_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        load_rewards(cfg)


def test_rewards_config_through_the_config_loader(tmp_path):
    config = pytest.importorskip("grpolab.config")
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"rewards": {"functions": ["accuracy", "format"]}}))
    cfg = config.load_config(path, ["rewards.weights=1,0.1", "rewards.accuracy_mode=exact"])
    rewards = load_rewards(cfg.rewards, task=cfg.task)
    assert [r.weight for r in rewards] == [1.0, 0.1]
    assert score(["85"], [ex("85")], rewards).per_function["accuracy"].item() == 1.0


def test_a_sample_every_function_scores_none_is_unscorable():
    def sometimes(completions, **_):
        return [None if c == "?" else 1.0 for c in completions]

    def never(completions, **_):
        return [None] * len(completions)

    result = score(["1", "?", "2", "?"], [ex("2")] * 4, [sometimes, never], num_generations=2)
    assert result.scorable.tolist() == [True, False, True, False]
    assert result.metrics["reward/unscorable"] == 0.5
    assert result.total.tolist() == [1.0, 0.0, 1.0, 0.0]  # None counts 0 in the total
