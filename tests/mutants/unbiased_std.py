"""Bug: the sample std (divide by G - 1) instead of the population std."""

import torch


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    r = rewards.view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True)  # should be unbiased=False
    adv = (r - mean) / (std + eps)
    adv = torch.where(std > eps, adv, torch.zeros_like(adv))
    return adv.view(-1)
