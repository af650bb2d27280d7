"""Agreement with float64. An agreement check measures the path it checks, and a plain path
of the same precision, against a float64 reference of the same model and batch, and fails
when the checked path is materially further from float64 than the plain one. No fixed
tolerance can do that: the rounding of a float32 computation grows with the model's depth,
the batch's length and the size of the values, so a deeper model or a longer batch crosses
any fixed bound, while a bound loose enough for every model misses a real loss of precision on
a small one."""

from __future__ import annotations

import torch

# Two correct computations in the same precision are about as far from float64 as each other:
# their largest errors over a batch differ by a factor of order 1 (measured: the chunked
# lm-head's log-probs 0.7-1.8x the seed's and its gradients 0.04-1x, on SmolLM2-135M and on
# the demo model; one pass vs micro-batches 1.1x). A lost precision costs the bits that a
# cancellation or a narrower type removes: 10x and far more (a log-sum-exp rounded to one
# float32 number, 10-20x on confident tokens; a bf16 log-softmax 1e4x; a missing shift or
# temperature is wrong in the first digit). 4 lies between the two with margin both ways.
PRECISION_FACTOR = 4.0
# Errors within a few units in the last place of the largest value compared are no evidence
# of anything (the plain path can be exact by luck, and no result is better than its own
# rounding).
FLOOR_ULPS = 4


def precision_tolerance(plain_err: float, largest: float, dtype: torch.dtype) -> float:
    """How far from float64 a checked path may be: PRECISION_FACTOR x the plain path's
    distance, plus FLOOR_ULPS units in the last place of `largest` in `dtype`."""
    return PRECISION_FACTOR * plain_err + FLOOR_ULPS * torch.finfo(dtype).eps * largest


def tolerance_text(tol: float, plain_err: float, plain: str, extra: str = "") -> str:
    what = f"{PRECISION_FACTOR:g} x {plain}'s {plain_err:.1e} + {FLOOR_ULPS} ulp{extra}"
    return f"<= {tol:.2g} ({what})"
