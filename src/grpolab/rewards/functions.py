"""Resolving reward names to functions, and calling one function safely.

A reward is a built-in name (accuracy, format, overlong, gym_score), "package.module:function",
"path/to/file.py:function", or a reward model (rewards.model: a directory or a hub id); the
function is called as TRL calls it, by keyword:
f(completions=..., prompts=..., completion_ids=..., answer=..., **other_columns) ->
list[float | None] (None: the reward does not apply to that sample), so both
f(completions, **columns) and TRL's f(prompts, completions, **kwargs) work.

Safety: built-ins run inline (math-verify bounds each parse with its own SIGALRM timeout in the
main thread). User functions run in a worker thread and the caller waits at most `timeout`
seconds; past it, the call's samples are counted as errors and get the fallback. A Python
thread cannot be killed: the late call is abandoned (a daemon thread) and, while it is still
running, further calls of that function are not started and count as errors too.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import os
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("grpolab.rewards")

BUILTIN_REWARDS = ("accuracy", "format", "overlong", "gym_score")


class RewardCallError(Exception):
    """A whole call failed: it raised, timed out, or returned the wrong number of values."""


@dataclass
class RewardFunction:
    name: str  # the name in metrics: rewards/<name>/mean, reward_errors/<name>
    fn: Callable[..., Any]
    weight: float = 1.0
    timeout: float | None = 30.0  # seconds per call (user functions); None = no limit
    fallback: float = 0.0  # the value of a sample whose reward could not be computed
    threaded: bool = True  # run in a worker thread under `timeout`
    needs_token_ids: bool = False
    learned: bool = False  # a reward model: the probes report it and hold it to no demand
    # With conversational prompts: called with each completion as [{"role": "assistant",
    # "content": ...}] (TRL's form); the built-ins read the text.
    reads_messages: bool = True
    # The first failure of the latest call that failed, one line ("KeyError: 'solution'"):
    # what a stop or a check names.
    last_error: str | None = field(default=None, repr=False)
    _logged: bool = field(default=False, repr=False)
    _late: threading.Thread | None = field(default=None, repr=False)

    def __call__(self, completions: list, columns: dict[str, list]) -> tuple[list, int]:
        """(values, error count): values[i] is a finite float, None (not applicable), or the
        fallback where the function failed for sample i."""
        n = len(completions)
        try:
            values = self._returned_list(self._run(completions, columns), n)
        except Exception as e:
            self.last_error = error_text(e)
            where = f"{self.name!r}" + (f" ({defined_at(self.fn)})" if defined_at(self.fn) else "")
            said = str(e) if isinstance(e, RewardCallError) else f"raised {error_text(e)}"
            self._log_once(f"reward {where} failed for the whole batch of {n}: {said}", e)
            return [self.fallback] * n, n
        out, errors = [], 0
        for i, v in enumerate(values):
            if v is None:
                out.append(None)
                continue
            try:
                f = float(v)
            except (TypeError, ValueError):
                f = math.nan
            if not math.isfinite(f):
                errors += 1
                if errors == 1:  # the call's first failure
                    self.last_error = f"returned {v!r} for sample {i} (not a finite number)"
                self._log_once(f"reward {self.name!r} gave {v!r} for sample {i}; using fallback")
                f = self.fallback
            out.append(f)
        return out, errors

    @staticmethod
    def _returned_list(raw: Any, n: int) -> list:
        """What a call returned, as its n values: a list, tuple or other sequence of n."""
        expected = f"must return a list of {n} floats (or None for rows it cannot score)"
        if raw is None or isinstance(raw, str | bytes | int | float | dict):
            shown = f"{type(raw).__name__} {raw!r:.60}"
            if raw is None:
                shown = "None (no return statement?)"
            raise RewardCallError(f"{expected}; got {shown}")
        try:
            values = list(raw)
        except TypeError:
            raise RewardCallError(f"{expected}; got {type(raw).__name__}") from None
        if len(values) != n:
            raise RewardCallError(f"returned {len(values)} values for {n} completions ({expected})")
        return values

    def _run(self, completions: list[str], columns: dict[str, list]) -> Any:
        if not self.threaded or self.timeout is None:
            return self.fn(completions=completions, **columns)
        if self._late is not None and self._late.is_alive():
            raise RewardCallError(
                f"an earlier call is still running past its timeout of {self.timeout:g} s; "
                "this call was not started"
            )
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = self.fn(completions=completions, **columns)
            except BaseException as e:
                box["error"] = e

        thread = threading.Thread(target=target, name=f"reward:{self.name}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            self._late = thread
            raise RewardCallError(f"timed out after {self.timeout:g} s (thread abandoned)")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _log_once(self, message: str, error: BaseException | None = None) -> None:
        if self._logged:
            return
        self._logged = True
        exc_info = None
        if error is not None and not isinstance(error, RewardCallError):
            if os.environ.get("GRPOLAB_TRACEBACK"):
                exc_info = (type(error), error, error.__traceback__)
            else:  # the user's line, not the trainer's frames
                frame = raised_at(error)
                message += f" at {frame}" if frame else ""
        logger.warning(
            "%s (counted in reward_errors/%s; further errors of this function are counted, "
            "not logged)",
            message,
            self.name,
            exc_info=exc_info,
        )


def error_text(error: BaseException) -> str:
    """An exception on one line: its type and the first line of its message."""
    if isinstance(error, RewardCallError):
        return str(error)
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


GRPOLAB_DIR = Path(__file__).resolve().parent.parent  # frames below it are the trainer's


def defined_at(fn: Callable[..., Any]) -> str:
    """'file.py:line' where a user's function is defined ('' for a built-in or a callable
    whose source is unknown)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None or Path(code.co_filename).resolve().is_relative_to(GRPOLAB_DIR):
        return ""
    return f"{Path(code.co_filename).name}:{code.co_firstlineno}"


def raised_at(error: BaseException) -> str:
    """'file.py:line in function: source line' of the innermost frame outside grpolab that
    the exception passed through (the user's code), or ''."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not Path(f.filename).resolve().is_relative_to(GRPOLAB_DIR)
    ]
    if not frames:
        return ""
    f = frames[-1]
    line = f"{Path(f.filename).name}:{f.lineno} in {f.name}"
    return f"{line}: {f.line}" if f.line else line


def resolve_function(ref: str) -> Callable[..., Any]:
    """ "package.module:function" or "path/to/file.py:function" -> the function."""
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(
            f"unknown reward {ref!r}: not a built-in ({', '.join(BUILTIN_REWARDS)}), not "
            "'package.module:function' or 'path/to/file.py:function', and not a reward "
            "model's directory or hub id ('org/name')"
        )
    if target.endswith(".py"):
        module = _load_file(target)
        where = f"file {target!r}"
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise ValueError(f"reward {ref!r}: cannot import module {target!r} ({e})") from None
        except SyntaxError as e:
            raise ValueError(
                f"reward {ref!r}: module {target!r} has a syntax error at "
                f"{e.filename}:{e.lineno}: {e.msg}"
            ) from None
        where = f"module {target!r}"
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward {ref!r}: {where} has no function {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward {ref!r}: {attr!r} in {where} is not callable")
    return fn


def _load_file(path: str):
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"reward file {path!r} does not exist")
    name = f"grpolab_user_reward_{abs(hash(str(file.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ValueError(
            f"reward file {path!r} has a syntax error at line {e.lineno}: {e.msg}"
        ) from None
    except Exception as e:
        raise ValueError(
            f"reward file {path!r} failed to import: {type(e).__name__}: {e}"
        ) from None
    sys.modules[name] = module
    return module
