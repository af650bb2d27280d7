"""Bug: the entropy bonus added to the loss instead of subtracted: minimising the loss then
lowers the entropy it was meant to keep up."""

from grpolab import core


def grpo_loss(
    logp_new, logp_old, logp_ref, advantages, mask, eps_low=0.2, eps_high=0.28, beta=0.0,
    loss_agg="sequence", max_completion_length=None, entropy=None, entropy_coef=0.0,
):  # fmt: skip
    per_token, clip_frac = core.policy_loss(logp_new, logp_old, advantages, mask, eps_low, eps_high)
    if logp_ref is not None and beta > 0:
        per_token = per_token + beta * core.kl_k3(logp_new, logp_ref)
    metrics = {"clip_frac": clip_frac.item()}
    if entropy is not None:
        per_token = per_token + entropy_coef * entropy  # should be minus
        metrics["entropy"] = core.masked_mean(entropy.detach(), mask).item()
    loss = core.aggregate(per_token, mask, loss_agg, max_completion_length)
    return loss, metrics | {"loss": loss.item()}
