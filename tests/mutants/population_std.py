"""The seed's advantages (population std, divide by G, zero-std guard): correct under the seed
profile, a wrong convention under objective.profile=trl, which declares the sample std."""

import torch


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    r = rewards.view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)  # TRL divides by G - 1
    adv = (r - mean) / (std + eps)
    return torch.where(std > eps, adv, torch.zeros_like(adv)).view(-1)
