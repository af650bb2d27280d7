"""Bug: a sequence's importance weight summed from its tokens' ratios instead of exp of their
summed log-ratio (unsloth-zoo PR #870): before any update every token ratio is ~1, so a
sequence of L tokens weighs ~L, or the cap, instead of 1."""

import torch

from grpolab import core


def tis_weights(logp_trainer, logp_engine, mask, cap, mode="token_truncate"):
    if not mode.startswith("sequence"):
        return core.tis_weights(logp_trainer, logp_engine, mask, cap, mode)
    ratios = torch.where(mask.bool(), torch.exp(logp_trainer - logp_engine), 0.0)
    w = ratios.sum(dim=1, keepdim=True)  # should be exp of the summed log-ratio
    w = w.clamp(max=cap) if mode.endswith("truncate") else torch.where(w > cap, 0 * w, w)
    return w.expand_as(logp_trainer)
