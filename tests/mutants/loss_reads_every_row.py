"""Bug (for skipping): a loss with a term that is not A x a function of the ratio, here a
penalty on the log-ratio's square: a row whose advantage is 0 still has a gradient, so
skipping it changes the update (the user's loss then needs runtime.skip_zero_advantage=false)."""

from grpolab import core


def grpo_loss(
    logp_new, logp_old, logp_ref, advantages, mask, eps_low=0.2, eps_high=0.28, beta=0.0,
    loss_agg="sequence", max_completion_length=None,
):  # fmt: skip
    per_token, clip_frac = core.policy_loss(logp_new, logp_old, advantages, mask, eps_low, eps_high)
    per_token = per_token + 0.5 * (logp_new - logp_old) ** 2  # reads every row
    loss = core.aggregate(per_token, mask, loss_agg, max_completion_length)
    return loss, {"clip_frac": clip_frac.item(), "loss": loss.item()}
