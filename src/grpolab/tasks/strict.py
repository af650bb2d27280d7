"""The strict answer check: is the completion's final answer, as written, the reference?

One judge per answer kind (grpolab.tasks.answers: the task's `answer_kind`):

    number  strict_equal("He earns 2,280.\\n#### 2,280", "2280")            -> True
            strict_answer("88 + 22 =")                                     -> "22"
    string  strict_equal("The answer is Paris.", "paris", "string")        -> True
    choice  strict_equal("The answer is (B)", "B", "choice")               -> True
    math    strict_equal("so \\boxed{\\frac{1}{2}}", "\\frac12", "math")    -> False

number: the final answer is the last \\boxed{...}'s content, else the first number after the
last "####", else the last number in the completion. Numbers compare by value after removing
thousands commas, "$", "%" and trailing zeros (0.50 = 1/2 = \\frac{1}{2}); anything else
compares as text without spaces. No expression is evaluated and no equivalence is looked for:
\\boxed{88+22} is not 110 and \\boxed{\\sqrt{8}} is not 2\\sqrt{2}.

string and choice: the final answer is the last \\boxed{...}, else the rest of the line after
the last "####", else the last <answer>...</answer>, else what follows the last "answer is" or
"answer:" on its line, else the whole completion. string compares it as text: case folded,
runs of whitespace as one space, surrounding punctuation, quotes and markdown (**, _, `)
removed, \\text{...} unwrapped; "Paris." is "paris", "the capital is Paris" is not. choice
reads one letter from it: "B", "(B)", "B)", "B.", "**B**", "B) Paris", any case; "B because"
is no letter.

math: a numeric reference is judged as a number; any other is compared as text without spaces
(as number does) with the final answer read as the last \\boxed{...}, else the line after
"####", else <answer>...</answer>, else the last $...$, else what follows "answer is", else
the last number. Text-exact: \\frac12 is not \\frac{1}{2} here, which math-verify (the
accuracy reward) accepts; on symbolic answers the two part ways.

This is written apart from the reward code on purpose (no shared helpers, no math-verify): it
is the independent measurement that a reward bug cannot also bend. Evaluation reports it
beside the reward-based accuracy, and the monitors warn when the training reward leaves it
behind (grpolab.train.monitors).
"""

from __future__ import annotations

import re
import string
from fractions import Fraction

# A number as written: optional sign (not the minus of "37-48"), thousands commas, decimals.
_NUMBER = re.compile(r"(?:(?<![\w)\].])-)?(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_FRACTION = re.compile(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}|(-?\d+)\s*/\s*(-?\d+)")
_LATEX_NOISE = re.compile(r"\\text\{[^{}]*\}|\\mathrm\{[^{}]*\}|\\[,!;: $]|\\left|\\right|[$\s]")


KINDS = ("number", "string", "choice", "math")  # grpolab.tasks.answers.ANSWER_KINDS


def strict_answer(completion: str, kind: str = "number") -> str | None:
    """The completion's final answer as `kind` reads it, normalised (see the module
    docstring); None if it gives none."""
    if kind == "string":
        return _as_text(_final_span(completion))
    if kind == "choice":
        return _as_letter(_final_span(completion))
    if kind == "math":
        return _math_answer(completion)
    if kind != "number":
        raise ValueError(f"answer kind {kind!r} is not one of {', '.join(KINDS)}")
    return _number_answer(completion)


def strict_equal(completion: str, reference: str, kind: str = "number") -> bool:
    """Whether the completion's final answer is exactly the reference (after normalising)."""
    if kind not in KINDS:
        raise ValueError(f"answer kind {kind!r} is not one of {', '.join(KINDS)}")
    reference = str(reference)
    if kind == "string":
        expected = _as_text(reference)
    elif kind == "choice":
        expected = _as_letter(reference)
    elif kind == "math" and _value(_normalise(reference)) is None:
        expected = _normalise(reference)
    else:  # number, or math with a numeric reference: by value
        kind, expected = "number", _normalise(reference)
    answer = strict_answer(completion, kind)
    return answer is not None and answer == expected


def _number_answer(completion: str) -> str | None:
    boxed = last_boxed(completion)
    if boxed is not None:
        return _normalise(boxed) or None
    if "####" in completion:
        line = completion.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        found = _NUMBER.search(line.replace("−", "-"))  # "#### 18 dollars" answers 18
        return _normalise(found.group() if found else line) or None
    numbers = _NUMBER.findall(completion.replace("−", "-"))
    return _normalise(numbers[-1]) if numbers else None


# --- Text and letters ------------------------------------------------------------------------

ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# "The answer is", "Final answer:", "**Answer:**", "answer is:" (not "answers", "answered").
ANSWER_IS = re.compile(r"\banswer(?:\*\*|__)?\s*(?:is\b\s*:?|:)", re.IGNORECASE)
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf)\{([^{}]*)\}")
_QUOTES = "\u201c\u201d\u2018\u2019\u00ab\u00bb"
_SURROUNDING = string.punctuation + _QUOTES + string.whitespace
_EMPHASIS = re.compile(rf"^[\s*_`'\"{_QUOTES}]+|[\s*_`'\"{_QUOTES}]+$")  # "**B**", "`B`"
# "B", "B.", "B)", "B:", "B) Paris", "(B)", "(B).", "(B) Paris"; nothing else.
_LETTER = re.compile(r"\(([A-Za-z])\)[.:]?(?:\s.*)?|([A-Za-z])(?:[.:)](?:\s.*)?)?", re.DOTALL)


def _final_span(completion: str) -> str:
    """Where a string or choice answer is written (see the module docstring)."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    if "####" in completion:
        return completion.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    tagged = ANSWER_TAGS.findall(completion)
    if tagged:
        return tagged[-1]
    said = [m.end() for m in ANSWER_IS.finditer(completion)]
    if said:
        return completion[said[-1] :].strip().split("\n", 1)[0]
    return completion


def _as_text(span: str) -> str | None:
    """Case folded, one space between words, no surrounding punctuation; None when empty."""
    unwrapped = _TEXT_COMMAND.sub(r"\1", span)
    text = " ".join(unwrapped.split()).strip(_SURROUNDING).casefold()
    return text or None


def _as_letter(span: str) -> str | None:
    """The one option letter the span gives, upper case; None when it gives none."""
    match = _LETTER.fullmatch(_EMPHASIS.sub("", span))
    if match is None:
        return None
    return (match[1] or match[2]).upper()


# --- Math ----------------------------------------------------------------------------------

_INLINE_MATH = re.compile(r"\$([^$]+)\$|\\\((.+?)\\\)", re.DOTALL)


def _math_answer(completion: str) -> str | None:
    """A symbolic final answer, normalised as text (see the module docstring)."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return _normalise(boxed) or None
    if "####" in completion:
        return _normalise(completion.rsplit("####", 1)[1].strip().split("\n", 1)[0]) or None
    for found in (
        ANSWER_TAGS.findall(completion),
        ["".join(m) for m in _INLINE_MATH.findall(completion)],
    ):
        if found:
            return _normalise(found[-1]) or None
    said = [m.end() for m in ANSWER_IS.finditer(completion)]
    if said:
        return _normalise(completion[said[-1] :].strip().split("\n", 1)[0]) or None
    return _number_answer(completion)


def last_boxed(text: str) -> str | None:
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
