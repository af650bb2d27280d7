"""Bug: GSPO's sequence ratio as exp of the SUM of the token log-ratios, not their mean: a
long sequence's ratio explodes or vanishes (NeMo-RL #2269)."""

import torch

from grpolab import core


def policy_loss(
    logp_new, logp_old, advantages, mask, eps_low=0.2, eps_high=0.2,
    importance_sampling_level="token",
):  # fmt: skip
    if importance_sampling_level != "sequence":
        return core.policy_loss(logp_new, logp_old, advantages, mask, eps_low, eps_high)
    log_ratio = torch.where(mask.bool(), logp_new - logp_old, torch.zeros_like(logp_new))
    ratio = torch.exp(log_ratio.sum(dim=1, keepdim=True))  # should be the mean
    adv = advantages.unsqueeze(1)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv).expand_as(logp_new)
    active = ((ratio * adv) > (clipped * adv)).float().expand_as(logp_new)
    return per_token, core.masked_mean(active, mask)
