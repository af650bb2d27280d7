"""Bug: the entropy metric averaged over every position, prompt and padding included."""

from grpolab import core


def grpo_loss(
    logp_new, logp_old, logp_ref, advantages, mask, eps_low=0.2, eps_high=0.28, beta=0.0,
    loss_agg="sequence", max_completion_length=None, entropy=None, entropy_coef=0.0,
):  # fmt: skip
    loss, metrics = core.grpo_loss(
        logp_new, logp_old, logp_ref, advantages, mask, eps_low, eps_high, beta, loss_agg,
        max_completion_length, entropy=entropy, entropy_coef=entropy_coef,
    )  # fmt: skip
    if entropy is not None:
        metrics["entropy"] = entropy.detach().mean().item()  # should be masked
    return loss, metrics
