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
import functools
import inspect
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from grpolab.core import position_ids
from grpolab.model.decoder import (
    Decoder,
    KVCache,
    PackedLinears,
    cpu_float32_attention,
    verify_decoder,
)
from grpolab.model.lora import is_lora, lora_layers, merged_bf16, plain_lora
from grpolab.model.policy import base_model, eval_mode, plain_kv_cache
from grpolab.model.precision import (
    FP32,
    Precision,
    autocast,
    cached_cast,
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

log = logging.getLogger("grpolab")

# Models whose decode steps run through their forward, the reason logged once.
_DECODER_REFUSED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


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
    # Decode steps through grpolab's own step on a preallocated KV cache (`model.decoder`:
    # the same arithmetic on the same weights without the module stack) where the model's
    # structure allows, verified once per model against its forward; off: every step
    # through the model's forward.
    fast_decode: bool = key(True, resume_free=True)

    def memory_mb(self, weights_mb: float, kv_cache_mb: float, device) -> float:
        """What sampling holds beside the training model: the batch's KV cache (the engine
        samples with the trainer's own weights) and, for the decode step on a CPU, its
        packed copy of the weights (`model.decoder.PackedLinears`: at most their own size,
        half of it in bf16)."""
        packed = weights_mb if self.fast_decode and device.type == "cpu" else 0.0
        return kv_cache_mb + packed


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
        fast_decode: bool = True,
    ):
        self.model = model
        self.precision = precision
        # The copies hold the trainer's weights rounded once: current ones equal a fresh
        # rounding exactly (check_sync).
        self.sync_tolerance = (
            default_sync_tolerance("float32") if sync_tolerance is None else sync_tolerance
        )
        self.last_sync_gap: float | None = None  # bf16: the latest sync's copy gap
        self.episodes = episodes  # None: single-turn
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.shared_prefill = shared_prefill
        self.fast_decode = fast_decode
        self._packs: PackedLinears | None = None  # the decode step's packed weights
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
        section,  # the config's rollout section (rollout.config.RolloutConfig)
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
            shared_prefill=section.hf.shared_prefill,
            episodes=episodes,
            precision=precision,
            sync_tolerance=section.sync_tolerance,
            fast_decode=section.hf.fast_decode,
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
        fresh = fresh or model is not self.model
        copies = WeakIdKeyDictionary()
        for layer in layers:  # the trainer's bf16 forwards multiply the same copies
            copies[layer.base_layer.weight] = merged_bf16(layer, fresh)
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
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        args = (input_ids, attention_mask, G, params, self.stop_ids, self.pad_id)
        decoder = self.decoder(input_ids, attention_mask)
        if decoder is None:
            with self.sampling_context():
                completions, logprobs = decode(self.model, *args, self.shared_prefill)
        else:  # the prefill in the sampling context, the steps in the decoder's own
            with eval_mode(self.model):
                completions, logprobs = decode(
                    self.model, *args, self.shared_prefill, decoder, self.sampling_context
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

    def decoder(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Decoder | None:
        """The decode step this engine's single-turn rollouts run (`model.decoder`), made for
        the weights it samples now, or None where the model's forward decodes: fast_decode
        off, a sharded model, a model the step does not reproduce (verified once per model
        on the batch's first prompt), a LoRA variant that is not merged under bf16."""
        model = self.model
        if not self.fast_decode or is_sharded(model):
            return None
        probe = input_ids[0][attention_mask[0].bool()]
        with eval_mode(model):  # the weights as the step applies them, not packed
            reason = verify_decoder(model, probe, functools.partial(plain_projection, None))
        if reason is not None:
            if model not in _DECODER_REFUSED:
                _DECODER_REFUSED.add(model)
                log.info("hf engine: decoding through the model's forward: %s", reason)
            return None
        if self._packs is None:
            self._packs = PackedLinears(rows=input_ids.shape[0])
        if not self.precision.bf16:
            project = functools.partial(plain_projection, self._packs)
            return Decoder(model, project, next(model.parameters()).dtype)
        merged = self.merged_copies(model)
        if merged is None and is_lora(model):
            return None  # adapters that are not merged run through the model's forward
        project = functools.partial(bf16_projection, self._packs, merged)
        return Decoder(model, project, torch.bfloat16, cpu_float32_attention(input_ids.device))

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
    # (x / 1 is x exactly: no pass over [n, V] at the usual temperature)
    scaled = logits if params.temperature == 1 else logits / params.temperature  # [n, V]
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


def prefill(
    model, input_ids, attention_mask, G: int, shared_prefill: bool = True, repeat_cache=True
):
    """The prompts' forward for their G samples each: (output with the KV cache and the
    last position's logits [B, 1, V], attention mask [B, P], position ids [B, P]). When the
    prefill ran once per prompt and not repeat_cache, the cache and logits keep one row per
    prompt ([n, ...]: whoever reads them repeats them)."""
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
            if repeat_cache:
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
    decoder: Decoder | None = None,
    prefill_context=contextlib.nullcontext,
) -> tuple[list[list[int]], list[list[float]]]:
    """G completions per prompt row of input_ids [n, P] (left-padded), rows in prompt order,
    each cut after its first stop token. Returns (token ids, their log-probs) per sample.
    decoder: the steps after the prefill run through it on a preallocated cache
    (`CacheSteps`), else through the model's forward (`ForwardSteps`); prefill_context: what
    the prefill runs in (the engine's sampling context, when the steps run outside it)."""
    # FSDP2: every rank runs the same forwards (collectives inside), so no rank leaves the
    # loop early and finished rows stay in the batch.
    sharded = is_sharded(model)
    with prefill_context():
        out, mask, positions = prefill(
            model, input_ids, attention_mask, G, shared_prefill, repeat_cache=decoder is None
        )
    if decoder is None:
        steps = ForwardSteps(model, out, mask, positions)
    else:
        length = input_ids.shape[1] + params.max_completion_length
        steps = CacheSteps(decoder, out, mask, positions, length)
    generator = torch.Generator(device=input_ids.device).manual_seed(params.seed)
    B = input_ids.shape[0] * G
    rows = torch.arange(B, device=input_ids.device)  # sample index of each batch row
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    stops = torch.tensor(stop_ids, device=input_ids.device)
    drawn = []  # per step: (sample indices, tokens, log-probs) of the rows still writing
    for step in range(params.max_completion_length):
        tokens, logp = draw_in_sample_order(steps.logits, rows, params, generator)  # [rows]
        writing = ~finished[rows]
        drawn.append((rows[writing], tokens[writing], logp[writing]))
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
            kept = steps.keep(stay)
            if kept is not None:
                rows, tokens = rows[kept], tokens[kept]
        steps.feed(tokens)
    return per_sample(drawn, B)


def draw_in_sample_order(logits, rows, params: SamplingParams, generator):
    """sample_next on logits [b, V] whose rows hold samples `rows` [b] in any order: the rows
    drawn in sample order, so that the generator's numbers go to the same samples however
    the batch is ordered (CacheSteps moves rows) -> (tokens [b], log-probs [b])."""
    if rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all()):
        return sample_next(logits, params, generator)
    order = torch.argsort(rows)
    tokens, logp = sample_next(logits[order], params, generator)
    return tokens.new_empty(tokens.shape).index_copy_(0, order, tokens), logp.new_empty(
        logp.shape
    ).index_copy_(0, order, logp)


