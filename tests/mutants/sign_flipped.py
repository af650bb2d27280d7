"""Bug: the loss is maximised instead of minimised (the minus sign dropped)."""

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
    return -loss, metrics | {"loss": -metrics["loss"]}
