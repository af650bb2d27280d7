"""The built-in reward functions, with the TRL signature f(completions, **columns) -> list.

accuracy  1.0 when the completion's answer equals the reference. mode "exact": the stripped
          completion is the answer (the arithmetic task: "85" then EOS); mode "math": the answer
          is extracted (the last \\boxed{...}, else the text after "####", else the last
          expression) and compared with math-verify, so "\\frac{1}{2}" equals "0.5".
format    1.0 when the completion matches a regular expression (re.search, DOTALL).
overlong  DAPO's soft overlong punishment: 0 up to max_length - buffer tokens, then falling
          linearly to -1 at max_length (truncated completions get -1).
"""

from __future__ import annotations

import functools
import re
import threading

ACCURACY_MODES = ("auto", "exact", "math")
DEFAULT_FORMAT_PATTERN = r"\\boxed\{.+\}|####\s*\S+"


def accuracy_exact(completions: list[str], answer: list[str], **_: object) -> list[float]:
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


def accuracy_math(completions: list[str], answer: list[str], **_: object) -> list[float]:
    return [float(math_equal(c, str(a))) for c, a in zip(completions, answer, strict=True)]


def math_equal(completion: str, reference: str) -> bool:
    """Whether the answer in `completion` equals `reference`, by math-verify."""
    if completion.strip() == reference.strip():
        return True
    try:
        from math_verify import parse, verify
    except ImportError as e:  # a dependency of grpolab; missing only in a broken install
        raise ImportError(
            "the 'accuracy' reward in math mode needs math-verify: pip install math-verify"
        ) from e
    gold = _parse_reference(reference)
    if not gold:
        return False
    text = completion
    if "\\boxed" not in text and "####" in text:
        text = text.rsplit("####", 1)[1].replace(",", "")
    # math-verify bounds each parse/compare with SIGALRM, which exists only in the main thread.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    predicted = parse(text, extraction_config=_extraction_config(), parsing_timeout=limit)
    if not predicted:
        return False
    return bool(verify(list(gold), predicted, timeout_seconds=limit))


@functools.lru_cache(maxsize=65536)
def _parse_reference(reference: str) -> tuple:
    from math_verify import parse

    limit = 5 if threading.current_thread() is threading.main_thread() else None
    text = reference.replace(",", "") if _looks_numeric(reference) else reference
    for candidate in (text, f"${text}$"):
        gold = parse(candidate, extraction_config=_extraction_config(), parsing_timeout=limit)
        if gold:
            return tuple(gold)
    return ()


def _looks_numeric(text: str) -> bool:
    return bool(re.fullmatch(r"\s*-?[\d,]*\.?\d+\s*", text))


@functools.cache
def _extraction_config() -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(), ExprExtractionConfig()]


def make_accuracy(mode: str = "auto", task: str | None = None):
    """accuracy in `mode`; "auto" is "exact" for the arithmetic task and "math" otherwise."""
    if mode not in ACCURACY_MODES:
        raise ValueError(f"rewards.accuracy_mode={mode!r} is not one of {list(ACCURACY_MODES)}")
    if mode == "auto":
        mode = "exact" if task == "arithmetic" else "math"
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
