"""Test batches in the rollout layout, built from text with a real tokenizer."""

import torch


def rollout_layout(tokenizer, prompts: list[str], completions: list[str]):
    """Left-padded prompts, then completions + EOS, right-padded (as the engines return them).
    Returns (input_ids, attention_mask, completion_mask) [B, T] and P, where completions start."""
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    P = enc.input_ids.shape[1]
    comp = [[*tokenizer(c).input_ids, tokenizer.eos_token_id] for c in completions]
    C = max(map(len, comp))
    B = len(prompts)
    input_ids = torch.full((B, P + C), tokenizer.pad_token_id)
    attention_mask = torch.zeros(B, P + C, dtype=torch.long)
    completion_mask = torch.zeros(B, P + C, dtype=torch.long)
    input_ids[:, :P], attention_mask[:, :P] = enc.input_ids, enc.attention_mask
    for i, ids in enumerate(comp):
        input_ids[i, P : P + len(ids)] = torch.tensor(ids)
        attention_mask[i, P : P + len(ids)] = 1
        completion_mask[i, P : P + len(ids)] = 1
    return (input_ids, attention_mask, completion_mask), P
