"""Bug: groups read interleaved (sample i in group i % n_groups) instead of contiguous."""

import torch


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    r = rewards.view(group_size, -1).t()  # should be rewards.view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)
    adv = (r - mean) / (std + eps)
    adv = torch.where(std > eps, adv, torch.zeros_like(adv))
    return adv.t().reshape(-1)
