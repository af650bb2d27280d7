"""The policy model: built offline or loaded (policy.py), LoRA, precision, the fused log-probs,
memory, and data parallel."""
