"""Bug: under gradient accumulation every micro-batch's loss is scaled by its share of the
minibatch's rows, whatever the loss type: a token-mean loss then weighs the tokens of a short
micro-batch as much as those of a long one (TRL PR #6024, ms-swift #10117, verl #5625)."""


def micro_batch_scale(loss_type, micro_mask, minibatch_mask, minibatch_count=None):
    return micro_mask.shape[0] / minibatch_mask.shape[0]
