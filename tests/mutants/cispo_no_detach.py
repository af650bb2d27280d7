"""Bug: CISPO's capped ratio not detached: the gradient flows through the weight too, and
d loss / d logp is -A * w * (1 + logp) instead of -A * w."""

import torch

from grpolab import core


def policy_loss(
    logp_new, logp_old, advantages, mask, eps_low=0.2, eps_high=0.2, loss="clip",
):  # fmt: skip
    if loss != "cispo":
        return core.policy_loss(logp_new, logp_old, advantages, mask, eps_low, eps_high)
    ratio = torch.exp(torch.where(mask.bool(), logp_new - logp_old, torch.zeros_like(logp_new)))
    weight = ratio.clamp(max=eps_high)  # should be .detach()
    per_token = -weight * advantages.unsqueeze(1) * logp_new
    capped = ((ratio > eps_high) & (advantages.unsqueeze(1) > 0)).float()
    return per_token, core.masked_mean(capped, mask)
