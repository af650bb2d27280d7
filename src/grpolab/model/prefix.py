"""One forward per distinct prompt: the body runs a group's prompt once and its G
completions against that prompt's keys and values.

The G completions of a prompt share its tokens, so the body can run the prompt once per group
and the completions against that prompt's keys and values, repeated G times in the batch
(an index, so backward sums the G rows' gradients into the one prompt forward: the same
gradient as G separate prompt forwards). Exact up to float summation order; on GRPO batches
(prompt ~ half the tokens, G = 8-16) it removes most of the prompt's share of the work. The
completions run in buckets of similar length (`suffix_buckets`), each padded to its longest.
Verified once per model against the plain forward (`verify_shared_prefix`); also the home of
the body's plain forward (`body_hidden`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from grpolab.model.policy import plain_kv_cache
from grpolab.model.verdict import gap_beyond_tolerance, verdict_once

# --- The body's plain forward -----------------------------------------------------------------


def body_hidden(body, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """The body's final hidden states [B, T, H], one forward per row, no cache."""
    out = body(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


# --- The plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefixPlan:
    """Columns [0, length) are the shared prefix; rows `firsts` [U] hold the distinct prefixes
    and `owner` [B] maps each row to its prefix's position in `firsts`."""

    length: int
    firsts: torch.Tensor  # [U] long
    owner: torch.Tensor  # [B] long, values in [0, U)


def plan_shared_prefix(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor
) -> PrefixPlan | None:
    """Runs of consecutive rows with identical prompt columns, or None when sharing would not
    pay (fewer than two rows per distinct prompt on average) or does not apply.

    The prefix ends where the first completion token of the batch starts; its last column must
    be a real token in every row (a left-padded prompt layout, as every engine returns)."""
    B = input_ids.shape[0]
    starts = completion_mask.any(dim=0).nonzero()
    if B < 2 or starts.numel() == 0:
        return None
    length = int(starts[0])
    if length < 2 or not bool(attention_mask[:, length - 1].all()):
        return None
    ids, attn = input_ids[:, :length], attention_mask[:, :length]
    same = (ids[1:] == ids[:-1]).all(dim=1) & (attn[1:] == attn[:-1]).all(dim=1)  # [B-1]
    is_first = torch.cat([same.new_ones(1), ~same])  # [B]
    firsts = is_first.nonzero().squeeze(1)  # [U]
    if 2 * firsts.numel() > B:
        return None
    return PrefixPlan(length, firsts, is_first.long().cumsum(0) - 1)


MAX_SUFFIX_BUCKETS = 4
MIN_BUCKET_SAVING = 0.125  # a bucket must save this share of the unbucketed positions


def suffix_buckets(needed: torch.Tensor) -> list[torch.Tensor]:
    """Rows grouped so that each group pads only to its own longest row.

    needed [B] long: suffix columns each row needs. Rows are sorted longest first and a group
    is split at the cut that saves the most padded positions, while a cut saves at least
    MIN_BUCKET_SAVING of the one-group positions (each group costs a forward of its own),
    up to MAX_SUFFIX_BUCKETS groups. Returns row indices per group, longest group first."""
    order = torch.argsort(needed, descending=True, stable=True)
    lengths = needed[order].tolist()  # descending
    total = len(lengths) * (lengths[0] if lengths else 0)
    spans = [(0, len(lengths))]
    while len(spans) < MAX_SUFFIX_BUCKETS:
        best = (MIN_BUCKET_SAVING * total, None, None)
        for k, (a, b) in enumerate(spans):
            # A cut before i pads [a, i) to lengths[a] and [i, b) to lengths[i].
            for i in range(a + 1, b):
                if lengths[i] == lengths[i - 1]:
                    continue
                saving = (b - i) * (lengths[a] - lengths[i])
                if saving > best[0]:
                    best = (saving, k, i)
        _, k, i = best
        if k is None:
            break
        a, b = spans[k]
        spans[k : k + 1] = [(a, i), (i, b)]
    return [order[a:b] for a, b in spans]


def prefix_hidden(
    body, input_ids, attention_mask, position_ids, plan: PrefixPlan, replay: bool = False
):
    """Final hidden states at positions [plan.length - 1, T - 1) -> [B, T - length, H]: what
    predicts the tokens in columns [length, T), zeros past each row's last real token. None
    if the body keeps no plain KV cache. `replay`: caches that checkpointed layers may run
    twice (`_replayable_cache`), for a model under gradient checkpointing."""
    from transformers.cache_utils import DynamicCache

    P = plan.length
    B, T = input_ids.shape
    rows = plan.firsts
    if replay and not plain_kv_cache(DynamicCache(config=body.config)):
        return None
    # Under checkpointing transformers turns use_cache off; a cache passed in is still used.
    given = _replayable_cache(body.config.num_hidden_layers) if replay else None
    with _cache_through_checkpoints(body, replay):
        out = body(
            input_ids=input_ids[rows, :P],
            attention_mask=attention_mask[rows, :P],
            position_ids=position_ids[rows, :P],
            past_key_values=given,
            use_cache=not replay,
        )
    prefix = given if replay else out.past_key_values  # [U, heads, P, d] per layer
    if not replay and not plain_kv_cache(prefix):
        return None
    last = out.last_hidden_state[:, -1]  # [U, H], predicts column P
    window = last.new_zeros(B, T - P, last.shape[-1])
    # index_select, not last[plan.owner]: with repeated indices the backward of advanced
    # indexing accumulates in a thread-dependent order on CPU; index_select's does not.
    window[:, 0] = last.index_select(0, plan.owner)
    # Row r's hidden states are needed up to its last real token but one (that token's
    # prediction lies past the row), i.e. suffix columns [P, P + needed[r]).
    real = attention_mask[:, P:].bool()  # [B, T-P]
    columns = torch.arange(1, T - P + 1, device=real.device)
    needed = ((real * columns).amax(dim=1) - 1).clamp(min=0)  # [B]
    for bucket in suffix_buckets(needed):
        width = int(needed[bucket].max())
        if width == 0:
            continue
        owners = plan.owner[bucket]  # this bucket's rows' prompts, by index
        selected = [
            (layer.keys.index_select(0, owners), layer.values.index_select(0, owners))
            for layer in prefix.layers
        ]
        if replay:
            cache = _replayable_cache(len(selected), selected)
        else:
            cache = DynamicCache()
            for i, (keys, values) in enumerate(selected):
                cache.update(keys, values, i)
        with _cache_through_checkpoints(body, replay):
            out = body(
                input_ids=input_ids[bucket, P : P + width],
                attention_mask=attention_mask[bucket, : P + width],
                position_ids=position_ids[bucket, P : P + width],
                past_key_values=cache,
                use_cache=not replay,
            )
        window[bucket, 1 : 1 + width] = out.last_hidden_state  # [b, width, H]
    return window


def _replayable_cache(num_layers: int, bases: list | None = None):
    """A plain KV cache whose layers may be replayed: each layer's update returns its base
    (the prompt's keys and values, or nothing) followed by the new ones, the same on every
    call. A checkpointed decoder layer runs its forward a second time in backward; a
    DynamicLayer would append the keys again there and hand attention a longer cache."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class ReplayableLayer(DynamicLayer):
        def __init__(self, base):
            super().__init__()
            self.base = base
            if base is not None:
                self.lazy_initialization(*base)
                self.keys, self.values = base

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self.base is None:
                self.keys, self.values = key_states, value_states
            else:
                self.keys = torch.cat([self.base[0], key_states], dim=-2)
                self.values = torch.cat([self.base[1], value_states], dim=-2)
            return self.keys, self.values

    cache = DynamicCache()
    cache.layers = [ReplayableLayer(None if bases is None else bases[i]) for i in range(num_layers)]
    return cache


@contextlib.contextmanager
def _cache_through_checkpoints(body, replay: bool):
    """transformers' checkpointed layers drop a KV cache unless told that they only read
    it; a replayable cache is read-only in that sense, so they keep it inside the block."""
    wanted = "_can_checkpoint_with_cache"
    layers = [m for m in body.modules() if hasattr(m, wanted)] if replay else []
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache  # back to the class's own value


# Verdict per model: None when one-forward-per-prompt was checked against the plain forward.
_PREFIX_VERIFIED: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = (
    weakref.WeakKeyDictionary()
)


def verify_shared_prefix(model, body, input_ids, attention_mask, position_ids, plan) -> str | None:
    """Compare with the plain forward on one shared prefix and two suffixes, once per model."""

    def probe() -> str | None:
        first = int((plan.owner[1:] == plan.owner[:-1]).nonzero()[0])  # a run of >= 2 rows
        rows = torch.tensor([first, first + 1], device=input_ids.device)
        zeros = torch.zeros(2, dtype=torch.long, device=rows.device)
        small = PrefixPlan(plan.length, rows[:1], zeros)
        ids, attn, pos = input_ids[rows], attention_mask[rows], position_ids[rows]
        expected = body_hidden(body, ids, attn, pos)[:, plan.length - 1 : -1]
        keep = attn[:, plan.length :].bool()  # positions that predict a real token
        for replay in (False, True):  # the caches of a plain and of a checkpointed model
            got = prefix_hidden(body, ids, attn, pos, small, replay)
            if got is None:
                return "shared-prefix forward: its KV cache is not a plain per-layer concatenation"
            err = gap_beyond_tolerance(got[keep], expected[keep])
            if err is not None:
                return f"shared-prefix forward differs from one by {err:.3g}"
        return None

    return verdict_once(_PREFIX_VERIFIED, model, "the shared-prefix forward failed", probe)


def checkpointing(model) -> bool:
    return model.training and getattr(model, "is_gradient_checkpointing", False)


def shared_prefix_status(model, input_ids, attention_mask, completion_mask) -> str | None:
    """None when `token_logprobs` (fused) runs this batch one forward per prompt, else why not.
    Call after a `token_logprobs` call on the same model (the first one verifies the model)."""
    if plan_shared_prefix(input_ids, attention_mask, completion_mask) is None:
        return "fewer than two rows per distinct prompt"
    return _PREFIX_VERIFIED.get(model, "not yet verified on this model")
