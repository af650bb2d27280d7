"""Bug: the token-mode normaliser counts every token after the prompt, tool results
included (the response length, not the loss mask): episodes that call tools get smaller
gradients per token."""


def normaliser_mask(rollout):
    mask = rollout.attention_mask.clone()
    mask[:, : rollout.prompt_length] = 0  # should be rollout.completion_mask
    return mask
