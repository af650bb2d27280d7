"""Bug: rows that should not vote (every reward None, or out of the loss) still count in
their group's mean and std, as reward 0 would (TRL before PR #5902, NeMo-RL before PR #4160);
only their own advantage is zeroed."""

import torch


def group_advantages(rewards, group_size, scale="group", eps=1e-4, valid=None):
    r = rewards.view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)  # should be over the valid rows only
    std = r.std(dim=1, unbiased=False, keepdim=True)
    adv = (r - mean) / (std + eps)
    adv = torch.where(std > eps, adv, torch.zeros_like(adv)).view(-1)
    return adv if valid is None else torch.where(valid, adv, torch.zeros_like(adv))
