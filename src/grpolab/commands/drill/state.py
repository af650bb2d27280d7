"""Progress kept between drill sessions in DIR/.drill.json: goal statuses with the last
measured numbers, and the hint levels already seen."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from grpolab.commands.drill.runner import DrillReport

STATE_FILE = ".drill.json"


@dataclass
class GoalRecord:
    status: str = "todo"  # pass | fail | todo
    check: str | None = None  # the check quoted
    measured: Any = None
    expected: str | None = None


@dataclass
class DrillState:
    goals: dict[int, GoalRecord] = field(default_factory=dict)
    hints_seen: dict[str, int] = field(default_factory=dict)  # hint key -> levels seen
    passed_ever: list[int] = field(default_factory=list)
    checked_at: float | None = None
    load_error: str | None = None

    def record(self, report: DrillReport) -> None:
        self.load_error = report.load_error
        self.checked_at = time.time()
        for goal, gr in report.goals.items():
            head = gr.headline
            measured = head.measured if head else None
            if isinstance(measured, float) and not math.isfinite(measured):
                measured = str(measured)
            self.goals[goal] = GoalRecord(
                gr.status,
                head.id if head else None,
                measured,
                head.expected if head else None,
            )
            if gr.status == "pass" and goal not in self.passed_ever:
                self.passed_ever = sorted({*self.passed_ever, goal})

    def to_json(self) -> dict:
        data = asdict(self)
        data["goals"] = {str(k): asdict(v) for k, v in self.goals.items()}
        return data


def load_state(directory: str | Path) -> DrillState:
    """The saved progress, or a fresh one (also when the file is unreadable)."""
    path = Path(directory) / STATE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        goals = {int(k): GoalRecord(**v) for k, v in data.get("goals", {}).items()}
        return DrillState(
            goals=goals,
            hints_seen={str(k): int(v) for k, v in data.get("hints_seen", {}).items()},
            passed_ever=[int(g) for g in data.get("passed_ever", [])],
            checked_at=data.get("checked_at"),
            load_error=data.get("load_error"),
        )
    except (OSError, ValueError, TypeError, AttributeError):
        return DrillState()


def save_state(directory: str | Path, state: DrillState) -> None:
    path = Path(directory) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
