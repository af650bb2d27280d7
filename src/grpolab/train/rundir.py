"""The run directory: what a run writes there, checked before anything is written.

A command that fails must leave the directory as it found it, so `check_output_dir` only
looks, and `prepare_output_dir` (which deletes a replaced run and creates the directory)
runs once everything else has been checked.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from grpolab.train.checkpoint import CHECKPOINT_RE

RUN_FILES = (
    "config.yaml",
    "objective.txt",
    "preflight.json",
    "metrics.jsonl",
    "completions.jsonl",
    "summary.json",
)
# Left by a save or a prune cut short (a kill, a full disk): never part of a run's state.
LEFTOVER_PREFIXES = (".tmp-checkpoint-", ".old-checkpoint-", ".deleting-checkpoint-")


class OutputDirError(ValueError):
    """output_dir cannot hold this run; the message names it and what to do."""


def holds_run(output_dir: Path) -> bool:
    return output_dir.is_dir() and (
        any((output_dir / f).exists() for f in RUN_FILES)
        or any(CHECKPOINT_RE.match(p.name) for p in output_dir.iterdir())
    )


def check_output_dir(output_dir: Path, resume: bool, overwrite: bool) -> None:
    """Raise OutputDirError (FileExistsError when it holds another run) unless the run may
    use `output_dir`; writes nothing."""
    where = f"output_dir={str(output_dir)!r}"
    if resume and overwrite:
        raise OutputDirError(
            "--resume and --overwrite contradict each other: --resume continues the run in "
            f"{where}, --overwrite deletes it and starts over; pass one of them"
        )
    if output_dir.exists() and not output_dir.is_dir():
        raise OutputDirError(f"{where} is a file, not a directory")
    if resume and not output_dir.is_dir():
        raise OutputDirError(f"--resume: {where} does not exist (no run to continue)")
    if holds_run(output_dir) and not resume and not overwrite:
        raise FileExistsError(
            f"{where} holds another run; pass --resume to continue it, --overwrite to replace "
            "it, or choose another output_dir"
        )
    existing = output_dir
    while not existing.exists():  # the nearest existing ancestor must let us create the rest
        existing = existing.parent
    if not existing.is_dir():
        raise OutputDirError(f"{where} cannot be created: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputDirError(f"{where} cannot be written: no write permission on {existing}")


def prepare_output_dir(output_dir: Path, resume: bool, overwrite: bool) -> list[str]:
    """Create `output_dir`; with overwrite (not resume) delete the run it holds. Removes what
    an interrupted save or prune left behind. Returns what was removed, for the log."""
    removed = []
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            replaced = (
                overwrite
                and not resume
                and (
                    p.name in (*RUN_FILES, "tensorboard", "nonfinite-capsule.pt")
                    or p.name.startswith(("checkpoint-", "damaged-checkpoint-"))
                )
            )
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
                    removed.append(p.name)
    output_dir.mkdir(parents=True, exist_ok=True)
    return removed
