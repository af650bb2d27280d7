"""Bug: dual-clip applied to every token, not only to negative advantages: a positive
advantage's loss becomes -dual_clip * A."""

import torch

from grpolab import core


def policy_loss(
    logp_new, logp_old, advantages, mask, eps_low=0.2, eps_high=0.2, dual_clip=None,
):  # fmt: skip
    per_token, clip_frac = core.policy_loss(logp_new, logp_old, advantages, mask, eps_low, eps_high)
    if dual_clip is not None:
        bound = -advantages.unsqueeze(1) * dual_clip
        per_token = torch.min(per_token, bound)  # should apply where advantages < 0 only
    return per_token, clip_frac
