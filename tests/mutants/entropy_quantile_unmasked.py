"""Bug: top_entropy_quantile's threshold is the quantile of every position's entropy, padding
and rows out of the loss included, not of the loss's tokens alone."""

import torch


def entropy_threshold(entropy, mask, quantile):
    return torch.quantile(entropy.detach().float().flatten(), 1.0 - quantile)  # ignores mask
