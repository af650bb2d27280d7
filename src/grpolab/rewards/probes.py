"""Reward probes: completions written by hand for real task rows, scored by the run's rewards.

A reward that can be gamed is found before training, not after: for each probed row the
probes are

  reference  the reference answer as a model writes it: bare ("85"), in a sentence ("The answer
             is 85."), \\boxed{85}, "#### 85", <answer>85</answer>, and the row's worked solution
             when the task has one (GSM8K's "solution" column)
  wrong      a wrong answer of the task's answer kind written the same ways: a number + 1 for
             numeric references, else another row's answer ("Rome" for "Paris", "C" for "B")
  echo       the prompt echoed back
  restated   each arithmetic expression of the prompt given as the answer: "88 + 22 =",
             "The answer is 88+22", \\boxed{88 + 22}, "#### 88 + 22"
  no_answer  no attempt: the empty completion, "I don't know.", an empty \\boxed{}

and every reward function of the run scores them through `score`, as the trainer does. What a
function can honestly be asked depends on what it rewards:

  every function   no probe of a row scores above the reference's best writing
                   (`reference_findings`)
  answer-checking  a function that scores the reference above the wrong answer on some row:
                   on every row, the wrong answer (`wrong_findings`), the echoed prompt and the
                   restated question (`echo_findings`) score below the reference's best, and
                   no answer scores no more than the wrong answer's best (`no_answer_findings`:
                   a reward that pays inaction teaches a model to stop answering)
  the others       format, length or style rewards, which give a right and a wrong answer the
                   same value on every row: they do not claim to check answers, so only the
                   first demand holds for them
  learned          a reward model (rewards.model) is scored on every probe and its ranking
                   reported (the rows where it prefers the reference to a wrong answer), but
                   held to no demand: a learned preference is not a rule

A probe whose final answer is the reference by the strict check (grpolab.tasks.strict, judging the
task's answer kind: a prompt that ends with its own answer) does answer the row and is left out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

from grpolab.rewards import Rewards, score
from grpolab.tasks.answers import CHOICE_LETTERS
from grpolab.tasks.base import Example, Task
from grpolab.tasks.strict import strict_equal

PROBE_ROWS = 8  # training rows probed, spread over the task's training set
PROBE_KINDS = ("reference", "wrong", "echo", "restated", "no_answer")
DESCRIBED = {
    "reference": "the reference answer",
    "wrong": "a wrong answer",
    "echo": "the prompt echoed",
    "restated": "the question restated as an expression",
    "no_answer": "no answer",
}
NO_ANSWERS = ("", "I don't know.", "\\boxed{}")  # a completion that attempts nothing
# "88 + 22", "37+48", "3 * 4 - 1": numbers joined by arithmetic operators.
_EXPRESSION = re.compile(r"\d+(?:\.\d+)?(?:\s*[-+*/×÷^]\s*\d+(?:\.\d+)?)+")
_OPERATOR = re.compile(r"\s*([-+*/×÷^])\s*")


@dataclass(frozen=True)
class Probe:
    row: int  # position in ProbeReport.rows
    kind: str  # one of PROBE_KINDS
    text: str


@dataclass(frozen=True)
class Finding:
    """One (function, row) where a probe scores what it should not."""

    function: str
    row: int  # the row's index in the task's training set
    prompt: str
    kind: str  # the kind of the probe that scored too high
    probe: str
    value: float
    reference: str  # the best-scoring writing of what it is compared with
    top: float  # its score
    against: str = "reference"  # the probe kind compared with

    def sentence(self) -> str:
        """'reward 'accuracy' gives the question restated as an expression '88 + 22 =' 1, as
        much as the reference '110' (1), on train row 17 ('What is 88 + 22?')'."""
        than = "as much as" if self.value <= self.top else "more than"
        other = "the reference" if self.against == "reference" else DESCRIBED[self.against]
        return (
            f"reward {self.function!r} gives {DESCRIBED[self.kind]} {_short(self.probe)} "
            f"{self.value:g}, {than} {other} {_short(self.reference)} ({self.top:g}), "
            f"on train row {self.row} ({_short(self.prompt)})"
        )


