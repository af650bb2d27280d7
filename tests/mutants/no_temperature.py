"""Bug: the sampling temperature is not applied to the logits."""

import torch


def sequence_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, :-1, :].float()  # should be divided by temperature
    targets = input_ids[:, 1:]
    mask = completion_mask[:, 1:].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), mask
