"""The strict answer check: the final answer as written, compared exactly; and its independence
from the reward code."""

import ast
from pathlib import Path

import pytest

import grpolab.strict
from grpolab.evaluate import strict_correct
from grpolab.strict import strict_answer, strict_equal


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("88 + 22 = 110", "110"),
        ("88 + 22 =", "22"),  # restating the question answers with its last number
        ("The answer is 56+91", "91"),
        ("What is 88 + 22?", "22"),
        ("37-48=-11", "-11"),  # the minus of an operator is not a sign; a leading one is
        ("x = -5.", "-5"),
        ("He earns 2,280 dollars.\n#### 2,280", "2280"),
        ("#### 18 dollars", "18"),
        ("#### Paris\nthat is all", "Paris"),
        ("first 3, then \\boxed{5}", "5"),
        ("so \\boxed{\\frac{1}{2}}", "1/2"),
        ("\\boxed{\\$18}", "18"),
        ("\\boxed{18 \\text{ dollars}}", "18"),
        ("\\boxed{88+22}", "88+22"),  # an expression stays text: never evaluated
        ("\\boxed{2\\sqrt{2}}", "2\\sqrt{2}"),
        ("0.50", "1/2"),
        ("10,20", "20"),
        ("−7", "-7"),  # a typographic minus
        ("\\boxed{12", "12"),  # cut off before the brace closed: its last number
    ],
)
def test_the_final_answer_as_written(completion, answer):
    assert strict_answer(completion) == answer


@pytest.mark.parametrize("completion", ["no number here", "", "#### ", "\\boxed{}"])
def test_no_answer_is_none(completion):
    assert strict_answer(completion) is None


def test_strict_equal_normalises_numbers_only():
    assert strict_equal("The answer is 85.", "85")
    assert strict_equal("#### 2,280", "2280") and strict_equal("85.0", "85")
    assert strict_equal("\\boxed{\\frac{1}{2}}", "0.5") and strict_equal("\\boxed{0.5}", "1/2")
    assert not strict_equal("88 + 22 =", "110")
    assert not strict_equal("\\boxed{88 + 22}", "110")
    assert not strict_equal("\\boxed{\\sqrt{8}}", "2\\sqrt{2}")  # no equivalences
    assert strict_equal("\\boxed{x^2 + 1}", "x^2+1")  # text without spaces
    got = strict_correct(["85", "86", "37+48=", "so 85"], ["85"] * 4)
    assert got.tolist() == [True, False, False, True]


def test_the_strict_check_shares_no_code_with_the_rewards():
    # It is the independent measurement: a bug in the reward code cannot also bend it.
    tree = ast.parse(Path(grpolab.strict.__file__).read_text())
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not [m for m in imported if m and (m.startswith("grpolab") or "math_verify" in m)]
