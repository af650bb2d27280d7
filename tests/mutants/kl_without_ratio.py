"""Bug: TRL's KL bias correction declared (use_bias_correction_kl) but the KL term left
plain k3, not multiplied by the importance ratio."""

from grpolab import core


def grpo_loss(
    logp_new, logp_old, logp_ref, advantages, mask, eps_low=0.2, eps_high=0.28, beta=0.0,
    loss_agg="sequence", max_completion_length=None, use_bias_correction_kl=False,
):  # fmt: skip
    # use_bias_correction_kl is ignored: should multiply the KL by exp(logp_new - logp_old)
    return core.grpo_loss(
        logp_new, logp_old, logp_ref, advantages, mask, eps_low, eps_high, beta, loss_agg,
        max_completion_length,
    )  # fmt: skip
