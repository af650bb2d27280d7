"""The run directory: one run at a time, what a run writes there, checked before anything is
written.

A run holds `RunLock` on its directory for its whole life, so a second command on the same
directory stops at once instead of interleaving its logs and checkpoints with the first's.
A command that fails must leave the directory as it found it, so `check_output_dir` only
looks, and `prepare_output_dir` (which deletes a replaced run and creates the directory)
runs once everything else has been checked. A directory whose run never reached a
checkpoint (it failed or was killed in its first steps) holds nothing to resume: the same
command starts over in it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from grpolab.train.checkpoint import CHECKPOINT_RE, COMPLETE
from grpolab.ways import way

RUN_FILES = (
    "config.yaml",
    "objective.txt",
    "preflight.json",
    "metrics.jsonl",
    "completions.jsonl",
    "summary.json",
)
# What `grpolab report` writes into a run directory (its figures are the *.png files).
REPORT_FILES = ("report.md", "report.html")
REPORT_FIGURES = "*.png"
# What else a run may leave: TensorBoard's logs, the non-finite guard's replay capsule.
RUN_EXTRAS = ("tensorboard", "nonfinite-capsule.pt")
LOCK_FILE = ".grpolab-lock"
# Left by a save or a prune cut short (a kill, a full disk): never part of a run's state.
LEFTOVER_PREFIXES = (".tmp-checkpoint-", ".old-checkpoint-", ".deleting-checkpoint-")


class OutputDirError(ValueError):
    """output_dir cannot hold this run; the message names it and what to do."""


def holds_run(output_dir: Path) -> bool:
    """A run that can be resumed or was finished: a complete checkpoint or a summary."""
    return output_dir.is_dir() and (
        (output_dir / "summary.json").exists()
        or any(
            CHECKPOINT_RE.match(p.name) and (p / COMPLETE).is_file() for p in output_dir.iterdir()
        )
    )


def unfinished_start(output_dir: Path) -> list[str]:
    """The files of a run that never reached a checkpoint (it failed or was killed in its
    first steps): nothing in them can be resumed, so the same command starts over."""
    if not output_dir.is_dir() or holds_run(output_dir):
        return []
    return sorted(f for f in (*RUN_FILES, *RUN_EXTRAS) if (output_dir / f).exists())


def claim_output_dir(output_dir: Path, resume: bool, overwrite: bool) -> RunLock:
    """Check that the run may use `output_dir` and take its lock (RunLock, released by the
    caller when the run ends). Raises OutputDirError (RunDirectoryBusy: another run holds
    it; FileExistsError: it holds a finished or resumable run) and then leaves the directory
    as it was."""
    check_output_dir(output_dir, resume, overwrite)
    try:
        lock = RunLock(output_dir).acquire()
    except OSError as e:  # not creatable after all (a read-only or special file system)
        raise OutputDirError(
            f"output_dir={str(output_dir)!r} cannot be written: {e.strerror or e}"
        ) from None
    try:
        check_run_in(output_dir, resume, overwrite)
    except BaseException:
        lock.release()
        raise
    return lock


def check_output_dir(output_dir: Path, resume: bool, overwrite: bool) -> None:
    """Raise OutputDirError unless `output_dir` can be a run directory at all (the flags
    agree, it is a directory or can be created and written); writes nothing."""
    where = f"output_dir={str(output_dir)!r}"
    if resume and overwrite:
        raise OutputDirError(
            f"{way('resume')} and {way('overwrite')} contradict each other: {way('resume')} "
            f"continues the run in {where}, {way('overwrite')} deletes it and starts over; pass "
            "one of them"
        )
    if output_dir.exists() and not output_dir.is_dir():
        raise OutputDirError(f"{where} is a file, not a directory")
    if resume and not output_dir.is_dir():
        raise OutputDirError(f"{way('resume')}: {where} does not exist (no run to continue)")
    existing = output_dir
    while not existing.exists():  # the nearest existing ancestor must let us create the rest
        existing = existing.parent
    if not existing.is_dir():
        raise OutputDirError(f"{where} cannot be created: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputDirError(f"{where} cannot be written: no write permission on {existing}")


def check_run_in(output_dir: Path, resume: bool, overwrite: bool) -> None:
    """What `output_dir` holds allows this start: a finished or resumable run only with
    resume or overwrite; a resume only of a run that reached a checkpoint."""
    where = f"output_dir={str(output_dir)!r}"
    if resume and unfinished_start(output_dir):
        raise OutputDirError(
            f"{way('resume')}: the run in {where} stopped before its first checkpoint, so there "
            f"is nothing to resume; the same command without {way('resume')} starts it over"
        )
    if holds_run(output_dir) and not resume and not overwrite:
        raise FileExistsError(
            f"{where} holds another run; pass {way('resume')} to continue it, "
            f"{way('overwrite')} to replace it, or choose another output_dir"
        )


def written_by_a_run(p: Path) -> bool:
    """Whether `p`, in a run directory, is something a run or its report wrote."""
    return (
        p.name in (*RUN_FILES, *REPORT_FILES, *RUN_EXTRAS)
        or p.match(REPORT_FIGURES)
        or p.name.startswith(("checkpoint-", "damaged-checkpoint-"))
    )


def prepare_output_dir(output_dir: Path, resume: bool, overwrite: bool) -> list[str]:
    """Create `output_dir`; with overwrite (not resume) delete everything the run it holds
    wrote, its report included; a start that never reached a checkpoint is replaced the same
    way. Removes what an interrupted save or prune left behind. Returns a line for the log
    about each removal the user did not ask for."""
    notes = []
    unfinished = [] if resume else unfinished_start(output_dir)
    if unfinished and not overwrite:
        notes.append(
            f"replaced the files of a run that stopped before its first checkpoint "
            f"({', '.join(unfinished)})"
        )
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            replaced = (overwrite or bool(unfinished)) and not resume and written_by_a_run(p)
            if not replaced and p.name.startswith(".old-checkpoint-"):
                # Killed between the two renames of a same-step re-save: this is the last
                # complete copy of that step, so it goes back in place.
                final = p.with_name(p.name.removeprefix(".old-"))
                if not final.exists():
                    os.replace(p, final)
                    continue
            if replaced or p.name.startswith(LEFTOVER_PREFIXES):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                if not replaced:
                    notes.append(f"removed {p.name} (left by a save cut short)")
    output_dir.mkdir(parents=True, exist_ok=True)
    return notes


# --- One run per directory -----------------------------------------------------------------------


class RunDirectoryBusy(OutputDirError):
    """Another live run holds the directory's lock; the message names it."""


