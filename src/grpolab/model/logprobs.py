"""Token log-probs for the trainer: `token_logprobs`, the contract of
`core.sequence_logprobs`, dispatched to the fused path or the plain one.

The fused path splits the model into its body (everything up to and including the final
norm) and the lm-head weight W [V, H] (`split_model`, checked once per model against the
model's own logits), runs the body (one forward per prompt where consecutive rows share
one: `prefix.py`) and projects only completion positions through the chunked lm-head
(`lmhead.py`), never materialising [B, T, V]. `impl="naive"` is the plain code
(`core.sequence_logprobs`), kept as the reference and taken by any model the split does
not reproduce.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from grpolab import core
from grpolab.model.lmhead import (
    MIN_VOCAB_CHUNK,
    Chunks,
    choose_chunks,
    fused_token_logprobs,
    kept_chunks,
)
from grpolab.model.packed import attention_kind, pack_rows, packed_hidden, verify_packing
from grpolab.model.precision import cached_cast
from grpolab.model.prefix import (
    MAX_SUFFIX_BUCKETS,
    PrefixPlan,
    body_hidden,
    checkpointing,
    plan_shared_prefix,
    prefix_hidden,
    shared_prefix_status,
    suffix_buckets,
    verify_shared_prefix,
)
from grpolab.model.verdict import gap_beyond_tolerance, verdict_once

# The public names of the three files, importable from here.
__all__ = [
    "IMPLS",
    "MAX_SUFFIX_BUCKETS",
    "MIN_VOCAB_CHUNK",
    "Chunks",
    "PrefixPlan",
    "Split",
    "choose_chunks",
    "fused_token_logprobs",
    "kept_chunks",
    "plan_shared_prefix",
    "shared_prefix_status",
    "split_model",
    "suffix_buckets",
    "token_logprobs",
]

log = logging.getLogger("grpolab")

IMPLS = ("fused", "naive")

# Config attributes of models whose logits are not `final_hidden @ W^T` (soft-capping,
# logit scaling, muP width scaling): these models take the naive path.
LOGIT_TRANSFORMS = (
    "final_logit_softcapping",  # Gemma 2/3
    "logit_scale",  # Cohere
    "logits_scaling",  # Granite
    "dim_model_base",  # MiniCPM (divides the hidden state before the head)
    "mup_width_multiplier",
    "output_multiplier_scale",
)


# --- Splitting a model into body and lm-head ---------------------------------------------------


@dataclass
class Split:
    """A causal LM as body (up to and including the final norm) and lm-head weight [V, H].

    `reason` is None when the split reproduces the model's logits; otherwise it says why
    the model must take the naive path (and body / weight may be None)."""

    body: torch.nn.Module | None
    weight: torch.Tensor | None
    reason: str | None = None


def split_model(model: torch.nn.Module) -> Split:
    """Find the decoder body and the lm-head weight generically (Llama/Qwen2-style models),
    or say why the logits are not `body(...).last_hidden_state @ W^T` for this model."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return Split(
            None, None, "DistributedDataParallel wrapper: calling its body skips the gradient sync"
        )
    if type(model).__name__.startswith("FSDP"):  # FSDP2 fully_shard renames the class
        return Split(None, None, "FSDP2-sharded root: the lm-head weight is a shard")
    name = type(model).__name__
    config = getattr(model, "config", None)
    for attr in LOGIT_TRANSFORMS:
        value = getattr(config, attr, None)
        if value is not None and value is not False and value != 1:
            return Split(None, None, f"{name} transforms its logits (config.{attr}={value!r})")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        return Split(None, None, f"{name} has no output embeddings (get_output_embeddings())")
    if type(head) is not torch.nn.Linear:
        return Split(None, None, f"{name}'s lm-head is a {type(head).__name__}, not a plain Linear")
    if head.bias is not None:
        return Split(None, None, f"{name}'s lm-head has a bias")
    body = None
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            body = get_decoder()
        except (AttributeError, NotImplementedError, ValueError):
            body = None
    if body is None or body is model:
        prefix = getattr(model, "base_model_prefix", "")
        body = getattr(model, prefix, None) if prefix else None
    if body is None or body is model:
        return Split(None, None, f"{name}: no decoder body (get_decoder() / base_model_prefix)")
    return Split(body, head.weight)


