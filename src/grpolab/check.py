"""What a check is, declared once: its id, its goal, the likely bug it names on failure, when
it runs, and the known bugs (files in tests/mutants/) it must catch. The units of the
objective (`grpolab.objective`) and the modules of grpolab.checks declare their checks with
`Check`; `grpolab.checks.registry` collects every one in run order, and each id list, hint and
blame is read from there. Imports nothing from grpolab."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The seed's seven goals, one per piece of the algorithm (0: the checks beyond them).
GOALS = {
    1: "log-probs: shifted by one, float32 before log-softmax, temperature applied",
    2: "advantages: the declared std, zero where std ~ 0, contiguous groups, group sums ~ 0",
    3: "ratio: logp_old from an extra forward, exactly 1 before the first update",
    4: "clip: min acts in both directions, eps_low / eps_high on the right sides",
    5: "KL: k3 = exp(d) - d - 1, never negative, tracks the true KL",
    6: "normalisation: the declared aggregation; prompt and padding carry no gradient",
    7: "the assembled loss: finite, honest metrics, a step moves the policy the right way",
}

# Where a check runs. "batch": on a model and a scored batch (`run_checks`, the drill);
# "run": on the whole configured run, in the preflight only (the engine, the task, a float64
# copy of the model); "episodes": on probe episodes of the configured engine's tool turns.
STAGES = ("batch", "run", "episodes")


def always(ctx: Any) -> bool:
    return True


@dataclass(frozen=True)
class Mutant:
    """A known silent bug: tests/mutants/<file>.py, a bug under the objective that `declares`
    the option it gets wrong (objective fields; empty: the seed's)."""

    file: str
    declares: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    """One check: `run(ctx)` measures a number and returns the CheckResult made by
    `ctx.result(...)`; it runs where `when(ctx)` holds (the declared objective, the functions
    under test, the settings). `blame_before`: named ahead of that check when both fail (a
    narrower check the same bug also fails), unless `blame_unless` fails too."""

    id: str  # stable, e.g. "clip.dual_clip"
    goal: int  # 1..7 for the seed's goals, 0 beyond them
    hint: str  # the likely bug, shown on failure
    run: Callable[[Any], CheckResult]
    when: Callable[[Any], bool] = always
    stage: str = "batch"
    mutants: tuple[Mutant, ...] = ()
    blame_before: str | None = None
    blame_unless: str | None = None
    # Runs in the drill only where the learner's objective declares it (the seed's never
    # does) or where grpolab's own machinery around the learner's loss is checked.
    declared_only: bool = False


@dataclass
class CheckResult:
    id: str  # the check's id
    goal: int  # 1..7 for the seven goals, 0 for the checks beyond them
    what: str  # what was measured
    measured: Any  # the number (or a short string)
    expected: str
    passed: bool
    hint: str = ""  # the likely bug, shown on failure
    error: str | None = None  # the exception the implementation raised, if any
    error_line: int | None = None  # its line in the --impl file

    def to_json(self) -> dict:
        measured = self.measured
        if isinstance(measured, float) and not math.isfinite(measured):
            measured = str(measured)
        return {
            "id": self.id,
            "goal": self.goal,
            "what": self.what,
            "measured": measured,
            "expected": self.expected,
            "passed": self.passed,
            "hint": "" if self.passed else self.hint,
            "error": self.error,
            "error_line": self.error_line,
        }


def result_of(check: Check, what: str, measured: Any, expected: str, passed: bool) -> CheckResult:
    """The CheckResult of `check` with what it measured."""
    return CheckResult(check.id, check.goal, what, measured, expected, bool(passed), check.hint)
