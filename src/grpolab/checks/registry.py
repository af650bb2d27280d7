"""Every check, declared once (grpolab.check.Check), in the order they run: the
seed's seven goals, each followed by the checks of the objective's units for that goal
(grpolab.objective), the units' checks beyond the goals, the engine's samples', the
episodes', the reward probes', and the preflight's own against the whole run. Every id
list, hint, blame order and mutant is read from here."""

from __future__ import annotations

from grpolab import objective
from grpolab.check import GOALS, Check
from grpolab.checks import (
    advantages,
    clip,
    episodes,
    gradients,
    kl,
    logprobs,
    loss,
    memory,
    normalisation,
    packing,
    ratio,
    rewards,
    sampling,
    sync,
)

# The seed's goals, one module each.
SEED_GOALS = {
    1: logprobs.CHECKS,
    2: advantages.CHECKS,
    3: ratio.CHECKS,
    4: clip.CHECKS,
    5: kl.CHECKS,
    6: normalisation.CHECKS,
    7: loss.CHECKS,
}


def _batch_checks() -> tuple[Check, ...]:
    units = objective.unit_checks()
    goals = [c for g in GOALS for c in (*SEED_GOALS[g], *(u for u in units if u.goal == g))]
    beyond = (*(u for u in units if u.goal == 0), *sampling.CHECKS)
    return (*goals, *beyond, rewards.VARIANCE)


ALL: tuple[Check, ...] = (
    rewards.COVERAGE,
    *_batch_checks(),
    *episodes.CHECKS,
    *(demand.check for demand in rewards.PROBES),
    *gradients.CHECKS,
    *sync.CHECKS,
    *packing.CHECKS,
    *memory.CHECKS,
)
BY_ID: dict[str, Check] = {c.id: c for c in ALL}
if len(BY_ID) != len(ALL):
    raise RuntimeError("two checks declare the same id")
HINTS = {c.id: c.hint for c in ALL}
# What runs in the drill only where the learner's objective declares it (or grpolab's own
# machinery around the learner's loss is checked).
DECLARED_ONLY = frozenset(c.id for c in ALL if c.declared_only)


def seed_goal_ids(goal: int) -> tuple[str, ...]:
    """The checks of one of the seed's goals that the seed's objective always meets, in run
    order (the drill's hints follow it)."""
    return tuple(c.id for c in ALL if c.goal == goal and not c.declared_only)


def mutants() -> dict[str, tuple[Check, dict]]:
    """Every known bug in tests/mutants/: file -> (the check that must catch it, the
    objective fields that declare the option it gets wrong)."""
    return {m.file: (c, dict(m.declares)) for c in ALL for m in c.mutants}


# Blame: when several checks fail together, the one that pins the cause is named first. A
# check declaring blame_before moves just ahead of the broader one the same bug also fails
# (a dual clip on both signs changes clip.values too; a flipped sign changes
# norm.aggregation's loss too); among those moved ahead of the same check, an option's
# (declared_only) before the seed's, then in run order.
MOVED = tuple(
    c.id for c in sorted((c for c in ALL if c.blame_before), key=lambda c: not c.declared_only)
)
