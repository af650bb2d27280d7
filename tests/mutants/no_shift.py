"""Bug: no shift. The logits at position t are scored against the token at t itself."""

import torch


def sequence_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, :-1, :].float() / temperature
    targets = input_ids[:, :-1]  # should be input_ids[:, 1:]
    mask = completion_mask[:, 1:].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), mask
