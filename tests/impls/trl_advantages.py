"""TRL 1.16's advantages as a TRL user writes them (GRPOTrainer, scale_rewards="group"):
the sample std (Bessel, divide by G - 1) + 1e-4, no zero-std guard. Correct under
objective.profile=trl."""

import torch


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    r = rewards.view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True)  # torch's default: unbiased, G - 1
    return ((r - mean) / (std + eps)).view(-1).to(torch.promote_types(rewards.dtype, torch.float32))
