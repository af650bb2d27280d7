"""The default rollout engine: a decode loop on the training model itself (transformers
forward with a KV cache).

Prompts left-padded; the G samples of a prompt contiguous. Each prompt is prefilled once, its
KV cache and first-token distribution repeated G times (the G samples share them); then the
loop samples one token per row per step, temperature first, then top-k, then top-p (the order
of transformers' `generate`). Rows that have produced a stop token leave the batch and the
cache, so later steps only run the rows still writing. Sampling draws from a generator
seeded with `SamplingParams.seed`: the global RNG is untouched and a resumed run samples the
same. Temperature 0 is greedy decoding; its log-probs are reported at temperature 1.

The engine log-prob of a token is log_softmax(logits / temperature) before top-k / top-p, i.e.
the untruncated sampling distribution that `core.sequence_logprobs(..., temperature)`
computes. Only one [rows, V] distribution exists at a time.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from grpolab.core import position_ids
from grpolab.model.lora import is_lora, lora_layers, merged_lora_weight, plain_lora
from grpolab.model.policy import base_model, eval_mode, plain_kv_cache
from grpolab.model.precision import (
    FP32,
    Precision,
    autocast,
    cached_cast,
    casts_forgotten,
    forget_casts,
)
from grpolab.rollout.base import Rollout, SamplingParams
from grpolab.rollout.common import (
    SAMPLERS,
    WeightSyncError,
    assemble_rollout,
    checked_prompt_ids,
    default_sync_tolerance,
    pad_token_id,
    stop_token_ids,
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
class HFEngineConfig:
    """`rollout.hf`: the decode loop on the training model. Both keys decide how the same
    distribution is sampled, so a resumed run may change them."""

    # Prefill each prompt once for its G samples (exact; off = one prefill per row).
    shared_prefill: bool = key(True, legacy="rollout.shared_prefill", resume_free=True)
    # How each token is drawn from its distribution (the same distribution either way,
    # different random numbers). multinomial: torch.multinomial, one exponential draw per
    # vocabulary entry (~50 ms per decode step at 64 rows x 49k on a CPU), the samples of
    # every run before inverse_cdf existed. inverse_cdf: one uniform per row against float64
    # cumulative sums, in two levels (~1 ms).
    sampler: str = key(
        "multinomial", choices=tuple(SAMPLERS), legacy="rollout.sampler", resume_free=True
    )

    def memory_mb(self, weights_mb: float, kv_cache_mb: float, device) -> float:
        """What sampling holds beside the training model: the batch's KV cache (the engine
        samples with the trainer's own weights)."""
        return kv_cache_mb