def per_sample(drawn, B: int) -> tuple[list[list[int]], list[list[float]]]:
    """The decode loop's per-step draws -> (token ids, log-probs) per sample, in order."""
    completions: list[list[int]] = [[] for _ in range(B)]
    logprobs: list[list[float]] = [[] for _ in range(B)]
    for sample, token, lp in drawn:
        for i, t, v in zip(sample.tolist(), token.tolist(), lp.tolist(), strict=True):
            completions[i].append(t)
            logprobs[i].append(v)
    return completions, logprobs


class ForwardSteps:
    """Decode steps through the model's own forward and KV cache (any model): `logits` [b, V]
    of the rows still in the batch, `keep` (rows leave the batch and the cache), `feed`."""

    def __init__(self, model, out, mask: torch.Tensor, positions: torch.Tensor):
        self.model, self.cache = model, out.past_key_values
        self.logits = out.logits[:, -1]
        self.mask, self.next_position = mask, positions[:, -1] + 1  # [b, t], [b]

    def keep(self, stay: torch.Tensor) -> torch.Tensor | None:
        """Keep the rows where stay [b] is true -> their indices, None when all stay."""
        if bool(stay.all()):
            return None
        index = stay.nonzero().squeeze(1)
        self.cache.batch_select_indices(index)
        self.mask, self.next_position = self.mask[index], self.next_position[index]
        return index

    def feed(self, tokens: torch.Tensor) -> None:
        out, self.mask, self.next_position = feed(
            self.model, self.cache, tokens, self.mask, self.next_position
        )
        self.logits = out.logits[:, -1]


