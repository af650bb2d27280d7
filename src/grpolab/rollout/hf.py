"""The default rollout engine: transformers `generate` on the training model itself.

Batched with a KV cache; prompts left-padded; the G samples of a prompt contiguous (each
prompt row repeated G times before generate, as `num_return_sequences` would, which greedy
decoding refuses). Sampling is seeded from `SamplingParams.seed` inside
`torch.random.fork_rng`, so the global RNG state is untouched (a resumed run is bit-exact).
Temperature 0 is greedy decoding; its log-probs are reported at temperature 1.

Engine log-probs are recorded while sampling by a logits processor that sits before the
temperature / top-k / top-p warpers: it sees the model's raw logits and reports
log_softmax(logits / temperature) of the sampled token, i.e. the untruncated sampling
distribution that `core.sequence_logprobs(..., temperature)` computes. Only one [B, V]
distribution is kept at a time (storing generate's per-step scores would be [L, B, V]).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from grpolab.rollout.base import Rollout, SamplingParams
from grpolab.rollout.common import (
    assemble_rollout,
    check_sampling,
    encode_prompts,
    pad_token_id,
    stop_token_ids,
)


class _LogprobRecorder(LogitsProcessor):
    """Records log_softmax(raw_logits / T) of each sampled token; returns scores unchanged."""

    def __init__(self, prompt_length: int, temperature: float):
        self.prompt_length = prompt_length
        self.temperature = temperature
        self.steps: list[torch.Tensor] = []  # [B] per generated token
        self._pending: torch.Tensor | None = None  # [B, V] log-probs of the next token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._collect(input_ids)
        self._pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _collect(self, sequences: torch.Tensor) -> None:
        """Gather the pending distribution at the token that was sampled from it."""
        step = len(self.steps)
        if self._pending is not None and sequences.shape[1] > self.prompt_length + step:
            token = sequences[:, self.prompt_length + step].to(self._pending.device)
            self.steps.append(self._pending.gather(-1, token[:, None]).squeeze(-1))
            self._pending = None

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        self._collect(sequences)
        return torch.stack(self.steps, dim=1).cpu()  # [B, L]


class HFEngine:
    """RolloutEngine on a transformers model. The model is shared with the trainer (no copy),
    so `sync_weights` of that same model is a no-op."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        chat_template: bool = False,
        system_prompt: str | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        config = model.config
        self.context_length = getattr(config, "max_position_embeddings", None)
        model_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.stop_ids = stop_token_ids(tokenizer, model_eos)
        self.pad_id = pad_token_id(tokenizer)

    def sync_weights(self, model: torch.nn.Module) -> None:
        if model is not self.model:
            self.model.load_state_dict(model.state_dict())

    @torch.no_grad()
    def generate(self, prompts: list[str], num_generations: int, params: SamplingParams) -> Rollout:
        check_sampling(num_generations, params)
        G = num_generations
        prompt_ids = encode_prompts(
            self.tokenizer,
            prompts,
            params.max_completion_length,
            self.context_length,
            self.chat_template,
            self.system_prompt,
        )
        device = next(self.model.parameters()).device
        P = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(prompt_ids):  # left padding: completions start at column P
            input_ids[i, P - len(ids) :] = torch.tensor(ids)
            attention_mask[i, P - len(ids) :] = 1

        greedy = params.temperature == 0
        # Greedy decoding reports log-probs at temperature 1.
        recorder = _LogprobRecorder(P, 1.0 if greedy else params.temperature)
        sampling = (
            {"do_sample": False}
            if greedy
            else {
                "do_sample": True,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
            }
        )
        generation_config = GenerationConfig(
            max_new_tokens=params.max_completion_length,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            use_cache=True,
            return_dict_in_generate=False,
            **sampling,
        )
        devices = [device] if device.type == "cuda" else []
        was_training = self.model.training
        # generate() fills every unset option from model.generation_config (a checkpoint's
        # repetition_penalty, min_p, ... would change the sampling distribution without the
        # recorded log-probs knowing): a clean config stands in during the call.
        saved_config = getattr(self.model, "generation_config", None)
        try:
            self.model.eval()
            self.model.generation_config = GenerationConfig()
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(params.seed)
                sequences = self.model.generate(
                    input_ids=input_ids.repeat_interleave(G, dim=0).to(device),
                    attention_mask=attention_mask.repeat_interleave(G, dim=0).to(device),
                    generation_config=generation_config,
                    logits_processor=LogitsProcessorList([recorder]),
                    # FSDP2: every rank runs the same number of forwards (collectives inside).
                    synced_gpus=type(self.model).__name__.startswith("FSDP"),
                )
        finally:
            self.model.generation_config = saved_config
            self.model.train(was_training)

        sequences = sequences.cpu()  # [B, P + L]
        logprobs = recorder.finish(sequences)  # [B, L]
        completions = sequences[:, P:]
        return assemble_rollout(
            prompts,
            prompt_ids,
            completions.tolist(),
            logprobs[:, : completions.shape[1]].tolist(),
            G,
            self.stop_ids,
            self.pad_id,
            self.tokenizer,
        )
