"""Bug: dynamic sampling that zeroes the advantages of a group with no reward variance but
keeps the group: its tokens stay in the loss's normaliser and dilute every gradient."""

import torch


def informative_groups(rewards, group_size, eps=1e-4):
    return torch.ones(rewards.numel() // group_size, dtype=torch.bool)  # should drop flat ones
