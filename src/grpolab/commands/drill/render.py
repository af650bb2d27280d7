"""Turning reports, goals and hints into the drill's plain-text output (colour on a terminal)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpolab.check import CheckResult
from grpolab.commands.drill import hints as hints_mod
from grpolab.commands.drill.runner import FAIL, PASS, TODO, DrillReport, GoalResult
from grpolab.commands.drill.state import DrillState
from grpolab.commands.drill.texts import check_name, goal_text, msg

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


def _error_line(error: str) -> int | None:
    found = re.search(r"\.py:(\d+):", error)
    return int(found.group(1)) if found else None


def short_error(error: str, path: str | Path) -> str:
    """An error naming the learner's file by its name only."""
    return error.replace(str(path), Path(path).name)


def check_line(r: CheckResult, lang: str, paint: Painter) -> list[str]:
    word = status_word(PASS if r.passed else FAIL, lang, paint)
    lines = [
        f"      {word}  {check_name(r.id, lang)} ({r.id}): {shown(r.measured)}   "
        f"{msg('expected_word', lang)} {r.expected}"
    ]
    if not r.passed and r.error is None:
        lines.append(f"            {r.what}")
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
        lines.append("      " + paint(msg("code_error", lang, error=problem), "red"))
        lines += source_excerpt(path, _error_line(problem))
    for r in gr.checks:
        lines += check_line(r, lang, paint)
        if r.error:
            lines.append("            " + msg("code_error", lang, error=short_error(r.error, path)))
            lines += source_excerpt(path, r.error_line)
    return lines


def report_lines(report: DrillReport, lang: str, paint: Painter) -> list[str]:
    if report.load_error:
        lines = [paint(msg("load_error", lang, error=report.load_error), "red")]
        lines += source_excerpt(report.path, report.load_line)
        return lines
    lines = []
    for gr in report.goals.values():
        lines += goal_lines(gr, report.path, lang, paint)
    if report.extras:
        lines.append(msg("extra_title", lang))
        for r in report.extras:
            lines += check_line(r, lang, paint)
    return [*lines, verdict_line(report.passed, lang, paint)]


def verdict_line(passed: int, lang: str, paint: Painter) -> str:
    if passed == 7:
        return paint(msg("all_pass", lang), "green")
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
            lines.append(
                f"       {check_name(rec.check, lang)} ({rec.check}): {shown(rec.measured)}   "
                f"{msg('expected_word', lang)} {rec.expected}"
            )
        elif state.checked_at is None:
            lines.append(f"       {msg('never_checked', lang)}")
    if state.load_error:
        lines.append(paint(msg("load_error", lang, error=state.load_error), "red"))
    return lines


def hint_lines(goal: int, key: str, level: int, lang: str, paint: Painter) -> list[str]:
    topic = key
    if key.startswith("write."):  # the goal's name: the text before its first colon
        topic = re.split("[:：]", goal_text(goal, lang))[0]
    lines = [paint(msg("hint_header", lang, level=level, goal=goal, topic=topic), "bold")]
    lines += ["  " + line for line in hints_mod.hint_text(key, level, lang).splitlines()]
    if level == hints_mod.LEVELS:
        lines.append(msg("hint_last", lang, goal=goal))
    return lines
