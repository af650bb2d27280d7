"""Bug: the trainer scores its sampler's top-k distribution (rollout.top_k=20, renormalised
over the 20 most likely tokens, what vLLM's processed log-probs report) while the engine's
log-probs and the declared objective are of the full softmax(logits / T) (prime-rl PR #3186,
TRL #6945): every ratio and importance weight compares two different distributions."""

import torch

TOP_K = 20  # the sampler's rollout.top_k


def sequence_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, :-1, :].float() / temperature
    kth = torch.topk(logits, TOP_K, dim=-1).values[..., -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))  # should score the full softmax
    targets = input_ids[:, 1:]
    mask = completion_mask[:, 1:].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), mask
