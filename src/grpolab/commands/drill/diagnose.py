"""Which hint fits a failing goal. Pass and fail come from grpolab's checks; when several
checks of a goal fail at once, the learner's function is compared with the known bugs'
fingerprints (a swapped eps, groups read interleaved, a dropped minus sign...) so that the
hint names the bug rather than the first symptom."""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpolab import core
from grpolab.check import CheckResult
from grpolab.checks.registry import seed_goal_ids
from grpolab.checks.runner import blamed
from grpolab.core import CoreFunctions


def first_failing(goal: int, results: list[CheckResult]) -> str | None:
    """Within a goal, the check whose hint to give when no fingerprint matches: the likely
    cause first (the checks' blame order) among the seed's checks, which the drill has hints
    for."""
    hinted = set(seed_goal_ids(goal))
    failing = blamed(results)
    return next((r.id for r in failing if r.id in hinted), failing[0].id if failing else None)


def _close(a, b, tol: float = 1e-4) -> bool:
    a = torch.as_tensor(a).detach().double()
    b = torch.as_tensor(b).detach().double()
    return a.shape == b.shape and bool(torch.allclose(a, b, atol=tol, rtol=tol))


def _advantages(r: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    std = r.std(dim=1, unbiased=unbiased, keepdim=True)
    adv = (r - r.mean(dim=1, keepdim=True)) / (std + 1e-4)
    return torch.where(std > 1e-4, adv, torch.zeros_like(adv))


def _advantage_bug(impl: CoreFunctions) -> str | None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1, 1, 0, 1, 0.2, 0.9, 0.4, 0.0, 0, 0, 1, 1])
    got = impl.group_advantages(rewards, 4)
    if _close(got, _advantages(rewards.view(4, -1).t()).t().reshape(-1)):
        return "advantages.contiguous"
    if _close(got, _advantages(rewards.view(-1, 4), unbiased=True).view(-1)):
        return "advantages.population_std"
    return None


def _clip_case():
    ratio = torch.tensor([[0.5, 0.78, 0.9, 1.0, 1.1, 1.22, 1.26, 1.5]] * 2)
    logp_old = torch.full_like(ratio, -1.0)
    adv = torch.tensor([1.0, -1.0])
    return logp_old + torch.log(ratio), logp_old, adv, torch.ones_like(ratio)


def _surrogate(logp_new, logp_old, adv, lo: float, hi: float, pick=torch.min) -> torch.Tensor:
    ratio = torch.exp(logp_new - logp_old)
    A = adv.unsqueeze(1)
    return -pick(ratio * A, ratio.clamp(1 - lo, 1 + hi) * A)


def _policy_bug(impl: CoreFunctions) -> str | None:
    logp_new, logp_old, adv, mask = _clip_case()
    per_token, _ = impl.policy_loss(logp_new, logp_old, adv, mask, 0.2, 0.28)
    if _close(per_token, _surrogate(logp_new, logp_old, adv, 0.28, 0.2)):
        return "clip.asymmetric"
    if _close(per_token, _surrogate(logp_new, logp_old, adv, 0.2, 0.28, torch.max)):
        return "clip.values"
    if _close(per_token, -_surrogate(logp_new, logp_old, adv, 0.2, 0.28)):
        return "loss.sgd_direction"
    return None


def _loss_bug(impl: CoreFunctions) -> str | None:
    logp_new, logp_old, adv, mask = _clip_case()
    loss, _ = impl.grpo_loss(logp_new, logp_old, None, adv * 0.3 + 0.5, mask)
    expected, _ = core.grpo_loss(logp_new, logp_old, None, adv * 0.3 + 0.5, mask)
    if _close(loss, -expected) and not _close(loss, expected):
        return "loss.sgd_direction"
    return None


# fingerprint -> the goals whose hint it decides
FINGERPRINTS: tuple[tuple[Callable[[CoreFunctions], str | None], tuple[int, ...]], ...] = (
    (_advantage_bug, (2,)),
    (_policy_bug, (4, 6, 7)),
    (_loss_bug, (6, 7)),
)


def known_bugs(impl: CoreFunctions, failing_goals: set[int]) -> dict[int, str]:
    """Goal -> the check whose hint names the bug, for the fingerprints that match."""
    found: dict[int, str] = {}
    for fingerprint, goals in FINGERPRINTS:
        if not failing_goals & set(goals):
            continue
        try:
            with torch.no_grad():
                key = fingerprint(impl)
        except Exception:  # the learner's function may fail anywhere: no fingerprint then
            key = None
        for goal in goals:
            if key and goal in failing_goals and goal not in found:
                found[goal] = key
    return found
