"""The built-in reward functions, with the TRL signature f(completions, **columns) -> list.

accuracy  1.0 when the completion's final answer, as written, equals the reference, judged
          as the task's answer kind (grpolab.tasks.answers) in mode "auto":
          number  the arithmetic task: "exact"; any other: "math" (its numeric path)
          math    "math": the answer is the last \\boxed{...}, else the text after "####",
                  else (numeric references) the last number; numbers compare by value, other
                  references by math-verify, so "\\frac{1}{2}" equals "0.5". Nothing that
                  restates the question as an expression ("88 + 22 =") is evaluated into an
                  answer (see math_equal).
          string  text_equal: "Paris." and "The answer is paris" answer "Paris"
          choice  choice_equal: "The answer is (B)", "B)", "**B**", "Answer: b" answer "B"
          mode "exact": the stripped completion is the answer (the arithmetic task: "85" then
          EOS); mode "math": as the math kind, whatever the task.
format    1.0 when the completion matches a regular expression (re.search, DOTALL).
overlong  DAPO's soft overlong punishment: 0 up to max_length - buffer tokens, then falling
          linearly to -1 at max_length (truncated completions get -1).
"""

from __future__ import annotations

import functools
import re
import string
import threading
from fractions import Fraction

from grpolab.tasks import gym
from grpolab.tasks.base import Example

ACCURACY_MODES = ("auto", "exact", "math")
DEFAULT_FORMAT_PATTERN = r"\\boxed\{.+\}|####\s*\S+"


def accuracy_exact(completions: list[str], answer: list[str], **_: object) -> list[float]:
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


def accuracy_math(completions: list[str], answer: list[str], **_: object) -> list[float]:
    return [float(math_equal(c, str(a))) for c, a in zip(completions, answer, strict=True)]


def accuracy_text(completions: list[str], answer: list[str], **_: object) -> list[float]:
    return [float(text_equal(c, str(a))) for c, a in zip(completions, answer, strict=True)]


def accuracy_choice(completions: list[str], answer: list[str], **_: object) -> list[float]:
    return [float(choice_equal(c, str(a))) for c, a in zip(completions, answer, strict=True)]


def math_equal(completion: str, reference: str) -> bool:
    """Whether the completion's final answer, as written, equals `reference`.

    The final answer is the last \\boxed{...}, else the text after the last "####". For a
    numeric reference ("110", "2,280", "0.5") a completion with neither gives its last number;
    the answer must be written as a number (85, 2,280, $18, 25%, 18 dollars, \\frac{1}{2}, 3/4)
    and is compared by value. No expression is evaluated: "88 + 22 =" and \\boxed{88+22}
    restate the question and do not answer 110. Any other reference (\\frac12, \\sqrt{8}, an
    interval) is a mathematical object: math-verify compares it with the marked answer (or,
    with none, with what it extracts from the completion), so \\boxed{2\\sqrt{2}} equals
    \\sqrt{8}.
    """
    if completion.strip() == reference.strip():
        return True
    marked = _marked_answer(completion)
    gold_number = _written_number(reference)
    if gold_number is not None:
        if marked is None:
            numbers = _NUMBER_IN_TEXT.findall(completion)
            marked = numbers[-1] if numbers else None
        return marked is not None and _written_number(marked) == gold_number
    try:
        from math_verify import parse, verify
    except ImportError as e:  # a dependency of grpolab; missing only in a broken install
        raise ImportError(
            "the 'accuracy' reward in math mode needs math-verify: pip install math-verify"
        ) from e
    gold = _parse_reference(reference)
    if not gold:
        return False
    text = completion if marked is None else f"${marked}$"
    # math-verify bounds each parse/compare with SIGALRM, which exists only in the main thread.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    predicted = parse(text, extraction_config=_extraction_config(), parsing_timeout=limit)
    if not predicted:
        return False
    return bool(verify(list(gold), predicted, timeout_seconds=limit))


