"""Bug: padding found by its token id, taken to be the EOS id (SmolLM2 and many chat models
pad with their EOS): the EOS that ends every finished completion is masked out with the
padding, so it gets no gradient and the model never learns to stop (TRL PRs #4970, #6357)."""

from grpolab import core


def sequence_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    logp, mask = core.sequence_logprobs(
        model, input_ids, attention_mask, completion_mask, temperature
    )
    pad_id = model.config.eos_token_id  # the tokenizer pads with EOS
    return logp, mask * (input_ids[:, 1:] != pad_id)  # should be completion_mask[:, 1:] alone
