"""The interactive drill: a line-oriented loop (a terminal or a pipe) that re-checks
my_grpo.py whenever it changes, like a watch mode."""

from __future__ import annotations

import json
import os
import select
import shlex
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from grpolab.commands.drill import hints as hints_mod
from grpolab.commands.drill import render
from grpolab.commands.drill.runner import (
    GOAL_FUNCTIONS,
    PASS,
    DrillReport,
    Workbench,
    written_functions,
)
from grpolab.commands.drill.show import show_goal
from grpolab.commands.drill.state import STATE_FILE, DrillState, load_state, save_state
from grpolab.commands.drill.template import IMPL_FILE, RUN_DIR, train_args
from grpolab.commands.drill.texts import msg
from grpolab.functions import ImplLoadError, impl_error_line, load_impl

PROMPT = "drill> "


def file_signature(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def read_lines(fd: int, on_idle: Callable[[], None], poll_s: float = 1.0) -> Iterator[str]:
    """Lines from `fd` until EOF; `on_idle` runs whenever no input came for `poll_s`."""
    buffer = b""
    while True:
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line.decode("utf-8", errors="replace").rstrip("\r")
        ready, _, _ = select.select([fd], [], [], poll_s)
        if not ready:
            on_idle()
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            if buffer.strip():
                yield buffer.decode("utf-8", errors="replace")
            return
        buffer += chunk


def parse_goal(arg: str) -> int | None:
    try:
        goal = int(arg)
    except ValueError:
        return None
    return goal if goal in GOAL_FUNCTIONS else None


@dataclass
class Session:
    directory: Path
    lang: str
    out: TextIO = field(default_factory=lambda: sys.stdout)
    echo: bool = False  # repeat each command after the prompt (input that is not a terminal)
    bench: Workbench = field(default_factory=Workbench)
    state: DrillState = field(default_factory=DrillState)
    # The hint levels seen in this session, by hint key: every session starts at hint 1, or
    # with --continue at the levels the state kept from earlier sessions.
    hint_levels: dict[str, int] = field(default_factory=dict)
    report: DrillReport | None = None
    checked: tuple[int, int] | None = None  # the file signature of the last check
    paint: render.Painter = field(default_factory=render.Painter)

    @property
    def impl_path(self) -> Path:
        return self.directory / IMPL_FILE

    def say(self, *lines: str) -> None:
        for line in lines:
            print(line, file=self.out)
        self.out.flush()

    def prompt(self) -> None:
        self.out.write(PROMPT)
        self.out.flush()

    # --- Commands -------------------------------------------------------------------------

    def check(self, auto: bool = False) -> DrillReport:
        name = self.impl_path.name
        self.say(msg("changed" if auto else "checking", self.lang, path=name))
        self.checked = file_signature(self.impl_path)
        self.report = self.bench.check(self.impl_path)
        self.state.record(self.report)
        save_state(self.directory, self.state)
        self.say(*render.report_lines(self.report, self.lang, self.paint))
        return self.report

    def watch(self) -> bool:
        """Re-check when my_grpo.py changed since the last check; True when it did."""
        if file_signature(self.impl_path) == self.checked:
            return False
        self.check(auto=True)
        return True

    def goals(self) -> None:
        self.say(*render.goals_lines(self.state, self.lang, self.paint))

    def hint(self, arg: str | None) -> None:
        report = self.report
        if report and report.load_error:  # nothing else can be checked before the file loads
            self.say(*render.report_lines(report, self.lang, self.paint))
            return
        if arg:
            goal = parse_goal(arg)
            if goal is None:
                self.say(msg("bad_goal", self.lang, arg=arg))
                return
        else:
            failing = [g for g, gr in report.goals.items() if gr.status != PASS] if report else [1]
            if not failing:
                self.say(msg("hint_all_pass", self.lang))
                return
            goal = failing[0]
        gr = report.goals[goal] if report else None
        key = gr.hint_key if gr and gr.hint_key else f"write.{goal}"
        if gr and gr.status == PASS:
            self.say(msg("hint_passing", self.lang, goal=goal))
        level = hints_mod.next_level(self.hint_levels.get(key, 0))
        self.hint_levels[key] = level
        self.state.hints_seen[key] = max(level, self.state.hints_seen.get(key, 0))
        save_state(self.directory, self.state)
        self.say(*render.hint_lines(goal, key, level, self.lang, self.paint))

    def show(self, arg: str | None) -> None:
        goal = parse_goal(arg) if arg else None
        if goal is None:
            self.say(msg("show_needs_goal", self.lang))
            return
        try:
            impl = load_impl(self.impl_path)
        except ImplLoadError as err:
            error = render.short_error(str(err), self.impl_path)
            self.say(render.load_error_line(error, self.lang, self.paint))
            self.say(*render.source_excerpt(self.impl_path, err.line))
            return
        written = written_functions(self.impl_path.read_text(encoding="utf-8"), impl)
        todo = written.todo(GOAL_FUNCTIONS[goal])
        if todo:
            self.say(msg("show_todo", self.lang, goal=goal, functions=", ".join(todo)))
            return
        self.bench.ensure()
        b = self.bench
        impl = b.functions(impl)
        self.say(*show_goal(goal, impl, b.model, b.tokenizer, b.batch, b.settings, self.lang))

    def train(self, overrides: list[str]) -> None:
        self.watch()
        passed = self.report.passed if self.report else 0
        if passed != len(GOAL_FUNCTIONS):
            self.say(msg("train_locked", self.lang, passed=passed))
            return
        run_dir = self.directory / RUN_DIR
        args = train_args(self.directory, overrides)
        self.say(msg("train_start", self.lang, path=self.impl_path.name, args=shlex.join(args)))
        summary_path = run_dir / "summary.json"
        summary_path.unlink(missing_ok=True)
        width = shutil.get_terminal_size((120, 24)).columns
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": str(max(width, 100))}
        proc = subprocess.Popen(
            [sys.executable, "-m", "grpolab", "train", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="replace",
            env=env,
        )
        for line in quiet_config(proc.stdout, run_dir / "config.yaml", self.lang):
            self.say(line)
        code = proc.wait()
        if code != 0 or not summary_path.is_file():
            self.say(msg("train_failed", self.lang, code=code))
            return
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        self.say(self.paint(train_result(summary, run_dir, self.lang), "bold"))

    def help(self) -> None:
        self.say(msg("help", self.lang))

    # --- The loop ---------------------------------------------------------------------------

    def handle(self, line: str) -> bool:
        """Run one command line; False when the session should end."""
        words = line.split()
        if not words:
            return True
        cmd, rest = words[0].lower(), words[1:]
        if cmd in ("quit", "exit", "q"):
            return False
        if cmd not in ("check", "help", "hint"):
            self.watch()
        commands: dict[str, Callable[[], None]] = {
            "check": lambda: self.check(),
            "goals": self.goals,
            "hint": lambda: self.hint(rest[0] if rest else None),
            "show": lambda: self.show(rest[0] if rest else None),
            "train": lambda: self.train(rest),
            "help": self.help,
        }
        if cmd not in commands:
            self.say(msg("unknown_command", self.lang, cmd=cmd))
            return True
        try:
            commands[cmd]()
        except KeyboardInterrupt:  # Ctrl-C stops the command, not the session
            self.say("", msg("interrupted", self.lang))
        except Exception as err:  # the learner's code or the machine: never end the session
            self.say(*self.error_lines(err))
        return True

    def error_lines(self, err: BaseException) -> list[str]:
        line = impl_error_line(err, self.impl_path)
        if line is not None:
            error = f"{self.impl_path.name}:{line}: {type(err).__name__}: {err}"
            return [
                self.paint(msg("code_error", self.lang, error=error), "red"),
                *render.source_excerpt(self.impl_path, line),
            ]
        last = traceback.extract_tb(err.__traceback__)[-1:] or None
        where = f" ({Path(last[0].filename).name}:{last[0].lineno})" if last else ""
        return [msg("internal_error", self.lang, error=f"{type(err).__name__}: {err}{where}")]

    def start(self) -> None:
        self.say(msg("banner", self.lang, path=self.impl_path))
        try:
            self.check()
        except Exception as err:
            self.say(*self.error_lines(err))
        self.prompt()

    def on_idle(self) -> None:
        try:
            changed = self.watch()
        except Exception as err:
            self.say(*self.error_lines(err))
            changed = True
        if changed:
            self.prompt()


def quiet_config(lines: Iterator[str], config_path: Path, lang: str) -> Iterator[str]:
    """The trainer's output with its config line in the drill's words (the values that
    differ from the defaults follow it; config.yaml holds every value)."""
    for line in lines:
        line = line.rstrip("\n")
        if line.startswith("config: the defaults"):
            yield msg("resolved_config", lang, path=config_path)
        else:
            yield line


def train_result(summary: dict, run_dir: Path, lang: str) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}%"

    gain = summary.get("accuracy_gain")
    return msg(
        "train_done",
        lang,
        before=pct(summary.get("accuracy_before")),
        after=pct(summary.get("accuracy_after")),
        steps=summary.get("steps"),
        gain="-" if gain is None else msg("gain_points", lang, gain=gain),
        run_dir=run_dir,
    )


def run_session(
    directory: Path, lang: str, stdin: TextIO | None = None, continue_hints: bool = False
) -> int:
    """The interactive drill until `quit` or the end of the input; with `continue_hints` the
    hints go on from the levels earlier sessions reached."""
    stdin = stdin or sys.stdin
    state = load_state(directory)
    session = Session(
        directory=directory,
        lang=lang,
        echo=not stdin.isatty(),
        state=state,
        hint_levels=dict(state.hints_seen) if continue_hints else {},
        paint=render.Painter.for_stream(sys.stdout),
    )
    session.bench.on_load = lambda: session.say(msg("loading", lang))
    if continue_hints:
        session.say(msg("hints_continued", lang))
    session.start()
    try:
        for line in read_lines(stdin.fileno(), session.on_idle):
            if session.echo:
                session.say(line)
            if not session.handle(line):
                break
            session.prompt()
        else:
            session.say("")
    except KeyboardInterrupt:
        session.say("")
    save_state(directory, session.state)
    session.say(msg("bye", lang, path=directory / STATE_FILE))
    return 0
