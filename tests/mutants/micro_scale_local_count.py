"""Bug: each micro-batch's share taken of its own rank's count, the count summed over the
ranks ignored (SkyRL PR #1296: a token mean that was a mean of means over DDP workers; verl
#7321: the loss falls back to a local count): right on one process, and under data parallel
every rank divides by its own tokens, so a rank with short completions weighs more."""

from grpolab import core


def micro_batch_scale(loss_type, micro_mask, minibatch_mask, minibatch_count=None):
    return core.micro_batch_scale(loss_type, micro_mask, minibatch_mask)  # minibatch_count dropped
