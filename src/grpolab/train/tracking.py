"""Where metrics go: metrics.jsonl (always), a compact console line, TensorBoard when
installed, W&B / trackio when asked; sample completions to completions.jsonl."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# The console line: (metric, label, format).
CONSOLE_FIELDS = (
    ("reward/mean", "reward", ".3f"),
    ("accuracy", "acc", ".2f"),
    ("strict_accuracy", "strict", ".2f"),
    ("frac_reward_zero_std", "zero_std", ".2f"),
    ("completion_length/mean", "len", ".1f"),
    ("loss", "loss", ".4f"),
    ("kl", "kl", ".4f"),
    ("clip_frac", "clip", ".3f"),
    ("grad_norm", "gnorm", ".3f"),
    ("time/step", "s/step", ".2f"),
)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL file; lines that are not a JSON object (a write cut short by a
    crash or a full disk) are skipped: `read_jsonl_counting` says how many."""
    return read_jsonl_counting(path)[0]


def read_jsonl_counting(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """(records, number of unreadable lines skipped)."""
    path = Path(path)
    if not path.is_file():
        return [], 0
    rows, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def truncate_jsonl(path: Path, after_step: int) -> int:
    """Drop records of steps after `after_step` (a resumed run rewrites them) and unreadable
    lines; returns how many unreadable lines were dropped."""
    rows, bad = read_jsonl_counting(path)
    rows = [r for r in rows if r.get("step", 0) <= after_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return bad


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


class Tracker:
    def __init__(
        self,
        output_dir: Path,
        report_to: list[str],
        config: dict[str, Any],
        console: Console,
        resume_step: int = 0,
    ):
        self.output_dir = output_dir
        self.console = console
        self.metrics_path = output_dir / "metrics.jsonl"
        self.completions_path = output_dir / "completions.jsonl"
        for path in (self.metrics_path, self.completions_path):
            if resume_step and path.exists():
                dropped = truncate_jsonl(path, resume_step)
                if dropped:
                    console.print(
                        f"[yellow]warning:[/yellow] {path}: dropped {dropped} unreadable "
                        "line(s) (a write cut short)"
                    )
            elif not resume_step:
                path.write_text("")
        self.sinks: list[Any] = []
        self._tb = None
        self._wandb = None
        self._trackio = None
        if "tensorboard" in report_to:
            self._tb = _tensorboard(output_dir / "tensorboard", console)
        if "wandb" in report_to:
            wandb = _require("wandb")
            self._wandb = wandb.init(
                project="grpolab", name=output_dir.name, config=config, dir=str(output_dir)
            )
        if "trackio" in report_to:
            trackio = _require("trackio")
            self._trackio = trackio
            trackio.init(project="grpolab", name=output_dir.name, config=config)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._trackio is not None:
            self._trackio.log(numeric, step=step)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        with open(self.completions_path, "a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def console_line(self, step: int, max_steps: int, metrics: dict[str, Any]) -> str:
        parts = [f"step {step}/{max_steps}"]
        for key, label, fmt in CONSOLE_FIELDS:
            if key in metrics:
                parts.append(f"{label} {metrics[key]:{fmt}}")
        failed = {k.partition("/")[2]: v for k, v in metrics.items()
                  if k.startswith("reward_errors/") and v}  # fmt: skip
        if failed:  # samples that got the fallback reward, per function
            listed = ", ".join(f"{name} {n:g}" for name, n in failed.items())
            parts.append(f"[red]reward errors: {escape(listed)}[/red]")
        if metrics.get("skipped"):
            parts.append("[red]SKIPPED (non-finite)[/red]")
        return "  ".join(parts)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._trackio is not None:
            self._trackio.finish()


# The trackers logging.report_to may name that a run cannot go without (TensorBoard is
# optional: a run without it says so and goes on).
REQUIRED_TRACKERS = ("wandb", "trackio")


def check_trackers(report_to: list[str]) -> None:
    """At start, without importing them: each required tracker named is installed."""
    import importlib.util

    for name in report_to:
        if name in REQUIRED_TRACKERS and importlib.util.find_spec(name) is None:
            raise _missing(name)


def _missing(name: str) -> ValueError:
    return ValueError(
        f"logging.report_to lists {name!r} but {name} is not installed (pip install {name})"
    )


def _require(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise _missing(name) from None


def _tensorboard(logdir: Path, console: Console):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        console.print("[yellow]tensorboard is not installed; skipping it (pip install tensorboard)")
        return None
    return SummaryWriter(str(logdir))


def progress_bar(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]GRPO"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )
