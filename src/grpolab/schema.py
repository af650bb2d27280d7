"""Declared constraints of config keys. A dataclass field made by `key` carries the values it
may take (`choices`) or a test of them with the expectation in words (`check`, `expected`);
`check_fields` applies every one, naming the key. Every config section and every unit of the
objective declares its keys this way: one generic check instead of a hand-written line per
key. Imports nothing from grpolab."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any


class SchemaError(ValueError):
    """A key's value outside what its field declares: "key=value: expected ...", one line."""

    def __init__(self, key: str, value: Any, expected: str):
        super().__init__(f"{key}={value!r}: expected {expected}")
        self.key, self.value, self.expected = key, value, expected


def key(
    default: Any = dataclasses.MISSING,
    *,
    choices: Iterable[Any] | Callable[[], Iterable[Any]] | None = None,
    check: Callable[[Any], bool] | None = None,
    expected: str = "",
    default_factory: Any = dataclasses.MISSING,
    legacy: str | None = None,
    resume_free: bool = False,
) -> Any:
    """A dataclass field whose value `check_fields` holds to `choices` (an iterable, or a
    function returning one where a registry decides them) or to `check` (`expected` says what
    it accepts, in words). `legacy`: the dotted name the key had before its section (the
    config reads it as an alias). `resume_free`: a resumed run may change it (it decides how
    the same maths is computed, or what is logged and kept, never what a step computes)."""
    metadata: dict[str, Any] = {"resume_free": resume_free}
    if choices is not None:
        metadata["choices"] = choices if callable(choices) else tuple(choices)
    if check is not None:
        metadata["check"] = (check, expected)
    if legacy is not None:
        metadata["legacy"] = legacy
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def choices_of(field: dataclasses.Field) -> tuple[Any, ...] | None:
    """The values a field declares it may take (None: any of its type)."""
    choices = field.metadata.get("choices")
    return tuple(choices()) if callable(choices) else choices


def check_fields(obj: Any, prefix: str = "") -> None:
    """Every declared constraint of `obj`'s fields, and of the dataclasses it holds, depth
    first; SchemaError names the first key broken (`prefix` + its dotted name)."""
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_fields(value, f"{prefix}{field.name}.")
            continue
        choices = choices_of(field)
        if choices is not None and value not in choices:
            raise SchemaError(prefix + field.name, value, f"one of {list(choices)}")
        test = field.metadata.get("check")
        if test is not None and not test[0](value):
            raise SchemaError(prefix + field.name, value, test[1])


# The tests most keys need, with their words.
def at_least(bound: float) -> dict[str, Any]:
    return {"check": lambda v: v >= bound, "expected": f"a number >= {bound:g}"}


def above(bound: float) -> dict[str, Any]:
    return {"check": lambda v: v > bound, "expected": f"a number > {bound:g}"}


def above_or_off(bound: float, example: str = "") -> dict[str, Any]:
    """None (the option off) or a number > bound."""
    return {
        "check": lambda v: v is None or v > bound,
        "expected": f"a number > {bound:g}{example}, or null (off)",
    }


def fraction() -> dict[str, Any]:
    return {"check": lambda v: 0 <= v <= 1, "expected": "a fraction in [0, 1]"}


def finite_in(low: float, high: float | None = None) -> dict[str, Any]:
    """A finite number in [low, high) (high None: no upper bound)."""
    if high is None:
        return {
            "check": lambda v: math.isfinite(v) and v >= low,
            "expected": f"a number >= {low:g}",
        }
    return {
        "check": lambda v: math.isfinite(v) and low <= v < high,
        "expected": f"a number in [{low:g}, {high:g})",
    }


@dataclasses.dataclass(frozen=True)
class Inert:
    """Keys without effect: `keys` (dotted) do nothing where `when(cfg)` holds, which the keys
    `causes` decide; `why` (formatted with the config as c) says why, after "has no effect".
    The config refuses such a key when it is given, or lets it yield to a later layer's
    choice (grpolab.config.inert)."""

    keys: tuple[str, ...]
    causes: tuple[str, ...]
    when: Callable[[Any], bool]
    why: str