# The minus of "37-48" is an operator, not a sign; thousands commas belong to the number.
_NUMBER_IN_TEXT = re.compile(
    r"(?:(?<![\w)\]])-)?(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
)
_WRITTEN_NUMBER = re.compile(
    r"(?P<sign>-?)(?:(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?P<dec>\.\d+)?"
    r"|\\[dt]?frac\{(?P<fnum>\d+)\}\{(?P<fden>\d+)\}|(?P<num>\d+)/(?P<den>\d+))"
    r"(?:\s*%|\s+[a-zA-Z][a-zA-Z ]*)?"  # a percent sign or unit words: "25%", "18 dollars"
)
_NOT_THE_ANSWER = re.compile(r"\\text\{([^{}]*)\}|\\mathrm\{([^{}]*)\}|\\[,!;:]|\\?\$")


def _written_number(text: str) -> Fraction | None:
    """The value of a text that is one number as people write it; None for anything else."""
    t = _NOT_THE_ANSWER.sub(r" \1\2", text.replace("{,}", ",").replace("\u2212", "-"))
    m = _WRITTEN_NUMBER.fullmatch(t.replace("\\%", "%").strip().removesuffix(".").strip())
    if m is None:
        return None
    if m["int"] is not None:
        value = Fraction(m["int"].replace(",", "") + (m["dec"] or ""))
    else:
        num, den = int(m["fnum"] or m["num"]), int(m["fden"] or m["den"])
        if den == 0:
            return None
        value = Fraction(num, den)
    return -value if m["sign"] else value


def _marked_answer(completion: str) -> str | None:
    """The last \\boxed{...}'s content (nested braces kept), else the rest of the line after
    the last "####"; None when the completion marks no answer."""
    at = completion.rfind("\\boxed{")
    if at >= 0:
        depth = 0
        for i in range(at + len("\\boxed{"), len(completion)):
            ch = completion[i]
            if ch == "}" and depth == 0:
                return completion[at + len("\\boxed{") : i]
            depth += {"{": 1, "}": -1}.get(ch, 0)
        return None
    if "####" in completion:
        return completion.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    return None


# --- Text and letters (the string and choice kinds) --------------------------------------------
#
# The final answer is written in the last \\boxed{...}, else after the last "####" (to the end of
# its line), else in the last <answer>...</answer>, else after the last "answer is" / "answer:"
# (to the end of its line), else it is the whole completion.

_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_SAID = re.compile(r"\banswer(?:\*\*|__)?\s*(?:is\b\s*:?|:)", re.IGNORECASE)
_WRAPPED = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf)\{([^{}]*)\}")
_QUOTES = "\u201c\u201d\u2018\u2019\u00ab\u00bb"
_EDGE = set(string.punctuation + _QUOTES)  # stripped from both ends of a string answer
_MARKUP = set("*_`'\"" + _QUOTES)  # around an option letter: "**B**", "`B`"


def text_equal(completion: str, reference: str) -> bool:
    """Whether the final answer, as text, is the reference: case folded, one space between
    words, surrounding punctuation and markdown ignored ("Paris." is "paris"; "It is Paris"
    is not)."""
    expected = _folded(reference)
    return bool(expected) and _folded(_written_answer(completion)) == expected


def choice_equal(completion: str, reference: str) -> bool:
    """Whether the final answer is the reference's option letter: "B", "(B)", "B)", "B.",
    "**B**", "B) Paris", any case ("B because" names no option)."""
    expected = _option(reference)
    return expected is not None and _option(_written_answer(completion)) == expected


def _written_answer(completion: str) -> str:
    at = completion.rfind("\\boxed{")
    if at >= 0:
        depth, start = 0, at + len("\\boxed{")
        for i in range(start, len(completion)):
            if completion[i] == "}" and depth == 0:
                return completion[start:i]
            depth += {"{": 1, "}": -1}.get(completion[i], 0)
    if "####" in completion:
        return completion.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    tagged = _TAGGED.findall(completion)
    if tagged:
        return tagged[-1]
    said = list(_SAID.finditer(completion))
    if said:
        return completion[said[-1].end() :].strip().split("\n", 1)[0]
    return completion


def _folded(text: str) -> str:
    words = " ".join(_WRAPPED.sub(r"\1", text).split())
    start, end = 0, len(words)
    while start < end and (words[start] in _EDGE or words[start].isspace()):
        start += 1
    while end > start and (words[end - 1] in _EDGE or words[end - 1].isspace()):
        end -= 1
    return words[start:end].casefold()


