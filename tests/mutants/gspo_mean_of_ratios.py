"""Bug: GSPO's sequence ratio as the mean of the token ratios instead of exp of the mean
log-ratio (unsloth-zoo PR #870: a sequence weight built from the per-token exp-ratios): equal
when every token moved alike, larger whenever they did not (the mean of exps exceeds the exp
of the mean)."""

import torch

from grpolab import core


def policy_loss(
    logp_new, logp_old, advantages, mask, eps_low=0.2, eps_high=0.2,
    importance_sampling_level="token",
):  # fmt: skip
    if importance_sampling_level != "sequence":
        return core.policy_loss(logp_new, logp_old, advantages, mask, eps_low, eps_high)
    ratios = torch.where(mask.bool(), torch.exp(logp_new - logp_old), torch.zeros_like(logp_new))
    ratio = ratios.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # mean of exps
    adv = advantages.unsqueeze(1)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv).expand_as(logp_new)
    active = ((ratio * adv) > (clipped * adv)).float().expand_as(logp_new)
    return per_token, core.masked_mean(active, mask)
