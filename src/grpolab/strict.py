"""The strict answer check: is the completion's final answer, as written, the reference?

    strict_answer("88 + 22 = 110")          -> "110"
    strict_answer("88 + 22 =")              -> "22"   (restating the question answers nothing)
    strict_answer("so \\boxed{\\frac{1}{2}}") -> "1/2"
    strict_equal("He earns 2,280.\\n#### 2,280", "2280") -> True

The final answer is the last \\boxed{...}'s content, else the first number after the last
"####", else the last number in the completion. Numbers compare by value after removing
thousands commas, "$", "%" and trailing zeros (0.50 = 1/2 = \\frac{1}{2}); anything else
compares as text without spaces. No expression is evaluated and no equivalence is looked for:
\\boxed{88+22} is not 110 and \\boxed{\\sqrt{8}} is not 2\\sqrt{2}.

This is written apart from the reward code on purpose (no shared helpers, no math-verify): it
is the independent measurement that a reward bug cannot also bend. Evaluation reports it
beside the reward-based accuracy, and the monitors warn when the training reward leaves it
behind (grpolab.monitors).
"""

from __future__ import annotations

import re
from fractions import Fraction

# A number as written: optional sign (not the minus of "37-48"), thousands commas, decimals.
_NUMBER = re.compile(r"(?:(?<![\w)\].])-)?(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_FRACTION = re.compile(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}|(-?\d+)\s*/\s*(-?\d+)")
_LATEX_NOISE = re.compile(r"\\text\{[^{}]*\}|\\mathrm\{[^{}]*\}|\\[,!;: $]|\\left|\\right|[$\s]")


def strict_answer(completion: str) -> str | None:
    """The completion's final answer, normalised (see the module docstring); None if none."""
    boxed = _last_boxed(completion)
    if boxed is not None:
        return _normalise(boxed) or None
    if "####" in completion:
        line = completion.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        found = _NUMBER.search(line.replace("−", "-"))  # "#### 18 dollars" answers 18
        return _normalise(found.group() if found else line) or None
    numbers = _NUMBER.findall(completion.replace("−", "-"))
    return _normalise(numbers[-1]) if numbers else None


def strict_equal(completion: str, reference: str) -> bool:
    """Whether the completion's final answer is exactly the reference (after normalising)."""
    answer = strict_answer(completion)
    return answer is not None and answer == _normalise(str(reference))


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces kept), None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None  # unclosed: no answer was written


def _normalise(text: str) -> str:
    """A canonical spelling: numbers as reduced fractions ("1/2", "110", "-3"), other text
    without spaces, "$", \\text{...} units or LaTeX spacing."""
    t = _LATEX_NOISE.sub("", text.replace("−", "-")).replace("{,}", ",")
    t = t.rstrip(".").removesuffix("\\%").removesuffix("%")
    value = _value(t)
    if value is None:
        return t
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


def _value(text: str) -> Fraction | None:
    if re.fullmatch(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+", text):
        return Fraction(text.replace(",", ""))
    match = _FRACTION.fullmatch(text)
    if match is None:
        return None
    sign, num, den, plain_num, plain_den = match.groups()
    num, den = (num, den) if num is not None else (plain_num, plain_den)
    if int(den) == 0:
        return None
    return Fraction(int(num), int(den)) * (-1 if sign else 1)