def _option(text: str) -> str | None:
    """The option letter a text names, upper case, or None."""
    t = text
    while t and (t[0] in _MARKUP or t[0].isspace()):
        t = t[1:]
    while t and (t[-1] in _MARKUP or t[-1].isspace()):
        t = t[:-1]
    if len(t) >= 3 and t[0] == "(" and t[2] == ")":
        letter, rest = t[1], t[3:]
        rest = rest[1:] if rest[:1] in (".", ":") else rest
    elif t:
        letter, rest = t[0], t[1:]
        if rest and rest[0] not in ".:)":
            return None
        rest = rest[1:]
    else:
        return None
    if letter not in string.ascii_letters or (rest and not rest[0].isspace()):
        return None
    return letter.upper()


@functools.lru_cache(maxsize=65536)
def _parse_reference(reference: str) -> tuple:
    from math_verify import parse

    limit = 5 if threading.current_thread() is threading.main_thread() else None
    for candidate in (reference, f"${reference}$"):
        gold = parse(candidate, extraction_config=_extraction_config(), parsing_timeout=limit)
        if gold:
            return tuple(gold)
    return ()


@functools.cache
def _extraction_config() -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(), ExprExtractionConfig()]


def make_accuracy(mode: str = "auto", task: str | None = None, kind: str | None = None):
    """accuracy in `mode`; "auto" judges the task's answer kind (the module docstring): text
    for string, the option letter for choice, else "exact" for the arithmetic task and "math"
    otherwise (a kind of None: the task's name alone decides, as for number)."""
    if mode not in ACCURACY_MODES:
        raise ValueError(f"rewards.accuracy_mode={mode!r} is not one of {list(ACCURACY_MODES)}")
    if mode == "auto" and kind in ("string", "choice"):
        return accuracy_text if kind == "string" else accuracy_choice
    if mode == "auto":
        mode = "exact" if task == "arithmetic" and kind != "math" else "math"
    return accuracy_exact if mode == "exact" else accuracy_math


def make_format(pattern: str = DEFAULT_FORMAT_PATTERN):
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"rewards.format_pattern={pattern!r} is not a valid regex: {e}") from None

    def format_reward(completions: list[str], **_: object) -> list[float]:
        return [float(regex.search(c) is not None) for c in completions]

    return format_reward


def make_overlong(max_length: int | None, buffer: int | None = None):
    """Soft overlong punishment; max_length is the rollout's max_completion_length."""
    if max_length is None or max_length < 1:
        raise ValueError(
            f"the 'overlong' reward needs max_completion_length >= 1, got {max_length!r}"
        )
    buffer = max(1, max_length // 4) if buffer is None else buffer
    if not 1 <= buffer <= max_length:
        raise ValueError(
            f"rewards.overlong_buffer={buffer} must be between 1 and "
            f"max_completion_length={max_length}"
        )
    expected = max_length - buffer

    def overlong(completions: list[str], completion_ids: list[list[int]], **_: object):
        out = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= expected else max(-1.0, (expected - n) / buffer))
        return out

    return overlong


def make_gym_score(task=None):
    """gym_score: the reasoning-gym generator's own score_answer of the completion's final
    answer (grpolab.tasks.gym.final_answer; 0 when it gives none), in [0, 1], partial credit
    as the generator gives it. `task`: the loaded reasoning_gym task (its datasets' scorer),
    else its config or name (each row scored by its own generator's default scorer)."""
    name = getattr(task, "name", task)
    if name is not None and name != "reasoning_gym":
        raise ValueError(
            f"the 'gym_score' reward scores reasoning-gym problems: it needs "
            f"task.name=reasoning_gym, not {name!r}"
        )
    scorer = getattr(task, "score_answer", None) or gym.scorer_by_source()

    def gym_score(completions: list[str], answer: list[str], metadata: list, **columns):
        questions = columns.get("question") or [None] * len(completions)
        out = []
        for completion, ref, meta, question in zip(
            completions, answer, metadata, questions, strict=True
        ):
            row = Example(prompt=question or "", answer=ref,
                          columns={"question": question, "metadata": meta})  # fmt: skip
            out.append(gym.score(scorer, completion, row))
        return out

    return gym_score
