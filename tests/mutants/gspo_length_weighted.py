"""Bug: GSPO's one value per sequence broadcast over its tokens and averaged over all tokens,
whatever the declared aggregation: long sequences weigh more (TRL #3823)."""

from grpolab import core


def grpo_loss(
    logp_new, logp_old, logp_ref, advantages, mask, eps_low=0.2, eps_high=0.28, beta=0.0,
    loss_agg="sequence", max_completion_length=None, importance_sampling_level="token",
):  # fmt: skip
    per_token, clip_frac = core.policy_loss(
        logp_new, logp_old, advantages, mask, eps_low, eps_high,
        importance_sampling_level=importance_sampling_level,
    )  # fmt: skip
    if logp_ref is not None and beta > 0:
        per_token = per_token + beta * core.kl_k3(logp_new, logp_ref)
    loss = core.aggregate(per_token, mask, "token")  # should be loss_agg
    return loss, {"loss": loss.item(), "clip_frac": clip_frac.item()}
