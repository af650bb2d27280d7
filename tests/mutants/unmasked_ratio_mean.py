"""Bug: the seed's ratio_mean, averaged over padding and prompt positions too."""

import torch

from grpolab import core


def grpo_loss(
    logp_new,
    logp_old,
    logp_ref,
    advantages,
    mask,
    eps_low=0.2,
    eps_high=0.28,
    beta=0.0,
    loss_agg="sequence",
    max_completion_length=None,
):
    loss, metrics = core.grpo_loss(
        logp_new,
        logp_old,
        logp_ref,
        advantages,
        mask,
        eps_low,
        eps_high,
        beta,
        loss_agg,
        max_completion_length,
    )
    ratio_mean = torch.exp(logp_new - logp_old).mean().item()  # not masked
    return loss, metrics | {"ratio_mean": ratio_mean}
