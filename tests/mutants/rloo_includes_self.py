"""Bug: RLOO's baseline includes the sample itself (the plain group mean): the advantages
shrink by (G - 1) / G and the baseline is no longer independent of the sample."""

from grpolab import core


def group_advantages(rewards, group_size, scale="group", eps=1e-4, estimator="grpo"):
    if estimator != "rloo":
        return core.group_advantages(rewards, group_size, scale, eps, estimator=estimator)
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)  # should exclude r_i: G / (G - 1) * (r - mean)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    return (adv * (std > eps)).view(-1)
