"""Bug: the KL estimate computed under torch.no_grad (SkyRL #1340): the value is k3, so every
check of the value passes, but the KL term adds a constant to the loss and never pulls the
policy back towards the reference."""

import torch


@torch.no_grad()
def kl_k3(logp_new, logp_ref):
    d = logp_ref - logp_new
    return torch.exp(d) - d - 1
