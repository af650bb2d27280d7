"""Turning reports, goals and hints into the drill's plain-text output (colour on a terminal)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpolab.check import CheckResult
from grpolab.commands.drill import hints as hints_mod
from grpolab.commands.drill.check_texts import check_name, check_said
from grpolab.commands.drill.runner import FAIL, PASS, TODO, DrillReport, GoalResult
from grpolab.commands.drill.state import DrillState
from grpolab.commands.drill.texts import goal_text, goal_topic, load_error_text, msg

COLOURS = {"green": "32", "red": "31", "yellow": "33", "bold": "1", "dim": "2"}


@dataclass
class Painter:
    enabled: bool = False

    @classmethod
    def for_stream(cls, stream) -> Painter:
        tty = hasattr(stream, "isatty") and stream.isatty()
        return cls(tty and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb")

    def __call__(self, text: str, colour: str) -> str:
        return f"\033[{COLOURS[colour]}m{text}\033[0m" if self.enabled else text


def shown(value: Any) -> str:
    if isinstance(value, float):
        return "0" if value == 0 else f"{value:.3g}"
    return str(value)


def status_word(status: str, lang: str, paint: Painter) -> str:
    word = msg(f"status_{status}", lang)
    colour = {PASS: "green", FAIL: "red", TODO: "yellow"}[status]
    return paint(word, colour)


def source_excerpt(path: str | Path, line: int | None) -> list[str]:
    """The learner's line, quoted under an error."""
    if not line:
        return []
    try:
        text = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    if not 1 <= line <= len(text):
        return []
    return [f"      {line:>4} | {text[line - 1]}"]


def short_error(error: str, path: str | Path) -> str:
    """An error naming the learner's file by its name only."""
    return error.replace(str(path), Path(path).name)


def measured_text(check_id: str, measured: Any, expected: str | None, lang: str) -> str:
    """ "name (id): measured   expected ...", the check's expectation in `lang`."""
    expected = check_said(check_id, expected, lang)
    return (
        f"{check_name(check_id, lang)} ({check_id}): {shown(measured)}   "
        f"{msg('expected_word', lang)} {expected}"
    )


def check_line(r: CheckResult, lang: str, paint: Painter) -> list[str]:
    word = status_word(PASS if r.passed else FAIL, lang, paint)
    lines = [f"      {word}  {measured_text(r.id, r.measured, r.expected, lang)}"]
    if not r.passed and r.error is None:
        lines.append(f"            {check_said(r.id, r.what, lang)}")
    return lines


def goal_lines(gr: GoalResult, path: str, lang: str, paint: Painter) -> list[str]:
    status = status_word(gr.status, lang, paint)
    lines = [f"{msg('goal_word', lang)} {gr.goal}  {status}  {goal_text(gr.goal, lang)}"]
    if gr.status == TODO:
        if gr.missing:
            lines.append("      " + msg("todo_missing", lang, functions=", ".join(gr.missing)))
        if gr.todo:
            lines.append("      " + msg("todo_functions", lang, functions=", ".join(gr.todo)))
        if gr.not_written_call and not (gr.todo or gr.missing):
            error = short_error(gr.not_written_call, path)
            lines.append("      " + msg("todo_called", lang, error=error))
        return lines
    for problem in gr.problems:
        lines.append("      " + paint(msg("code_error", lang, error=problem.text(lang)), "red"))
        lines += source_excerpt(path, problem.line)
    for r in gr.checks:
        lines += check_line(r, lang, paint)
        if r.error:
            lines.append("            " + msg("code_error", lang, error=short_error(r.error, path)))
            lines += source_excerpt(path, r.error_line)
    return lines


def load_error_line(error: str, lang: str, paint: Painter) -> str:
    return paint(msg("load_error", lang, error=load_error_text(error, lang)), "red")


def report_lines(
    report: DrillReport, lang: str, paint: Painter, shell: Shell | None = None
) -> list[str]:
    """The report, ending with what to do next: in the session (`shell` None), or in the shell
    after `grpolab drill check`."""
    if report.load_error:
        return [
            load_error_line(report.load_error, lang, paint),
            *source_excerpt(report.path, report.load_line),
        ]
    lines = []
    for gr in report.goals.values():
        lines += goal_lines(gr, report.path, lang, paint)
    if report.extras:
        lines.append(msg("extra_title", lang))
        for r in report.extras:
            lines += check_line(r, lang, paint)
    return [*lines, verdict_line(report.passed, lang, paint, shell)]


@dataclass(frozen=True)
class Shell:
    """Where `grpolab drill check` ran: the workspace and the command that trains with it."""

    directory: str
    train_command: str


def verdict_line(passed: int, lang: str, paint: Painter, shell: Shell | None = None) -> str:
    if passed == 7 and shell:
        return paint(msg("all_pass_shell", lang, command=shell.train_command), "green")
    if passed == 7:
        return paint(msg("all_pass", lang), "green")
    if shell:
        return msg("some_pass_shell", lang, passed=passed, dir=shell.directory)
    return msg("some_pass", lang, passed=passed)


def goals_lines(state: DrillState, lang: str, paint: Painter) -> list[str]:
    """`goals`: the seven goals with the status and measured number of the last check."""
    passed = sum(rec.status == PASS for rec in state.goals.values())
    lines = [paint(msg("goals_title", lang, passed=passed), "bold")]
    for goal in range(1, 8):
        rec = state.goals.get(goal)
        status = rec.status if rec else TODO
        lines.append(f"  {goal}. {status_word(status, lang, paint)}  {goal_text(goal, lang)}")
        if rec and rec.check:
            lines.append(f"       {measured_text(rec.check, rec.measured, rec.expected, lang)}")
        elif state.checked_at is None:
            lines.append(f"       {msg('never_checked', lang)}")
    if state.load_error:
        lines.append(load_error_line(state.load_error, lang, paint))
    return lines


def hint_lines(goal: int, key: str, level: int, lang: str, paint: Painter) -> list[str]:
    topic = goal_topic(goal, lang) if key.startswith("write.") else key
    lines = [paint(msg("hint_header", lang, level=level, goal=goal, topic=topic), "bold")]
    lines += ["  " + line for line in hints_mod.hint_text(key, level, lang).splitlines()]
    if level == hints_mod.LEVELS:
        lines.append(msg("hint_last", lang, goal=goal))
    return lines
