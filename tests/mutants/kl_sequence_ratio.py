"""Bug: under GSPO, the KL bias correction multiplies each token's KL by the sequence's
importance ratio [B, 1] instead of the token's own: the loss barely moves, the gradient
gains a term from every other token's KL (TRL #6586)."""

from grpolab import core


def grpo_loss(logp_new, logp_old, logp_ref, advantages, mask, eps_low=0.2, eps_high=0.28,
              beta=0.0, loss_agg="sequence", max_completion_length=None,
              importance_sampling_level="token", use_bias_correction_kl=False):  # fmt: skip
    loss, metrics = core.grpo_loss(
        logp_new, logp_old, logp_ref, advantages, mask, eps_low, eps_high, 0.0, loss_agg,
        max_completion_length, importance_sampling_level=importance_sampling_level,
    )  # fmt: skip
    if beta > 0 and logp_ref is not None:
        kl = core.kl_k3(logp_new, logp_ref)
        if use_bias_correction_kl:  # should be the per-token ratio
            kl = kl * core.importance_ratio(logp_new, logp_old, mask, importance_sampling_level)
        loss = loss + beta * core.aggregate(kl, mask, loss_agg, max_completion_length)
    return loss, metrics
