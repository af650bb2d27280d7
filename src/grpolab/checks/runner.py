"""Running the checks: each declared check whose condition holds, in registry order, an
exception in the functions under test becoming a failed result of the check that raised it;
then the failures in blame order (the likely cause first) and the goals' status."""

from __future__ import annotations

from collections.abc import Collection

import torch

from grpolab.check import GOALS, Check, CheckResult
from grpolab.checks.context import Context, PreflightBatch, PreflightSettings
from grpolab.checks.episodes import EpisodeBatch, Episodes
from grpolab.checks.registry import ALL, BY_ID, MOVED
from grpolab.core import CoreFunctions
from grpolab.functions import impl_error_line
from grpolab.model.policy import eval_mode
from grpolab.rollout.episodes import EpisodeFunctions


def run_check(check: Check, ctx: Context) -> CheckResult:
    """`check` on `ctx`; an exception (the user's code may raise anything) is its failure,
    at the line of the --impl file where it was raised."""
    ctx.check = check
    try:
        return check.run(ctx)
    except Exception as err:
        path = ctx.impl.path
        line = impl_error_line(err, path) if path else None
        where = f"{path}:{line}: " if line else ""
        return CheckResult(
            id=check.id,
            goal=check.goal,
            what="the implementation raised",
            measured=type(err).__name__,
            expected="no exception",
            passed=False,
            hint=check.hint,
            error=f"{where}{type(err).__name__}: {err}",
            error_line=line,
        )


def run_stage(ctx: Context, stage: str, only: Collection[str] | None = None) -> list[CheckResult]:
    """Every check of `stage` whose condition holds on `ctx`, in registry order; `only`: the
    ids of the checks to run (None: all)."""
    chosen = [c for c in ALL if c.stage == stage and (only is None or c.id in only)]
    return [run_check(c, ctx) for c in chosen if c.when(ctx)]


def run_checks(
    model,
    batch: PreflightBatch,
    settings: PreflightSettings | None = None,
    impl: CoreFunctions | None = None,
    only: Collection[str] | None = None,
) -> list[CheckResult]:
    """The checks on a model and a scored batch, in goal order (`only`: those ids alone).
    The model's train/eval mode and weights are left as found."""
    s = settings or PreflightSettings()
    torch.manual_seed(s.seed)
    ctx = Context(impl or CoreFunctions(), s, model, batch)
    with eval_mode(model, zero_grad=True):
        return run_stage(ctx, "batch", only)


def blamed(results: list[CheckResult]) -> list[CheckResult]:
    """The failed checks, the likely cause first: run order, with the declared blame moves."""
    position = {r.id: i for i, r in enumerate(results)}
    failed = {r.id for r in results if not r.passed}

    def key(r: CheckResult) -> tuple[int, int]:
        check = BY_ID.get(r.id)
        moves = check is not None and check.blame_before in position
        if moves and check.blame_unless not in failed:
            return position[check.blame_before], MOVED.index(r.id) - len(MOVED)
        return position[r.id], 0

    return sorted((r for r in results if not r.passed), key=key)


def goal_status(results: list[CheckResult]) -> dict[int, bool]:
    """Per seed goal (1..7): do all its checks pass?"""
    status = {}
    for goal in GOALS:
        mine = [r for r in results if r.goal == goal]
        status[goal] = bool(mine) and all(r.passed for r in mine)
    return status


def run_episode_checks(
    model,
    batch: EpisodeBatch,
    settings: PreflightSettings | None = None,
    impl: CoreFunctions | None = None,
    fns: EpisodeFunctions | None = None,
    only: Collection[str] | None = None,
) -> list[CheckResult]:
    """The episode checks on the engine's record `batch` (grpolab.checks.episodes), with the
    episode functions `fns` (`only`: those ids alone); the model left as found."""
    episodes = Episodes(batch, fns or EpisodeFunctions())
    ctx = Context(
        impl or CoreFunctions(), settings or PreflightSettings(), model, episodes=episodes
    )
    with eval_mode(model, zero_grad=True):
        return run_stage(ctx, "episodes", only)
