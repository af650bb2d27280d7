"""Bug: the truncated weight written as w times clamp(w) / w (TRL PR #7120's review): the same
number wherever w is a float32, but a stale sequence's w = 0.7^300 underflows to 0 (or its
inverse overflows to inf), and 0 / 0 or inf / inf is NaN."""

import torch


def tis_weights(logp_trainer, logp_engine, mask, cap, mode="token_truncate"):
    log_w = torch.where(mask.bool(), logp_trainer - logp_engine, torch.zeros_like(logp_trainer))
    if mode.startswith("sequence"):
        log_w = log_w.sum(dim=1, keepdim=True)
    w = torch.exp(log_w)
    if mode.endswith("truncate"):
        w = w * (w.clamp(max=cap) / w)  # should be w.clamp(max=cap)
    else:
        w = torch.where(w > cap, torch.zeros_like(w), w)
    return w.expand_as(logp_trainer)
