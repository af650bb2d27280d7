"""A way out, as the caller writes it: a message that tells the user what to pass names the
command-line flag to someone at the shell and the keyword argument to someone in Python
(`grpolab.api` runs its calls under `from_python()`)."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

# name -> (the CLI's flag, the Python API's argument); {} is a value when one is given.
WAYS = {
    "skip_preflight": ("--skip-preflight", "train(skip_preflight=True)"),
    "resume": ("--resume", "train(resume=True)"),
    "resume_path": ("--resume {}", "train(resume={!r})"),
    "overwrite": ("--overwrite", "train(overwrite=True)"),
    "allow_config_change": ("--allow-config-change", "train(allow_config_change=True)"),
    "recheck": ("--recheck", "train(recheck=True)"),
    "strict": ("--strict", "GRPOConfig(strict=True)"),
}

_in_python = contextvars.ContextVar("grpolab_in_python", default=False)


def way(name: str, value: object = "PATH") -> str:
    """How the caller asks for `name` (a key of WAYS), with `value` where it takes one."""
    template = WAYS[name][int(_in_python.get())]
    return template.format(str(value) if "{}" in template else value)


@contextmanager
def from_python() -> Iterator[None]:
    """Messages raised inside name the Python API's arguments."""
    token = _in_python.set(True)
    try:
        yield
    finally:
        _in_python.reset(token)