# Verdict per model object: None when the split was checked against model(...).logits.
_VERIFIED: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


def _verify_split(model, split: Split, input_ids, attention_mask) -> str | None:
    """Compare the split's logits with the model's own on a short slice of the batch, once
    per model: catches what no config attribute announces (a scaled head, a wrapper)."""

    def probe() -> str | None:
        real = input_ids[0][attention_mask[0].bool()]
        ids = (real if real.numel() else input_ids[0])[:16][None]  # [1, <=16], no padding
        attn = torch.ones_like(ids)
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        expected = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
        got = torch.nn.functional.linear(body_hidden(split.body, ids, attn, pos), split.weight)
        if got.shape != expected.shape:
            return f"body + lm-head give logits {tuple(got.shape)}, model {tuple(expected.shape)}"
        if (err := gap_beyond_tolerance(got, expected)) is not None:
            return f"body + lm-head differ from the model's logits by {err:.3g}"
        return None

    return verdict_once(_VERIFIED, model, "calling the body failed", probe)


# --- The API the trainer calls -----------------------------------------------------------------


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    impl: str = "fused",
    return_entropy: bool = False,
    prompt_length: int | None = None,
    shared_prefix: bool = True,
    packed: bool = False,
):
    """Log-prob of each sampled token at the sampling temperature: the contract of
    `core.sequence_logprobs`, with zeros where the mask is 0.

    input_ids, attention_mask, completion_mask: [B, T]. Returns (logp [B, T-1] float32,
    mask [B, T-1] float32), plus entropy [B, T-1] float32 when return_entropy; logp[:, t]
    is the log-prob of input_ids[:, t+1], mask[:, t] = completion_mask[:, t+1].
    impl="fused" projects only completion positions through the lm-head in tiles;
    impl="naive" is the plain full-logits path (`core.sequence_logprobs`).
    prompt_length: the column where completions start (all rows), if known.
    shared_prefix: on the fused path, run the body once per distinct prompt of consecutive
    rows (a GRPO group) and the completions against its cached keys and values.
    packed: on the fused path, run the rows as one sequence without padding, each group's
    prompt once (`packed.py`); the same values as padded, to rounding.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {list(IMPLS)}")
    core._check_same_shape(
        input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask
    )
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, T] with T >= 2, got {tuple(input_ids.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    T = input_ids.shape[1]
    if prompt_length is not None:
        if isinstance(prompt_length, bool) or not isinstance(prompt_length, int):
            raise ValueError(f"prompt_length must be an int or None, got {prompt_length!r}")
        if not 1 <= prompt_length <= T - 1:
            raise ValueError(
                f"prompt_length must be in [1, {T - 1}] for T={T}, got {prompt_length}"
            )
        if completion_mask[:, :prompt_length].any():
            raise ValueError(
                f"prompt_length={prompt_length}, but completion_mask has tokens before that column"
            )

    if impl == "fused":
        split = split_model(model)
        reason = split.reason
        device_type = input_ids.device.type
        # Under autocast the model's own head computes its logits in autocast's dtype; the
        # tiles do the same (hidden states and weight cast to it, float32 from there on).
        head_dtype = None
        if torch.is_autocast_enabled(device_type):
            head_dtype = torch.get_autocast_dtype(device_type)
        if reason is None:
            reason = _verify_split(model, split, input_ids, attention_mask)
        if reason is None:
            return _fused(
                model,
                split,
                input_ids,
                attention_mask,
                completion_mask,
                temperature,
                return_entropy,
                prompt_length,
                shared_prefix,
                head_dtype,
                packed,
            )
        _warn_once(model, reason)
    return _naive(model, input_ids, attention_mask, completion_mask, temperature, return_entropy)


_WARNED: weakref.WeakKeyDictionary[torch.nn.Module, set[str]] = weakref.WeakKeyDictionary()


def _warn_once(
    model: torch.nn.Module, reason: str, what: str = "fused path unavailable, using naive"
) -> None:
    """Each reason once per model: the trainer calls this every step."""
    seen = _WARNED.setdefault(model, set())
    if reason not in seen:
        seen.add(reason)
        log.warning("logprobs: %s: %s", what, reason)


def _naive(model, input_ids, attention_mask, completion_mask, temperature, return_entropy):
    """`core.sequence_logprobs` with zeros where the mask is 0 (the entropy too)."""
    logp, mask, *entropy = core.sequence_logprobs(
        model, input_ids, attention_mask, completion_mask, temperature, return_entropy
    )
    valid = mask.bool()
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    if not return_entropy:
        return logp, mask
    return logp, mask, torch.where(valid, entropy[0], torch.zeros_like(entropy[0]))


def _fused(
    model,
    split,
    input_ids,
    attention_mask,
    completion_mask,
    temperature,
    return_entropy,
    prompt_length,
    shared_prefix=True,
    head_dtype=None,
    packed=False,
):
    mask = completion_mask[:, 1:].float()  # [B, T-1]
    valid = mask.bool()
    args = (model, split.body, input_ids, attention_mask, completion_mask)
    h = _packed_hidden(*args) if packed else None  # [N, H]: each loss token's predictor
    if h is None:
        h = _padded_hidden(*args, prompt_length, shared_prefix)
    targets = input_ids[:, 1:][valid]  # [N]
    weight = split.weight
    if head_dtype is not None:  # autocast: the head's matmul in its dtype, as the model's own
        h, weight = h.to(head_dtype), cached_cast(weight, head_dtype)
    out = fused_token_logprobs(h, weight, targets, temperature, return_entropy=return_entropy)
    logp_n, entropy_n = out if return_entropy else (out, None)
    logp = logp_n.new_zeros(mask.shape).masked_scatter(valid, logp_n)  # [B, T-1]
    if not return_entropy:
        return logp, mask
    return logp, mask, entropy_n.new_zeros(mask.shape).masked_scatter(valid, entropy_n)


def _padded_hidden(
    model, body, input_ids, attention_mask, completion_mask, prompt_length, shared_prefix
) -> torch.Tensor:
    """The final hidden states that predict the loss tokens [N, H], in the row-major order
    of completion_mask[:, 1:], from the padded batch: one forward per prompt where rows
    share one (`prefix.py`), else one per row."""
    position_ids = core.position_ids(attention_mask)
    mask = completion_mask[:, 1:].float()  # [B, T-1]
    window = None  # final hidden states at positions [start, T-1), [B, T-1-start, H]
    plan = None
    if shared_prefix:
        plan = plan_shared_prefix(input_ids, attention_mask, completion_mask)
    if plan is not None:
        args = (body, input_ids, attention_mask, position_ids)
        reason = verify_shared_prefix(model, *args, plan)
        if reason is None:
            window = prefix_hidden(*args, plan, replay=checkpointing(model))
        else:
            _warn_once(model, reason, "one forward per prompt unavailable, one per row")
    if window is not None:
        start = plan.length - 1
    else:
        hidden = body_hidden(body, input_ids, attention_mask, position_ids)  # [B, T, H]
        start = 0 if prompt_length is None else prompt_length - 1
        window = hidden[:, start:-1]
    # Positions t predict token t+1; columns before `start` hold no loss token, so the
    # window's mask lists the loss tokens in the same (row-major) order as the full one.
    return window[mask[:, start:].bool()]


def _packed_hidden(model, body, input_ids, attention_mask, completion_mask):
    """The same as `_padded_hidden` from the rows packed into one sequence without padding
    (`packed.py`), or None where the model or the batch's layout does not allow it."""
    reason = verify_packing(model, body, input_ids, attention_mask, completion_mask)
    if reason is not None:
        _warn_once(model, reason, "packed forward unavailable, padded")
        return None
    kind = attention_kind(body)
    packed = pack_rows(input_ids, attention_mask, completion_mask, masked=kind == "masked")
    if packed is None:
        _warn_once(model, "a loss token follows padding", "packed forward unavailable, padded")
        return None
    return packed_hidden(body, packed)