@dataclass
class ProbeReport:
    rows: list[tuple[int, Example]]  # (index in task.train, example)
    probes: list[Probe]
    values: dict[str, list[float | None]]  # function -> its unweighted value per probe
    total: list[float]  # the weighted sum per probe: the reward the trainer trains on
    errors: dict[str, int]  # function -> probes that got the fallback
    not_probed: list[str] = field(default_factory=list)  # needs token ids, no tokenizer given
    error_texts: dict[str, str] = field(default_factory=dict)  # function -> its last failure
    learned: list[str] = field(default_factory=list)  # reward models: reported, no demand

    def ruled(self) -> list[str]:
        """The functions held to the probes' demands: all but the learned ones."""
        return [name for name in self.values if name not in self.learned]

    def answer_checking(self) -> list[str]:
        """The functions that score the reference above the wrong answer on some row."""
        out = []
        for name in self.ruled():
            values = self.values[name]
            for row in range(len(self.rows)):
                top, _ = self._best(values, row, ("reference",))
                wrong, _ = self._best(values, row, ("wrong",))
                if top is not None and wrong is not None and top > wrong + _tol(top, wrong):
                    out.append(name)
                    break
        return out

    def reward_scale(self) -> tuple[float, float] | None:
        """(wrong, right): the mean over rows of the total reward of the best-scoring wrong
        answer and of the best-scoring reference writing. None when the total does not tell
        them apart (then no fraction of "rewarded as right" can be read from the reward), or
        when a learned reward is part of it (its scale on the probes is no rule)."""
        if self.learned:
            return None
        total = list(self.total)
        pairs = [
            (self._best(total, row, ("wrong",))[0], self._best(total, row, ("reference",))[0])
            for row in range(len(self.rows))
        ]
        pairs = [(w, r) for w, r in pairs if w is not None and r is not None]
        if not pairs:
            return None
        wrong = sum(w for w, _ in pairs) / len(pairs)
        right = sum(r for _, r in pairs) / len(pairs)
        return (wrong, right) if right > wrong + _tol(right, wrong) else None

    def preferences(self, name: str) -> tuple[int, int]:
        """(rows where `name` scores the reference's best writing above every wrong answer,
        rows with both): how a learned reward ranks what the probes know."""
        values, right, rows = self.values[name], 0, 0
        for row in range(len(self.rows)):
            top, _ = self._best(values, row, ("reference",))
            wrong, _ = self._best(values, row, ("wrong",))
            if top is not None and wrong is not None:
                rows += 1
                right += top > wrong + _tol(top, wrong)
        return right, rows

    def _best(self, values, row: int, kinds: tuple[str, ...]) -> tuple[float | None, int | None]:
        """The highest value among the row's probes of `kinds`, and that probe's position."""
        best, at = None, None
        for i, p in enumerate(self.probes):
            v = values[i]
            if p.row == row and p.kind in kinds and v is not None and (best is None or v > best):
                best, at = v, i
        return best, at

    def _findings(
        self, names: Sequence[str], kinds: tuple[str, ...], strict: bool, against="reference"
    ):
        """Per (function, row): the worst probe of `kinds` scoring at least the best probe of
        `against` (strict=True) or more than it (strict=False)."""
        found = []
        for name in names:
            values = self.values[name]
            for row, (index, example) in enumerate(self.rows):
                top, top_at = self._best(values, row, (against,))
                worst, worst_at = self._best(values, row, kinds)
                if top is None or worst is None:
                    continue
                tol = _tol(top, worst)
                if worst >= top - tol if strict else worst > top + tol:
                    p, best = self.probes[worst_at], self.probes[top_at].text
                    found.append(
                        Finding(
                            name, index, example.prompt, p.kind, p.text, worst, best, top, against
                        )
                    )
        return found


def reference_findings(report: ProbeReport) -> list[Finding]:
    """Every function: a probe of a row that scores above the reference's best writing."""
    return report._findings(report.ruled(), ("wrong", "echo", "restated"), strict=False)


def wrong_findings(report: ProbeReport) -> list[Finding]:
    """Answer-checking functions: a wrong answer that scores as much as the reference."""
    return report._findings(report.answer_checking(), ("wrong",), strict=True)


def echo_findings(report: ProbeReport) -> list[Finding]:
    """Answer-checking functions: the prompt echoed or restated that scores as much as the
    reference."""
    return report._findings(report.answer_checking(), ("echo", "restated"), strict=True)


def no_answer_findings(report: ProbeReport) -> list[Finding]:
    """Answer-checking functions: no answer (the empty completion, "I don't know.") that
    scores more than the wrong answer's best writing (TRL PR #6427: a default reward of 0
    above a wrong answer's -1 taught a model inaction)."""
    return report._findings(report.answer_checking(), ("no_answer",), strict=False, against="wrong")


def probe_rows(task: Task, n: int = PROBE_ROWS) -> list[tuple[int, Example]]:
    """n training rows spread evenly over the task's training set (all of a smaller one)."""
    size = len(task.train)
    if size <= n:
        indices = list(range(size))
    else:
        indices = sorted({round(i * (size - 1) / (n - 1)) for i in range(n)})
    return [(i, task.train[i]) for i in indices]


