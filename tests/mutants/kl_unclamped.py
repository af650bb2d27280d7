"""Bug: verl's low_var_kl without its clamps: a token far from the reference contributes
exp(d) (millions) instead of at most 10."""

from grpolab import core


def grpo_loss(
    logp_new, logp_old, logp_ref, advantages, mask, eps_low=0.2, eps_high=0.28, beta=0.0,
    loss_agg="sequence", max_completion_length=None, kl_clamp=None, **options,
):  # fmt: skip
    return core.grpo_loss(
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
        **options,
    )  # fmt: skip  (kl_clamp dropped: should be passed on)
