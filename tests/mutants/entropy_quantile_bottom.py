"""Bug: top_entropy_quantile's threshold is the `quantile` quantile, not the (1 - quantile)
one: with 0.2 it trains on the top 80 % of the tokens, not the top 20 %."""

import torch


def entropy_threshold(entropy, mask, quantile):
    return torch.quantile(entropy.detach().float()[mask.bool()], quantile)  # should be 1 - q
