"""REINFORCE++ with a group baseline (`advantage_estimator: reinforce_pp`): each reward minus
its group's mean, then whitened over the whole batch, each sequence weighted by its completion
tokens (the token-level whitening of REINFORCE++, as verl computes it)."""

from __future__ import annotations

import torch

from grpolab.objective.base import Estimator, Option

FORMULA = "r - mean_group, whitened over the batch (token-weighted, REINFORCE++)"
WHITEN_EPS = 1e-8  # (x - mean) / sqrt(var + WHITEN_EPS)


def whiten(
    values: torch.Tensor, weights: torch.Tensor | None = None, unbiased: bool = False
) -> torch.Tensor:
    """(values - mean) / sqrt(var + WHITEN_EPS) over all entries, each weighted by `weights`
    (same shape; None: equal weights). unbiased: the variance of the sum of weights W is
    divided by W - 1 (verl's token-level whitening) instead of W."""
    w = torch.ones_like(values) if weights is None else weights.to(values.dtype)
    total = w.sum()
    mean = (w * values).sum() / total
    var = (w * (values - mean) ** 2).sum() / total
    if unbiased:
        var = var * total / (total - 1)
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS)


def estimate(centred: torch.Tensor, n, weights, unbiased: bool) -> torch.Tensor:
    return whiten(centred, weights, unbiased)


def reference(rewards: torch.Tensor, G: int, o, lengths=None) -> torch.Tensor:
    """float64: group-centred rewards whitened over the batch, token-weighted. [B] -> [B]."""
    r = rewards.double().view(-1, G)
    centred = r - r.mean(dim=1, keepdim=True)
    w = torch.ones_like(centred) if lengths is None else lengths.double().view_as(r)
    mean = (w * centred).sum() / w.sum()
    var = (w * (centred - mean) ** 2).sum() / w.sum()
    if o.advantage_std == "sample":
        var = var * w.sum() / (w.sum() - 1)
    return ((centred - mean) / torch.sqrt(var + WHITEN_EPS)).view(-1)


def _card(o) -> dict[str, str]:
    if o.advantage_estimator != "reinforce_pp":
        return {}
    return {"advantage": f"{FORMULA}{o.mark('advantage_std', 'advantage_eps')} (estimator *)"}


def advantage_inputs(o, rollout) -> dict[str, torch.Tensor]:
    """The whitening's weights: each row's completion tokens, [B]."""
    return {"lengths": rollout.completion_mask.sum(dim=1).float()}


ESTIMATOR = Estimator(
    name="reinforce_pp",
    estimate=estimate,
    reference=reference,
    token_weighted=True,
    batch_whitened=True,
)
REINFORCE_PP = Option(
    name="reinforce_pp",
    estimator=ESTIMATOR,
    active=lambda o: o.advantage_estimator == "reinforce_pp",
    card=_card,
    advantage_inputs=advantage_inputs,
)