class CacheSteps:
    """Decode steps through a `Decoder` on a preallocated `KVCache` filled from the prefill,
    with room for `length` positions; the same interface as ForwardSteps (rows leave by
    taking each other's place: `keep` returns the new order)."""

    def __init__(self, decoder: Decoder, out, mask, positions, length: int):
        repeat = mask.shape[0] // out.logits.shape[0]  # G when the prefill ran once per prompt
        self.decoder = decoder
        self.cache = KVCache.from_prefill(out.past_key_values, mask, repeat, length)
        self.logits = out.logits[:, -1].repeat_interleave(repeat, dim=0)
        self.next_position = positions[:, -1] + 1  # [b]

    def keep(self, stay: torch.Tensor) -> torch.Tensor | None:
        order = self.cache.keep(stay)
        if order is not None:
            self.next_position = self.next_position[order]
        return order

    def feed(self, tokens: torch.Tensor) -> None:
        self.logits = self.decoder.step(tokens, self.next_position, self.cache)
        self.next_position = self.next_position + 1


def plain_projection(packs: PackedLinears | None, module: torch.nn.Module):
    """The decode step's function for a linear layer in the model's own precision: a plain
    Linear's weight (packed, unless packs is None) and bias; a plain LoRA layer's base the
    same way, then its adapters added as peft adds them (eval mode: no dropout); any other
    layer called."""
    linear = packs.linear if packs is not None else PackedLinears.unpacked
    if type(module) is torch.nn.Linear:
        return linear(module.weight, module.bias)
    if not (hasattr(module, "base_layer") and plain_lora(module)):
        return module
    base = linear(module.base_layer.weight, module.base_layer.bias)
    adapters = [
        (module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name])
        for name in module.active_adapters
        if name in module.lora_A
    ]

    def lora(x: torch.Tensor) -> torch.Tensor:
        result = base(x)
        for a, b, scaling in adapters:
            result = result + F.linear(F.linear(x, a), b) * scaling
        return result

    return lora


def bf16_projection(packs: PackedLinears, merged, module: torch.nn.Module):
    """The decode step's function for a linear layer under bf16, what the sampling context's
    autocast multiplies: the LoRA-merged copy of its base weight where there is one (`merged`),
    else the cached bf16 copy of its weight (packed either way); the bias in bf16, as
    autocast casts it."""
    base = getattr(module, "base_layer", module)
    weight = base.weight
    if merged is not None and weight in merged:
        low = merged[weight]
    else:
        low = cached_cast(weight, torch.bfloat16)
    bias = None if base.bias is None else base.bias.to(torch.bfloat16)
    return packs.linear(low, bias)
