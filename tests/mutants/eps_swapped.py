"""Bug: eps_low and eps_high applied to the wrong sides of the clip."""

import torch


def policy_loss(logp_new, logp_old, advantages, mask, eps_low=0.2, eps_high=0.2):
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logp_new - logp_old)
    clipped = torch.clamp(ratio, 1 - eps_high, 1 + eps_low)  # swapped
    per_token = -torch.min(ratio * adv, clipped * adv)
    with torch.no_grad():
        clip_frac = (((ratio * adv) > (clipped * adv)).float() * mask).sum() / mask.sum()
    return per_token, clip_frac
