"""Bug: exp(d) taken of a detached d (the detach meant for logp_ref put on the whole
difference): k3's value is exact, its gradient is k1's constant 1 instead of 1 - exp(d)
(NeMo-RL PR #2506: the KL gradient without its sampling-score term)."""

import torch


def kl_k3(logp_new, logp_ref):
    d = logp_ref - logp_new
    return torch.exp(d.detach()) - d - 1  # should be torch.exp(d)
