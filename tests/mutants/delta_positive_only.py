"""Bug: the two-sided clip's delta caps the ratio only for positive advantages, where the
upper clip already acts; a negative advantage with a huge ratio stays unbounded."""

import torch

from grpolab import core


def policy_loss(
    logp_new, logp_old, advantages, mask, eps_low=0.2, eps_high=0.2, delta=None,
):  # fmt: skip
    ratio = torch.exp(torch.where(mask.bool(), logp_new - logp_old, torch.zeros_like(logp_new)))
    adv = advantages.unsqueeze(1)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    unclipped = ratio
    if delta is not None:
        unclipped = torch.where(adv > 0, ratio.clamp(max=delta), ratio)  # both signs
    per_token = -torch.min(unclipped * adv, clipped * adv)
    active = ((ratio * adv) > (clipped * adv)).float()
    return per_token, core.masked_mean(active, mask)
