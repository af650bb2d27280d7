"""Bug: the sequence-level importance weight against the engine computed as pi_engine /
pi_trainer (the log-ratio's sign flipped)."""

import torch

from grpolab import core


def tis_weights(logp_trainer, logp_engine, mask, cap, mode="token_truncate"):
    if not mode.startswith("sequence"):
        return core.tis_weights(logp_trainer, logp_engine, mask, cap, mode)
    log_w = torch.where(mask.bool(), logp_engine - logp_trainer, torch.zeros_like(logp_trainer))
    w = torch.exp(log_w.sum(dim=1, keepdim=True))  # should be logp_trainer - logp_engine
    w = w.clamp(max=cap) if mode.endswith("truncate") else torch.where(w > cap, 0 * w, w)
    return w.expand_as(logp_trainer)
