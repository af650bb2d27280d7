"""Bug: the naive KL estimate logp_new - logp_ref (high variance, can be negative)."""


def kl_k3(logp_new, logp_ref):
    return logp_new - logp_ref
