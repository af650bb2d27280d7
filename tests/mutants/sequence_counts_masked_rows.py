"""Bug: a sequence-mean (or constant) loss divides by every row of the minibatch, rows out of
the loss included: a truncated row masked out of the numerator still counts in the
denominator, shrinking every other row's weight (TRL #6369)."""

from grpolab.core import aggregation


def micro_batch_scale(loss_type, micro_mask, minibatch_mask, minibatch_count=None):
    if aggregation(loss_type) == "token":
        return float(micro_mask.sum().clamp(min=1)) / max(float(minibatch_mask.sum()), 1.0)
    return micro_mask.shape[0] / minibatch_mask.shape[0]
