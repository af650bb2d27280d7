"""Bug: the loss's KL term computed under torch.no_grad (SkyRL #1340, `compute_approx_kl`
decorated with @torch.no_grad): the loss's value is right, the KL adds no gradient."""

import torch

from grpolab import core


def grpo_loss(
    logp_new, logp_old, logp_ref, advantages, mask, eps_low=0.2, eps_high=0.28, beta=0.0,
    loss_agg="sequence", max_completion_length=None, **options,
):  # fmt: skip
    loss, metrics = core.grpo_loss(
        logp_new, logp_old, logp_ref, advantages, mask, eps_low, eps_high, 0.0, loss_agg,
        max_completion_length, **options,
    )  # fmt: skip
    if beta > 0:
        with torch.no_grad():  # should run with gradients
            with_kl, metrics = core.grpo_loss(
                logp_new, logp_old, logp_ref, advantages, mask, eps_low, eps_high, beta,
                loss_agg, max_completion_length, **options,
            )  # fmt: skip
        loss = loss + (with_kl - loss.detach())
    return loss, metrics
