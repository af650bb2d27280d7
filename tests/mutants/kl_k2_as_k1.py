"""Bug: k2's value with k1's gradient (NeMo-RL PR #2506: the KL-as-loss gradient lacked the
sampling-score term): (d^2 / 2) is reported, but the loss moves logp_new by k1's constant 1
instead of by logp_new - logp_ref."""

from grpolab import core


def grpo_loss(
    logp_new, logp_old, logp_ref, advantages, mask, eps_low=0.2, eps_high=0.28, beta=0.0,
    loss_agg="sequence", max_completion_length=None, kl_estimator="k3", **options,
):  # fmt: skip
    if kl_estimator != "k2" or beta == 0:
        return core.grpo_loss(
            logp_new, logp_old, logp_ref, advantages, mask, eps_low, eps_high, beta, loss_agg,
            max_completion_length, kl_estimator=kl_estimator, **options,
        )  # fmt: skip
    loss, metrics = core.grpo_loss(
        logp_new, logp_old, logp_ref, advantages, mask, eps_low, eps_high, 0.0, loss_agg,
        max_completion_length, kl_estimator=kl_estimator, **options,
    )  # fmt: skip
    k2 = core.kl_estimate(logp_new, logp_ref, "k2", options.get("kl_clamp"))
    k1 = core.kl_estimate(logp_new, logp_ref, "k1", options.get("kl_clamp"))
    kl = k2.detach() + (k1 - k1.detach())  # should be k2 itself
    loss = loss + beta * core.aggregate(kl, mask, loss_agg, max_completion_length)
    return loss, metrics | {"loss": float(loss)}
