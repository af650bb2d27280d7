"""The drill: write GRPO's core yourself, check every intermediate quantity, then train with it.

`grpolab drill init DIR` writes the workspace, `grpolab drill [DIR]` is the interactive
session (goals, check, hint, show, train), `grpolab drill check DIR` the same checks for
scripts. Texts in English and Chinese.
"""

from grpolab.commands.drill.runner import DrillReport, GoalResult, Workbench
from grpolab.commands.drill.template import init_workspace

__all__ = ["DrillReport", "GoalResult", "Workbench", "init_workspace"]
