"""Which core functions run: chosen here, once, for the trainer, the preflight, `--impl` and
the drill alike.

grpolab's own table is `grpolab.core` with the log-probs of `grpolab.model.logprobs` (the fused
path unless `logprobs="naive"`); a user's file (`--impl`, the drill's `my_grpo.py`) replaces
any of the six functions it defines (and of the step functions the objective's units bring,
`tis_weights`, `informative_groups`, `truncation_mask`, `entropy_threshold`, and the
micro-batch scaling `micro_batch_scale`: `core.MENU_FUNCTIONS`), and the rest stay grpolab's.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from grpolab.core import CORE_FUNCTIONS, MENU_FUNCTIONS, CoreFunctions
from grpolab.model.logprobs import token_logprobs
from grpolab.objective import CONVENTION_KWARGS, keywords_not_taken
from grpolab.rollout.episodes import EPISODE_FUNCTIONS, EpisodeFunctions

# "core" is the old name of the naive path: the same code.
LOGPROB_PATHS = ("fused", "naive", "core")


def core_functions(
    logprobs: str = "fused", shared_prefix: bool = True, user: CoreFunctions | None = None
) -> CoreFunctions:
    """The table a run uses: `user`'s functions where it has its own, else grpolab's, with
    `logprobs` choosing grpolab's log-prob path ("fused": the chunked lm-head, each group's
    prompt run once when `shared_prefix`; "naive": the full-logits `core.sequence_logprobs`)."""
    if logprobs not in LOGPROB_PATHS:
        raise ValueError(f"runtime.logprobs={logprobs!r} is not one of {list(LOGPROB_PATHS)}")
    table = CoreFunctions()
    if logprobs == "fused":

        def sequence_logprobs(
            model,
            input_ids,
            attention_mask,
            completion_mask,
            temperature=1.0,
            return_entropy=False,
            packed=False,
        ):
            return token_logprobs(
                model,
                input_ids,
                attention_mask,
                completion_mask,
                temperature,
                impl="fused",
                return_entropy=return_entropy,
                shared_prefix=shared_prefix,
                packed=packed,
            )

        table.sequence_logprobs = sequence_logprobs
        table.source["sequence_logprobs"] = "grpolab.model.logprobs (fused)"
    if user is not None:
        for name, source in user.source.items():
            if source != "grpolab":
                setattr(table, name, getattr(user, name))
                table.source[name] = source
        table.path = user.path
    return table


# Keywords a step passes that a user's function may leave out of its signature: the
# conventions (the preflight checks it computes the declared one), the entropy, which only the
# entropy bonus reads (the preflight requires it then), the request for it, and the request
# to pack the rows without padding (the same values padded: a function without it pads).
OPTIONAL_KEYWORDS = {
    "grpo_loss": frozenset(CONVENTION_KWARGS) | {"entropy"},
    "group_advantages": frozenset(CONVENTION_KWARGS),
    "sequence_logprobs": frozenset({"return_entropy", "packed"}),
}


def called_as_written(fn: Callable, optional: frozenset[str]) -> Callable:
    """`fn`, dropping the `optional` keywords its signature does not take; `fn` itself when
    it takes them all (or any keyword). The signature is read here, once, not on every call."""
    dropped = keywords_not_taken(fn, optional)
    if not dropped:
        return fn

    @functools.wraps(fn)  # inspect.signature still sees fn's own
    def call(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k not in dropped})

    return call


def as_called(table: CoreFunctions) -> CoreFunctions:
    """`table` with each function the step passes optional keywords to adapted once, by
    `called_as_written`, so the step passes them all."""
    adapted = {
        name: called_as_written(getattr(table, name), optional)
        for name, optional in OPTIONAL_KEYWORDS.items()
    }
    return dataclasses.replace(table, source=dict(table.source), **adapted)


class ImplLoadError(Exception):
    """The user's implementation file could not be loaded (missing, syntax error, raises)."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.line = line


def load_impl(path: str | Path) -> CoreFunctions:
    """The core functions a Python file defines (the others are grpolab.core's)."""
    path = Path(path)
    if not path.is_file():
        raise ImplLoadError(f"--impl {str(path)!r}: no such file")
    name = f"grpolab_impl_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        raise ImplLoadError(
            f"{path}:{err.lineno}: syntax error: {err.msg}", line=err.lineno
        ) from None
    except Exception as err:
        line = impl_error_line(err, path)
        raise ImplLoadError(
            f"{path}:{line}: {type(err).__name__} while loading: {err}", line=line
        ) from None
    impl = CoreFunctions(path=str(path))
    for fn in CORE_FUNCTIONS + MENU_FUNCTIONS:
        if callable(getattr(module, fn, None)):
            setattr(impl, fn, getattr(module, fn))
            impl.source[fn] = str(path)
    sys.modules.pop(name, None)
    return impl


def load_episode_impl(path: str | Path) -> EpisodeFunctions:
    """The episode functions a Python file defines (`EPISODE_FUNCTIONS`: the trained token
    stream, the loss mask, the text the rewards read, the normaliser's mask); the others
    are grpolab's."""
    path = Path(path)
    if not path.is_file():
        raise ImplLoadError(f"--impl {str(path)!r}: no such file")
    name = f"grpolab_episode_impl_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        line = impl_error_line(err, path)
        raise ImplLoadError(f"{path}:{line}: {type(err).__name__}: {err}", line=line) from None
    fns = EpisodeFunctions()
    for fn in EPISODE_FUNCTIONS:
        if callable(getattr(module, fn, None)):
            setattr(fns, fn, getattr(module, fn))
            fns.source[fn] = str(path)
    return fns


def impl_error_line(err: BaseException, path: str | Path) -> int | None:
    """The deepest line of `path` in the traceback of `err` (where the user's code failed)."""
    target = str(Path(path).resolve())
    line = None
    for frame in traceback.extract_tb(err.__traceback__):
        if str(Path(frame.filename).resolve()) == target:
            line = frame.lineno
    return line