class HFEngine(RolloutEngine):
    """RolloutEngine on a transformers model. The model is shared with the trainer (no copy),
    so `sync_weights` of that same model is a no-op in float32.

    Under bf16 precision it samples under bf16 autocast from its own bf16 copy of each weight
    (`precision.cached_cast`: cast once, not per decode step). A LoRA model samples from its
    adapters merged into bf16 copies of the base weights (W + scaling * B @ A, rounded once;
    the adapters switched off meanwhile), as vLLM is given them: one matmul per linear
    instead of three, and no casts between them. `sync_weights` drops the trained weights'
    copies (the next forward casts or merges the updated ones) and checks them against
    copies made afresh (`check_sync`), as the vLLM engine checks its weights."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        chat_template: bool = False,
        system_prompt: str | None = None,
        shared_prefill: bool = True,
        episodes: EpisodeSetup | None = None,
        precision: Precision = FP32,
        sync_tolerance: float | None = None,
    ):
        self.model = model
        self.precision = precision
        # The copies hold the trainer's weights rounded once: current ones equal a fresh
        # rounding exactly (check_sync).
        self.sync_tolerance = (
            default_sync_tolerance("float32") if sync_tolerance is None else sync_tolerance
        )
        self.last_sync_gap: float | None = None  # bf16: the latest sync's copy gap
        self._merged: tuple[tuple, WeakIdKeyDictionary] | None = None  # (made of, copies)
        self.episodes = episodes  # None: single-turn
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.shared_prefill = shared_prefill
        config = model.config
        self.context_length = getattr(config, "max_position_embeddings", None)
        model_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.stop_ids = stop_token_ids(tokenizer, model_eos)
        self.pad_id = pad_token_id(tokenizer)

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        tokenizer,
        cfg,
        model_path: str | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
        episodes: EpisodeSetup | None = None,
        precision: Precision = FP32,
    ) -> HFEngine:
        """An engine on the trainer's own `model` (no copy; `model_path` is not needed)."""
        return cls(
            model,
            tokenizer,
            chat_template=chat_template,
            system_prompt=system_prompt,
            shared_prefill=cfg.hf.shared_prefill,
            episodes=episodes,
            precision=precision,
            sync_tolerance=cfg.sync_tolerance,
        )

    def sync_weights(self, model: torch.nn.Module) -> None:
        if model is not self.model:
            self.model.load_state_dict(model.state_dict())
        if self.precision.bf16:
            forget_casts(p for p in self.model.parameters() if p.requires_grad)
            self.check_sync(model)

    def sampling_context(self, model: torch.nn.Module | None = None):
        """The context every forward of this engine runs in: eval mode, its precision, and
        for a LoRA model under bf16 the merged copies with the adapters off."""
        model = self.model if model is None else model
        device = next(model.parameters()).device
        stack = contextlib.ExitStack()
        stack.enter_context(eval_mode(model))
        merged = self.merged_copies(model)
        stack.enter_context(autocast(self.precision, device, substitutes=merged))
        if merged is not None:
            stack.enter_context(model.disable_adapter())
        return stack

    def merged_copies(self, model: torch.nn.Module, fresh: bool = False):
        """base weight -> bf16(W + its adapters) for each LoRA layer of `model` under bf16,
        made again when trained weights' copies were dropped since (an optimizer step: a
        fused AdamW moves no version counter) or any weight's version moved (a load); None
        where nothing is merged (fp32, no LoRA, a LoRA variant merging would change).
        fresh: made anew from `model`, not kept (the sync check's reference)."""
        if not (self.precision.bf16 and is_lora(model)):
            return None
        layers = [layer for _, layer in lora_layers(model)]
        if not layers or not all(plain_lora(layer) for layer in layers):
            return None
        made_of = (casts_forgotten(), *(p._version for layer in layers for p in layer.parameters()))
        current = self._merged is not None and self._merged[0] == made_of
        if current and model is self.model and not fresh:
            return self._merged[1]
        copies = WeakIdKeyDictionary()
        with torch.no_grad():
            for layer in layers:
                copies[layer.base_layer.weight] = merged_lora_weight(layer).to(torch.bfloat16)
        if model is self.model and not fresh:
            self._merged = (made_of, copies)
        return copies

    @torch.no_grad()
    def check_sync(self, model: torch.nn.Module) -> float:
        """Max |engine copy - the same made afresh from `model`| over every bf16 copy of a
        weight training moves: each LoRA-merged copy against a merge made now, each trained
        weight's cached cast against a cast made now. 0 when the copies are current (the same
        round-to-nearest of the same values); WeightSyncError above `sync_tolerance` (0: off).
        Every element of every such copy is compared, where a canary forward (the vLLM
        engine's) sees a few tokens' projection of them, and without two forwards per step.
        Records it in `last_sync_gap`."""
        if not self.sync_tolerance:
            return float("nan")
        engine = self.bf16_copies(self.model)  # the copies the next rollout samples from
        gap = 0.0
        for theirs, ours in zip(engine, self.bf16_copies(model, fresh=True), strict=True):
            gap = max(gap, float((theirs.float() - ours.float()).abs().max()))
        self.last_sync_gap = gap
        if not gap <= self.sync_tolerance:  # NaN fails too
            raise WeightSyncError(
                f"weight sync check: the hf engine's bf16 weight copies differ from the "
                f"trainer's weights rounded afresh by up to {gap:.3g} "
                f"(rollout.sync_tolerance={self.sync_tolerance:g}): the engine is not "
                "running the trainer's weights (a stale bf16 copy)"
            )
        return gap

    def bf16_copies(self, model: torch.nn.Module, fresh: bool = False) -> list[torch.Tensor]:
        """The bf16 tensors this engine's linears multiply in place of `model`'s weights that
        training moves (LoRA-merged copies, or the trained weights' cached casts), in the
        model's module order. fresh: each made anew, nothing cached."""
        merged = self.merged_copies(model, fresh)
        if merged is not None:
            return [merged[layer.base_layer.weight] for _, layer in lora_layers(model)]
        trained = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
        trained = [w for w in trained if w.requires_grad]
        if fresh:
            return [w.detach().to(torch.bfloat16) for w in trained]
        return [cached_cast(w, torch.bfloat16) for w in trained]

    @torch.no_grad()
    def generate(self, prompts: list[str], num_generations: int, params: SamplingParams) -> Rollout:
        G = num_generations
        prompt_ids = checked_prompt_ids(self, prompts, G, params)
        device = next(self.model.parameters()).device
        input_ids, attention_mask = left_padded(prompt_ids, self.pad_id)

        if self.episodes is not None:
            return self._generate_episodes(
                prompts, prompt_ids, input_ids, attention_mask, G, params
            )
        with self.sampling_context():
            completions, logprobs = decode(
                self.model,
                input_ids.to(device),
                attention_mask.to(device),
                G,
                params,
                self.stop_ids,
                self.pad_id,
                shared_prefill=self.shared_prefill,
            )
        return assemble_rollout(
            prompts,
            prompt_ids,
            completions,
            logprobs,
            G,
            self.stop_ids,
            self.pad_id,
            self.tokenizer,
        )

    def _generate_episodes(self, prompts, prompt_ids, input_ids, attention_mask, G, params):
        episodes = self._decode_episodes(prompts, input_ids, attention_mask, G, params)
        return assemble_episodes(
            prompts,
            prompt_ids,
            episodes,
            G,
            self.pad_id,
            self.tokenizer,
            self.episodes.functions,
        )

    @torch.no_grad()
    def sample_episodes(
        self, prompts: list[str], num_generations: int, params: SamplingParams, factory=None
    ) -> tuple[list[list[int]], list[Episode]]:
        """The engine's own record of G episodes per prompt: (prompt token ids, one Episode
        per sample: every token in the order fed, its log-prob, the turns). `factory`: an
        environment class to run instead of the configured one (the preflight's probe)."""
        prompt_ids = checked_prompt_ids(self, prompts, num_generations, params)
        input_ids, attention_mask = left_padded(prompt_ids, self.pad_id)
        episodes = self._decode_episodes(
            prompts, input_ids, attention_mask, num_generations, params, factory
        )
        return prompt_ids, episodes

    def _decode_episodes(self, prompts, input_ids, attention_mask, G, params, factory=None):
        device = next(self.model.parameters()).device
        rows, _ = self.episodes.new_rows(prompts, G, params, self.tokenizer, self.stop_ids, factory)
        may_stop = stop_string_tokens(self.tokenizer, rows[0].stop_strings)
        with self.sampling_context():
            decode_episodes(
                self.model,
                input_ids.to(device),
                attention_mask.to(device),
                G,
                params,
                rows,
                may_stop,
                shared_prefill=self.shared_prefill,
            )
        return [r.episode for r in rows]


