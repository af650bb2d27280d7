"""Bug: a weight sync that sends every trained weight but the output head, which in a tied
model is the input embedding too (prime-rl PR #2823: the sparse sync's clone of the tied
lm_head went stale; vLLM PR #51665: embedding updates never reached lm_head): the engine
keeps sampling with the old head. vLLM: the head's names left out of the state dict; the
hf engine under bf16: every trained weight's bf16 copy dropped but the head's."""

from grpolab.model.policy import base_model
from grpolab.model.precision import forget_casts
from grpolab.rollout.vllm import engine_state_dict


def sync_weights(engine, model):
    head = model.get_output_embeddings().weight
    if hasattr(engine, "load_weights"):  # vLLM: its own copy, loaded from a state dict
        state = base_model(model).state_dict()
        names = {k for k, v in state.items() if v.data_ptr() == head.data_ptr()}
        state = {k: v for k, v in engine_state_dict(model).items() if k not in names}
        engine.load_weights(state)  # should send the head too
    else:  # hf under bf16: its bf16 copies of the trained weights
        forget_casts(p for p in model.parameters() if p.requires_grad and p is not head)
    engine.check_sync(model)
