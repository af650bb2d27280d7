"""The strict answer check: the final answer as written, compared exactly; and its independence
from the reward code."""

import ast
from pathlib import Path

import pytest

import grpolab.tasks.strict
from grpolab.tasks.strict import strict_answer, strict_equal
from grpolab.train.evaluate import strict_correct


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
    tree = ast.parse(Path(grpolab.tasks.strict.__file__).read_text())
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not [m for m in imported if m and (m.startswith("grpolab") or "math_verify" in m)]


# --- The other answer kinds ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "reference", "right"),
    [
        ("Paris", "Paris", True),
        ("Paris.", "paris", True),  # case and surrounding punctuation
        ("  **Paris**\n", "Paris", True),  # markdown and whitespace
        ("The answer is Paris.", "Paris", True),
        ("Final answer: new   york", "New York", True),  # runs of spaces are one
        ("\\boxed{\\text{Paris}}", "Paris", True),
        ("#### Paris\nthat is all", "Paris", True),
        ("<answer>Mexico City</answer>", "Mexico City", True),
        ("'Paris'", "Paris", True),
        ("The capital of France is Paris.", "Paris", False),  # no answer marked: all of it
        ("Parisian", "Paris", False),
        ("Paris is the answer", "Paris", False),
        ("The answer is Rome. Paris is wrong", "Paris", False),
        ("", "Paris", False),
        ("...", "...", False),  # nothing left to compare
    ],
)
def test_string_answers_compare_as_text(completion, reference, right):
    assert strict_equal(completion, reference, "string") is right


@pytest.mark.parametrize(
    ("completion", "letter"),
    [
        ("B", "B"),
        ("b", "B"),
        ("The answer is (B)", "B"),
        ("B)", "B"),
        ("**B**", "B"),
        ("Answer: b", "B"),
        ("(B) Mercury", "B"),
        ("B. Mercury", "B"),
        ("answer is:\n(C).", "C"),
        ("\\boxed{D}", "D"),
        ("#### A", "A"),
        ("<answer>a</answer>", "A"),
        ("B because it is closest", None),  # a letter then prose names no option
        ("A cat", None),
        ("I don't know.", None),
        ("Mercury", None),
        ("", None),
    ],
)
def test_choice_answers_are_one_letter(completion, letter):
    assert strict_answer(completion, "choice") == letter
    assert strict_equal(completion, "B", "choice") is (letter == "B")


def test_choice_references_may_be_written_with_parentheses_or_lower_case():
    assert strict_equal("The answer is B.", "(b)", "choice")
    assert not strict_equal("The answer is B.", "C", "choice")


@pytest.mark.parametrize(
    ("completion", "reference", "right"),
    [
        ("\\boxed{x^2 + 1}", "x^2+1", True),  # text without spaces
        ("The answer is $2\\sqrt{2}$.", "2\\sqrt{2}", True),  # the last inline math
        ("The answer is x^2 + 1.", "x^2+1", True),
        ("#### x^2+1", "x^2+1", True),  # the whole line, not its first number
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", False),  # no equivalences
        ("so 5", "5", True),  # a numeric reference is judged as a number
        ("The answer is 5, since 2+3=5", "5", True),
        ("", "x+1", False),
    ],
)
def test_math_answers_symbolic_as_text_numeric_by_value(completion, reference, right):
    assert strict_equal(completion, reference, "math") is right


def test_the_number_kind_is_the_default_and_an_unknown_kind_is_refused():
    assert strict_equal("#### 2,280", "2280") == strict_equal("#### 2,280", "2280", "number")
    assert not strict_equal("Paris", "Paris")  # a number judge finds no number in it
    with pytest.raises(ValueError, match="'word' is not one of number, string, choice, math"):
        strict_equal("Paris", "Paris", "word")
    with pytest.raises(ValueError, match="'word'"):
        strict_answer("Paris", "word")