def left_padded(prompt_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to a common length P (completions start at column P):
    (input_ids [n, P], attention_mask [n, P])."""
    P = max(len(p) for p in prompt_ids)
    input_ids = torch.full((len(prompt_ids), P), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(prompt_ids):
        input_ids[i, P - len(ids) :] = torch.tensor(ids)
        attention_mask[i, P - len(ids) :] = 1
    return input_ids, attention_mask


def decode_episodes(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    G: int,
    params: SamplingParams,
    episodes: list[EpisodeRow],
    may_stop,
    shared_prefill: bool = True,
) -> None:
    """The decode loop of multi-turn episodes: each step every row feeds one token, sampled
    or (in a tool turn) the tool turn's next token, into the same KV cache; the rows' own
    state machines (EpisodeRow) record the tokens, end turns, run the environment and end
    the episode. Finished rows leave the batch and the cache. One KV cache all along: the
    model sees exactly the token stream the Rollout will hold."""
    device = input_ids.device
    B = input_ids.shape[0] * G
    generator = torch.Generator(device=device).manual_seed(params.seed)
    out, mask, positions = prefill(model, input_ids, attention_mask, G, shared_prefill)
    cache = out.past_key_values
    next_position = positions[:, -1] + 1  # [B]
    rows = torch.arange(B, device=device)  # sample index of each batch row
    sharded = is_sharded(model)
    for _ in range(max(e.limits.max_tokens for e in episodes)):
        sampled, logp = sample_next(out.logits[:, -1], params, generator)  # [rows]
        fed = []
        for i, t, v in zip(rows.tolist(), sampled.tolist(), logp.tolist(), strict=True):
            row = episodes[i]
            fed.append(row.emit(t, v, may_stop) if not row.done else t)
        tokens = torch.tensor(fed, device=device)
        finished = torch.tensor([episodes[i].done for i in rows.tolist()], device=device)
        if sharded:  # FSDP2: every rank runs the same forwards, finished rows stay
            left = torch.tensor(sum(not e.done for e in episodes), device=device)
            torch.distributed.all_reduce(left)
            if int(left) == 0:
                break
        else:
            stay = ~finished
            if not bool(stay.any()):
                break
            rows, tokens, mask, next_position = leave_batch(
                stay, cache, rows, tokens, mask, next_position
            )
        out, mask, next_position = feed(model, cache, tokens, mask, next_position)
    for row in episodes:  # the budget ran out mid-turn
        if not row.done:
            row.close_truncated()


def leave_batch(stay, cache, rows, tokens, mask, next_position):
    """Finished rows leave the batch and the KV cache: keep the rows where `stay` [b] is true
    -> (rows [b'], tokens [b'], mask [b', t], next_position [b'])."""
    if bool(stay.all()):
        return rows, tokens, mask, next_position
    index = stay.nonzero().squeeze(1)
    cache.batch_select_indices(index)
    return rows[index], tokens[index], mask[index], next_position[index]


def feed(model, cache, tokens, mask, next_position):
    """One decode step: each row's token [b] at its next position into the cache ->
    (model output, mask [b, t+1], next positions [b])."""
    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    out = model(
        input_ids=tokens[:, None],
        attention_mask=mask,
        position_ids=next_position[:, None],
        past_key_values=cache,
        use_cache=True,
    )
    return out, mask, next_position + 1


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits [n, V] -> (tokens [n] long, their log-probs [n] float32
    under the untruncated distribution at the sampling temperature; at 1 for greedy)."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / params.temperature  # [n, V]
    logp = torch.log_softmax(scaled, dim=-1)
    kept = truncate(scaled, params.top_k, params.top_p)
    tokens = SAMPLERS[params.sampler](torch.softmax(kept, dim=-1), generator)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature-scaled logits [n, V] with everything outside the top-k, then outside the
    smallest set of probability >= top_p, set to -inf (top_k 0 / top_p 1: off)."""
    kept = scaled
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # [n, 1]
        kept = kept.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(kept, dim=-1)
        cumulative = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        kept = kept.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return kept


# Models whose KV cache cannot be repeated per group (found by their first rollout).
_CACHE_NOT_PLAIN: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def is_sharded(model) -> bool:
    return type(model).__name__.startswith("FSDP")


def prefill(model, input_ids, attention_mask, G: int, shared_prefill: bool = True):
    """The prompts' forward for their G samples each: (output with the KV cache and the
    last position's logits [B, 1, V], attention mask [B, P], position ids [B, P])."""
    signature = inspect.signature(base_model(model).forward)  # peft: **kwargs reach the base
    keep_logits = "logits_to_keep" in signature.parameters
    last_only = {"logits_to_keep": 1} if keep_logits else {}

    mask = attention_mask.repeat_interleave(G, dim=0)  # [B, P]
    positions = position_ids(mask)  # [B, P]
    cache = None
    shareable = model not in _CACHE_NOT_PLAIN
    if shared_prefill and shareable and G > 1 and keep_logits and not is_sharded(model):
        # The G samples of a prompt share its whole forward, the first token's distribution
        # included: one row per prompt, repeated G times.
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions[::G],
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.past_key_values
        if plain_kv_cache(cache):
            cache.batch_repeat_interleave(G)
            out.logits = out.logits.repeat_interleave(G, dim=0)
        else:  # sliding-window, hybrid: not a plain per-layer concatenation
            _CACHE_NOT_PLAIN.add(model)  # seen once: later rollouts prefill per row at once
            cache = None
    if cache is None:
        out = model(
            input_ids=input_ids.repeat_interleave(G, dim=0),
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **last_only,
        )
    return out, mask, positions


def decode(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    G: int,
    params: SamplingParams,
    stop_ids: list[int],
    pad_id: int,
    shared_prefill: bool = True,
) -> tuple[list[list[int]], list[list[float]]]:
    """G completions per prompt row of input_ids [n, P] (left-padded), rows in prompt order,
    each cut after its first stop token. Returns (token ids, their log-probs) per sample."""
    device = input_ids.device
    B = input_ids.shape[0] * G
    generator = torch.Generator(device=device).manual_seed(params.seed)
    # FSDP2: every rank runs the same forwards (collectives inside), so no rank leaves the
    # loop early and finished rows stay in the batch.
    sharded = is_sharded(model)
    out, mask, positions = prefill(model, input_ids, attention_mask, G, shared_prefill)
    cache = out.past_key_values
    next_position = positions[:, -1] + 1  # [B]
    rows = torch.arange(B, device=device)  # sample index of each batch row
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    stops = torch.tensor(stop_ids, device=device)
    steps = []  # per step: (sample indices, tokens, log-probs) of the rows still writing
    for step in range(params.max_completion_length):
        tokens, logp = sample_next(out.logits[:, -1], params, generator)  # [rows]
        writing = ~finished[rows]
        steps.append((rows[writing], tokens[writing], logp[writing]))
        finished[rows[writing & torch.isin(tokens, stops)]] = True
        if step + 1 == params.max_completion_length:
            break
        if sharded:
            left = finished.logical_not().sum()
            torch.distributed.all_reduce(left)
            if int(left) == 0:
                break
            tokens = tokens.masked_fill(finished[rows], pad_id)
        else:
            stay = ~finished[rows]
            if not bool(stay.any()):
                break
            rows, tokens, mask, next_position = leave_batch(
                stay, cache, rows, tokens, mask, next_position
            )
        out, mask, next_position = feed(model, cache, tokens, mask, next_position)

    completions: list[list[int]] = [[] for _ in range(B)]
    logprobs: list[list[float]] = [[] for _ in range(B)]
    for sample, token, lp in steps:
        for i, t, v in zip(sample.tolist(), token.tolist(), lp.tolist(), strict=True):
            completions[i].append(t)
            logprobs[i].append(v)
    return completions, logprobs
