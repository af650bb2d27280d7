"""Bug: torch.max instead of torch.min: the clip no longer bounds the update."""

import torch


def policy_loss(logp_new, logp_old, advantages, mask, eps_low=0.2, eps_high=0.2):
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logp_new - logp_old)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.max(ratio * adv, clipped * adv)  # should be torch.min
    with torch.no_grad():
        clip_frac = (((ratio * adv) > (clipped * adv)).float() * mask).sum() / mask.sum()
    return per_token, clip_frac
