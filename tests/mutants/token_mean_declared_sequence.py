"""Bug: grpo_loss averages over all tokens (token-mean) whatever aggregation is declared."""

import torch

from grpolab.core import kl_k3, policy_loss


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
    per_token, clip_frac = policy_loss(logp_new, logp_old, advantages, mask, eps_low, eps_high)
    if beta > 0.0 and logp_ref is not None:
        per_token = per_token + beta * kl_k3(logp_new, logp_ref)
    loss = (per_token * mask).sum() / mask.sum()  # token-mean, not the declared loss_agg
    with torch.no_grad():
        ratio = torch.exp(logp_new - logp_old)
        kl = kl_k3(logp_new, logp_ref) if logp_ref is not None else torch.zeros_like(ratio)
        metrics = {
            "loss": loss.item(),
            "clip_frac": clip_frac.item(),
            "kl": ((kl * mask).sum() / mask.sum()).item(),
            "adv_std": advantages.std().item(),
            "ratio_mean": ((ratio * mask).sum() / mask.sum()).item(),
        }
    return loss, metrics
