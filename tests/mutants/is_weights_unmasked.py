"""Bug: a sequence's log-ratio summed over every position, the prompt's and the padding's
too (NeMo-RL PR #2269: a sequence weight of 0.06 at step 1 while the policy ratio was
1.0001): the engine reports no log-prob there (0), the trainer does, so the sum collects
the prompt's log-probs and the weight collapses."""

import torch

from grpolab import core


def tis_weights(logp_trainer, logp_engine, mask, cap, mode="token_truncate"):
    if not mode.startswith("sequence"):
        return core.tis_weights(logp_trainer, logp_engine, mask, cap, mode)
    log_w = (logp_trainer - logp_engine).sum(dim=1, keepdim=True)  # should be masked
    w = torch.exp(log_w)
    w = w.clamp(max=cap) if mode.endswith("truncate") else torch.where(w > cap, 0 * w, w)
    return w.expand_as(logp_trainer)