def build_probes(
    rows: Sequence[tuple[int, Example]], kind: str = "number", judge=None
) -> list[Probe]:
    """Every probe of `rows`, for answers of `kind` (the task's answer kind); judge: the
    task's own strict judge (Task.strict_judge), which then decides which probes answer."""
    answers = [example.answer for _, example in rows]
    probes = []
    for row, (_, example) in enumerate(rows):
        solution = example.columns.get("solution")
        for text in writings(example.answer, solution if isinstance(solution, str) else None):
            probes.append(Probe(row, "reference", text))
        wrong = wrong_answer(example.answer, answers[row + 1 :] + answers[:row], kind)
        if wrong is not None:
            wrong_solution = None
            if isinstance(solution, str) and "####" in solution:
                wrong_solution = solution.rsplit("####", 1)[0] + f"#### {wrong}"
            for text in writings(wrong, wrong_solution):
                probes.append(Probe(row, "wrong", text))
        probes.append(Probe(row, "echo", example.prompt))
        for expression in _EXPRESSION.findall(example.prompt)[-2:]:
            spaced = _OPERATOR.sub(r" \1 ", expression)
            compact = _OPERATOR.sub(r"\1", expression)
            for text in (
                f"{spaced} =",
                f"The answer is {compact}",
                f"\\boxed{{{spaced}}}",
                f"#### {spaced}",
            ):
                probes.append(Probe(row, "restated", text))
        probes += [Probe(row, "no_answer", text) for text in NO_ANSWERS]

    # A probe that does answer its row by the strict check is not a wrong one.
    def answers(p: Probe) -> bool:
        example = rows[p.row][1]
        if judge is not None:
            return bool(judge(p.text, example))
        return strict_equal(p.text, example.answer, kind)

    return [p for p in probes if p.kind == "reference" or not answers(p)]


def writings(answer: str, solution: str | None = None) -> list[str]:
    """An answer as models write it."""
    out = [
        answer,
        f"The answer is {answer}.",
        f"\\boxed{{{answer}}}",
        f"#### {answer}",
        f"<answer>{answer}</answer>",
    ]
    return out + ([solution] if solution else [])


def wrong_answer(answer: str, others: Sequence[str], kind: str = "number") -> str | None:
    """A wrong answer to a row, of the task's answer kind: a number one further from 0 for a
    numeric reference (number and math), else the first of `others` (the other rows'
    answers) that the strict check tells apart from it; a choice row whose others all
    share its letter gets the next letter."""
    if kind in ("number", "math"):
        try:
            value = Decimal(answer.replace(",", "").strip())
        except InvalidOperation:
            value = None
        if value is not None and value.is_finite():
            return str(value - 1 if value < 0 else value + 1)
    other = next((a for a in others if not strict_equal(a, answer, kind)), None)
    if other is None and kind == "choice":
        return next(c for c in CHOICE_LETTERS if not strict_equal(c, answer, kind))
    return other


def run_probes(
    rows: Sequence[tuple[int, Example]],
    rewards: Rewards,
    tokenizer=None,
    kind: str = "number",
    judge=None,
) -> ProbeReport:
    """Score every probe of `rows` with `rewards` through `score`, as the trainer does.
    tokenizer: for the token ids of rewards that need them ('overlong'); without one those
    functions are not probed. kind: the task's answer kind (Task.answer_kind); judge: the
    task's own strict judge (Task.strict_judge), if any."""
    rows = list(rows)
    probes = build_probes(rows, kind, judge)
    texts = [p.text for p in probes]
    ids = None
    if tokenizer is not None:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + eos for t in texts]
    not_probed = [] if ids is not None else [fn.name for fn in rewards if fn.needs_token_ids]
    probed = Rewards(fn for fn in rewards if fn.name not in not_probed)
    if not probed or not probes:
        return ProbeReport(rows, probes, {}, [0.0] * len(probes), {}, not_probed)
    result = score(
        texts, [rows[p.row][1] for p in probes], probed, num_generations=1, completion_ids=ids
    )
    values = {
        name: [None if v != v else float(v) for v in t.tolist()]  # NaN: not applicable
        for name, t in result.per_function.items()
    }
    return ProbeReport(
        rows,
        probes,
        values,
        result.total.tolist(),
        result.errors,
        not_probed,
        result.error_texts,
        learned=[fn.name for fn in probed if fn.learned],
    )


def probe_task(task: Task, rewards: Rewards, tokenizer=None) -> ProbeReport:
    """The probes of `task`'s rows, of its answer kind, scored by `rewards`."""
    return run_probes(probe_rows(task), rewards, tokenizer, task.answer_kind, task.strict_judge)


def reward_scale(task: Task, rewards: Rewards, tokenizer=None) -> tuple[float, float] | None:
    """(wrong, right) of the run's total reward on the probes of `task` (ProbeReport); None
    for a task without reference answers (no probe can be written)."""
    if not task.has_references:
        return None
    return probe_task(task, rewards, tokenizer).reward_scale()


def _tol(a: float, b: float) -> float:
    # Rewards are float32 sums of a few weighted terms: equal values differ by rounding only.
    return 1e-6 * max(1.0, abs(a), abs(b))


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= width else text[: width - 3] + "...")
