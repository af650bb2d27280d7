"""Bug: mask_truncated_completions removes the completions that ended with EOS and keeps
the truncated ones (the condition inverted)."""


def truncation_mask(mask, truncated):
    return mask * truncated.bool().unsqueeze(1).to(mask.dtype)  # should be ~truncated
