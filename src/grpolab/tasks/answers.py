"""What kind of answer a task's references are: the one fact every judge of the task reads.

    number  "85", "-3.5", "2,280", "1/2": compared by value (the arithmetic task, GSM8K)
    string  "Paris": the final answer as text, case, spaces and surrounding punctuation aside
    choice  "B": a multiple-choice letter ("The answer is (B)", "B)", "**B**", "Answer: b")
    math    "\\frac{1}{2}", "2\\sqrt{2}", "x^2+1": a mathematical object (math-verify)

`task.answer_kind` declares it; unset, the arithmetic task's is number and a file task's is
inferred from its references (`infer_answer_kind`), with the reason, which the commands print
at start. The strict check (grpolab.tasks.strict) and the accuracy reward (grpolab.rewards.builtin)
each implement every kind on their own; they take the kind from here (Task.answer_kind).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

ANSWER_KINDS = ("number", "string", "choice", "math")
CHOICE_LETTERS = "ABCDEFGHIJ"  # up to ten options (MMLU-Pro's); a reference is one of them

# A number as a reference is written: sign, thousands commas, decimals, or a fraction a/b.
_NUMBER = re.compile(r"-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+|\d+\s*/\s*\d+)")
_CHOICE = re.compile(rf"\(?([{CHOICE_LETTERS}])\)?", re.IGNORECASE)
# LaTeX, or an expression of numbers and one-letter variables ("x+1", "(1, 2)", "2^{10}").
_LATEX = re.compile(r"[\\^_{}$]")
_EXPRESSION = re.compile(r"[\d\sA-Za-z.,+\-*/^=()\[\]<>]*[\d)\]][\d\sA-Za-z.,+\-*/^=()\[\]<>]*")
_OPERATOR = re.compile(r"[+*/^=<>()\[\]]|(?<=\S)\s*-\s*(?=\S)")
_MATH_WORDS = {"sqrt", "pi", "inf", "sin", "cos", "tan", "log", "ln", "exp"}


def is_number(reference: str) -> bool:
    return _NUMBER.fullmatch(reference.strip()) is not None


def is_choice(reference: str) -> bool:
    return _CHOICE.fullmatch(reference.strip()) is not None


def is_mathematical(reference: str) -> bool:
    """LaTeX, or an expression: digits, operators or brackets, one-letter variables."""
    text = reference.strip()
    if _LATEX.search(text):
        return True
    if not _EXPRESSION.fullmatch(text) or not _OPERATOR.search(text):
        return False
    words = re.findall(r"[A-Za-z]{2,}", text)
    return all(w.lower() in _MATH_WORDS for w in words)


def infer_answer_kind(references: Sequence[str]) -> tuple[str, str]:
    """(kind, why) from a task's reference answers: all numbers -> number, all single letters
    A-J -> choice, numbers and LaTeX or expressions -> math, anything else -> string."""
    refs = [str(r) for r in references]
    n = len(refs)
    if n and all(map(is_number, refs)):
        return "number", f"all {n} reference answers are numbers, e.g. {refs[0]!r}"
    if n and all(map(is_choice, refs)):
        letters = "".join(sorted({_CHOICE.fullmatch(r.strip())[1].upper() for r in refs}))
        why = f"all {n} reference answers are single letters ({letters}), e.g. {refs[0]!r}"
        return "choice", why
    symbolic = [r for r in refs if not is_number(r) and is_mathematical(r)]
    if symbolic and all(is_number(r) or is_mathematical(r) for r in refs):
        rest = "" if len(symbolic) == n else ", the rest numbers"
        return "math", (
            f"{len(symbolic)} of {n} reference answers are LaTeX or expressions, e.g. "
            f"{symbolic[0]!r}{rest}"
        )
    text = [r for r in refs if not is_number(r)] or refs
    return "string", f"{len(text)} of {n} reference answers are text, e.g. {text[0]!r}"


def check_answer_kind(kind: str, references: Sequence[tuple[str, str]]) -> None:
    """Refuse a declared kind that the references cannot have. references: (where, answer)."""
    if kind not in ANSWER_KINDS:
        raise ValueError(f"task.answer_kind={kind!r}: expected one of {', '.join(ANSWER_KINDS)}")
    fits = {"number": is_number, "choice": is_choice}.get(kind)
    if fits is None:
        return  # any text is a string, and math-verify reads any text
    bad = [(where, answer) for where, answer in references if not fits(answer)]
    if bad:
        where, answer = bad[0]
        what = "a number (42, -3.5, 2,280, 1/2)" if kind == "number" else "one letter A-J"
        more = f" (and {len(bad) - 1} more rows)" if len(bad) > 1 else ""
        raise ValueError(
            f"task.answer_kind={kind!r}: the answer of {where}, {answer!r}, is not {what}"
            f"{more}; declare another kind (one of {', '.join(ANSWER_KINDS)}) or leave it unset "
            "to infer it"
        )