class RunLock:
    """An exclusive lock on a run directory for the life of one run: a file holding who took
    it (pid, host, start time, command) under an advisory `flock`, which the kernel releases
    when the process ends however it ends, so a lock left by a killed run is seen as stale
    and taken over. `acquire` creates the directory when it is missing and `release` removes
    what `acquire` created (the lock file, and the directory while still empty), so a start
    that fails leaves the directory as it was."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / LOCK_FILE
        self.fd: int | None = None
        self.created_dir = False
        self.stale_note = ""  # whose stale lock was taken over, for the log

    def acquire(self) -> RunLock:
        """Take the lock, or raise RunDirectoryBusy naming the live holder; touches nothing
        when the directory is held."""
        directory = self.path.parent
        if not directory.is_dir():
            directory.mkdir(parents=True)
            self.created_dir = True
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise RunDirectoryBusy(self.busy_message()) from None
            if not self._same_file(fd):  # released and removed meanwhile: take the new one
                os.close(fd)
                continue
            self.fd = fd
        previous = self._read()
        if previous:
            self.stale_note = (
                f"took over the lock of a run that is no longer running ({describe(previous)})"
            )
        self._write(holder())
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # before the unlock: no one locks a removed file
        finally:
            os.close(self.fd)
            self.fd = None
        if self.created_dir:
            with contextlib.suppress(OSError):  # only while nothing else was written
                self.path.parent.rmdir()

    def busy_message(self) -> str:
        who = self._read()
        by = describe(who) if who else "another process"
        return (
            f"output_dir={str(self.path.parent)!r} is in use by a run in progress ({by}); "
            "wait for it to finish or stop it, or choose another output_dir"
        )

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _read(self) -> dict:
        try:
            loaded = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def _write(self, record: dict) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(self.fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holder() -> dict:
    """Who takes a lock: this process."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command_line()[:200],
    }


def command_line() -> str:
    """This process's command as the user typed it (`python -m grpolab` is `grpolab`)."""
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    if program in ("__main__.py", "grpolab"):
        program = "grpolab"
    return " ".join([program, *sys.argv[1:]])


def describe(who: dict) -> str:
    return (
        f"pid {who.get('pid', '?')} on {who.get('host', '?')}, started {who.get('started', '?')}"
        + (f": {who['command']}" if who.get("command") else "")
    )
