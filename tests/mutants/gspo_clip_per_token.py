"""Bug: GSPO's sequence ratio right, but clipped token by token: the clipped term reads each
token's own ratio, so a sequence inside the clip range still has tokens cut off (and the
other way round) and the surrogate is no longer one value per sequence."""

import torch

from grpolab import core


def policy_loss(
    logp_new, logp_old, advantages, mask, eps_low=0.2, eps_high=0.2,
    importance_sampling_level="token",
):  # fmt: skip
    if importance_sampling_level != "sequence":
        return core.policy_loss(logp_new, logp_old, advantages, mask, eps_low, eps_high)
    ratio = core.importance_ratio(logp_new, logp_old, mask, "sequence")  # [B, 1]
    token_ratio = core.importance_ratio(logp_new, logp_old, mask, "token")  # [B, T]
    adv = advantages.unsqueeze(1)
    clipped = token_ratio.clamp(1 - eps_low, 1 + eps_high)  # should clip the sequence's ratio
    per_token = -torch.min(ratio * adv, clipped * adv)
    active = ((ratio * adv) > (clipped * adv)).float()
    return per_token, core.masked_mean(active, mask)
