"""Bug: the loss masks by multiplying, so a NaN in a masked slot (padding of logp_old) makes
the whole loss NaN: NaN * 0 = NaN (OpenRLHF PR #1240)."""

import torch

from grpolab.core import kl_k3


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
    ratio = torch.exp(logp_new - logp_old)
    adv = advantages.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if beta > 0.0 and logp_ref is not None:
        per_token = per_token + beta * kl_k3(logp_new, logp_ref)
    # should be torch.where(mask.bool(), per_token, 0): the product keeps NaN
    loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    with torch.no_grad():
        m = mask.bool()
        metrics = {
            "loss": loss.item(),
            "clip_frac": ((ratio != clipped) & m).sum().item() / m.sum().item(),
            "kl": 0.0 if logp_ref is None else kl_k3(logp_new, logp_ref)[m].mean().item(),
            "ratio_mean": ratio[m].mean().item(),
        }
    return loss, metrics
