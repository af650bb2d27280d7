"""RLOO (`advantage_estimator: rloo`): each reward minus the mean of its group's OTHER G - 1
rewards, not scaled: G / (G - 1) * (r - mean)."""

from __future__ import annotations

import torch

from grpolab.objective.base import Estimator, Option

FORMULA = "r - mean of the group's other G - 1 rewards (RLOO), not scaled"


def estimate(centred: torch.Tensor, n, weights, unbiased: bool) -> torch.Tensor:
    """centred [n_groups, G] -> [n_groups, G]; n the int G, or [n_groups, 1] voting rows."""
    if isinstance(n, int):
        return centred * (n / (n - 1))
    return centred * (n / (n - 1).clamp(min=1))


def reference(rewards: torch.Tensor, G: int, o, lengths=None) -> torch.Tensor:
    """float64: r minus the mean of the group without the sample. [B] -> [B]."""
    r = rewards.double().view(-1, G)
    others = (r.sum(dim=1, keepdim=True) - r) / (G - 1)
    return (r - others).view(-1)


def _card(o) -> dict[str, str]:
    if o.advantage_estimator != "rloo":
        return {}
    return {"advantage": f"{FORMULA}{o.mark('advantage_std', 'advantage_eps')} (estimator *)"}


ESTIMATOR = Estimator(name="rloo", estimate=estimate, reference=reference)
RLOO = Option(name="rloo", estimator=ESTIMATOR, card=_card)
