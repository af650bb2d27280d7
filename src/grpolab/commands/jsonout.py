"""`--json` output: stdout holds the JSON object alone.

Libraries write to stdout too: vLLM's logging handler is bound to it, native code writes to
file descriptor 1. While a command runs under `json_stdout()`, descriptor 1 points at stderr,
so all of that lands there, and `print_json` writes the JSON to the real stdout.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

_real_stdout: int | None = None  # a duplicate of the real stdout while json_stdout() is active


@contextlib.contextmanager
def json_stdout(active: bool = True) -> Iterator[None]:
    """Descriptor 1 (and so sys.stdout) goes to stderr inside; `print_json` still reaches the
    real stdout. Inactive: nothing changes."""
    global _real_stdout
    if not active or _real_stdout is not None:
        yield
        return
    sys.stdout.flush()
    _real_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(_real_stdout, 1)
        os.close(_real_stdout)
        _real_stdout = None


def print_json(text: str) -> None:
    """`text` and a newline on the command's stdout: the real one under json_stdout(), unless
    sys.stdout was replaced (redirect_stdout, a test's capture), which then gets it."""
    if _real_stdout is None or sys.stdout is not sys.__stdout__:
        print(text, flush=True)
        return
    data = (text + "\n").encode()
    while data:  # a pipe may take a large object in parts
        data = data[os.write(_real_stdout, data) :]
