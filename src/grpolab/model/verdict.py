"""Once-per-model verdicts: whether a faster path computes what the model's own forward
does (the fused log-probs' split and shared prefix, the rollout's decode step), measured on
a probe in the model's own precision and remembered per model object."""

from __future__ import annotations

import torch

from grpolab.model.policy import eval_mode


def gap_beyond_tolerance(got: torch.Tensor, expected: torch.Tensor) -> float | None:
    """max |got - expected| when it exceeds the dtype's tolerance (1e-4 in float32, 2e-2 in
    16-bit, relative to max(1, max |expected|)); None when within it."""
    tol = 1e-4 if expected.dtype in (torch.float32, torch.float64) else 2e-2
    err = (got.float() - expected.float()).abs().max().item()
    scale = max(1.0, expected.float().abs().max().item())
    return None if err <= tol * scale else err


def verdict_once(verdicts, model, failure: str, probe) -> str | None:
    """probe() -> None or what is wrong, run once per model in eval mode (dropout would make
    two forwards differ) without grad; an exception is a verdict too. Cached in verdicts."""
    if model in verdicts:
        return verdicts[model]
    device_type = next(model.parameters()).device.type
    try:  # in the model's own precision: autocast's rounding would blur what is checked
        with eval_mode(model), torch.no_grad(), torch.autocast(device_type, enabled=False):
            reason = probe()
    except Exception as e:  # any model that cannot be called this way takes the other path
        reason = f"{failure}: {type(e).__name__}: {e}"

    if reason is not None:
        reason = f"{type(model).__name__}: {reason}"
    verdicts[model] = reason
    return reason
