"""Bug: k3 with the log-ratio reversed: d = logp_new - logp_ref."""

import torch


def kl_k3(logp_new, logp_ref):
    d = logp_new - logp_ref  # should be logp_ref - logp_new
    return torch.exp(d) - d - 1
