"""Every random stream of a run derives from the config's `seed` here, and only here.

Each stream gets its own seed so that a change to one (more prompts, another minibatch size)
never shifts another, and a resumed run draws exactly what the straight run drew. The
strides are distinct primes: nearby runs (seed 0 and seed 1, step 5 and step 6) never share
a stream.
"""

from __future__ import annotations

import torch

STEP_STRIDE = 1_000_003  # rollout seeds: one block of steps per run seed
RANK_STRIDE = 7_654_321  # another rank's rollout seed, far from every step of rank 0
ROUND_STRIDE = 15_485_863  # dynamic sampling's further rounds within a step
ORDER_STRIDE = 7_919  # minibatch shuffles: one block of steps per run seed
ORDER_RANK_STRIDE = 104_729
PREFLIGHT_PROMPTS = 12_345  # the preflight's prompts and samples: never a training step's
PREFLIGHT_SAMPLING = 54_321


def rollout_seed(seed: int, step: int, rank: int = 0, round_: int = 0) -> int:
    """The sampling seed of a step's rollout on `rank` (rank 0 samples what one process
    samples); `round_` > 0: dynamic sampling's further rounds of the same step."""
    return seed * STEP_STRIDE + step + RANK_STRIDE * rank + ROUND_STRIDE * round_


def minibatch_order(seed: int, step: int, rank: int = 0) -> torch.Generator:
    """The generator that shuffles a step's rows into minibatches."""
    return torch.Generator().manual_seed(seed * ORDER_STRIDE + step + ORDER_RANK_STRIDE * rank)


def prompt_order(seed: int) -> torch.Generator:
    """The generator that draws the training prompts, step after step (saved in checkpoints)."""
    return torch.Generator().manual_seed(seed)


def preflight_prompts(seed: int) -> torch.Generator:
    """The generator that draws the preflight's prompts (the training draw is untouched)."""
    return torch.Generator().manual_seed(seed + PREFLIGHT_PROMPTS)


def preflight_sampling_seed(seed: int) -> int:
    return seed + PREFLIGHT_SAMPLING
