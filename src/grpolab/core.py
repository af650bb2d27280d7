"""The GRPO core: log-probs, group advantages, clipped ratio, k3 KL, aggregation, loss.

GRPO's twenty lines, exact, plus the variants users of GRPO trainers rely on. Every
function is a pure function of tensors. Shapes: B sequences (= n_prompts * G, the G samples
of a prompt contiguous), T tokens per sequence; log-prob tensors are [B, T-1], aligned with
input_ids[:, 1:].
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

ADVANTAGE_SCALES = ("group", "batch", "none")
AGGREGATIONS = ("sequence", "token", "constant")
# TRL's loss_type names for the same normalisers. "cispo" is also a surrogate of its own
# (`policy_loss(loss="cispo")`), normalised by the token count as TRL does.
LOSS_TYPE_ALIASES = {
    "grpo": "sequence",
    "bnpo": "token",
    "dapo": "token",
    "dr_grpo": "constant",
    "cispo": "token",
}
LOGPROB_SOURCES = ("trainer", "engine")
ADVANTAGE_STDS = ("population", "sample")  # divide the squared deviations by G or by G - 1
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SURROGATES = ("clip", "cispo")
# Against the engine's log-probs: per token or per sequence, capped (truncate) or dropped
# above the cap (mask). TRL's vllm_importance_sampling_mode values.
TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
WHITEN_EPS = 1e-8  # reinforce_pp's batch whitening: (x - mean) / sqrt(var + WHITEN_EPS)


# --- Token log-probabilities ------------------------------------------------------------------


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only, as generate() does for left-padded prompts (a
    model with absolute position embeddings would otherwise see shifted positions): [B, T]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Log-prob of each sampled token under `model` at the sampling temperature.

    input_ids, attention_mask, completion_mask: [B, T] (prompt + completion, padded).
    Returns (logp [B, T-1] float32, mask [B, T-1] float32); logp[:, t] is the log-prob of
    input_ids[:, t+1], mask[:, t] = completion_mask[:, t+1]. With return_entropy, also the
    entropy [B, T-1] of each position's whole next-token distribution (`token_entropy`).
    """
    _check_same_shape(
        input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask
    )
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, T] with T >= 2, got {tuple(input_ids.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
    ).logits  # [B, T, V]
    # The off-by-one: logits at position t predict the token at t+1.
    logits = logits[:, :-1, :].float() / temperature  # [B, T-1, V], float32 before softmax
    targets = input_ids[:, 1:]  # [B, T-1]
    mask = completion_mask[:, 1:].float()  # [B, T-1]
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, T-1, V]
    token_logprobs = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    if return_entropy:
        return token_logprobs, mask, -(logprobs.exp() * logprobs).sum(-1)
    return token_logprobs, mask


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy -sum_v p_v log p_v of softmax(logits / T) at each position, float32 (float64
    for float64 logits): [..., V] -> [...]."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logprobs = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)


# --- Group-relative advantages ----------------------------------------------------------------


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale: str = "group",
    eps: float = 1e-4,
    std: str = "population",
    zero_std_guard: bool = True,
    estimator: str = "grpo",
    lengths: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reward minus its group's mean, divided by a std; exactly 0 where a group's std <= eps.

    rewards: [B], B = n_groups * group_size, the samples of one group contiguous.
    scale: "group" (std of the group), "batch" (std of the whole batch), "none" (mean-centred
    only, Dr. GRPO). std: "population" (divide by G) or "sample" (divide by G - 1, as TRL,
    verl and OpenRLHF do); eps is added to it. zero_std_guard: advantages exactly 0 in a
    group whose std <= eps (off: such a group is divided by std + eps like any other, the
    peers' convention). estimator: "grpo" (the above), "rloo" (reward minus the mean of the
    group's other G - 1 rewards, not scaled), "reinforce_pp" (reward minus the group mean,
    then whitened over the batch, each sequence weighted by `lengths` [B], its completion
    tokens, when given: REINFORCE++ with a group baseline). valid: [B] bool, the rows that
    vote (None: all): a row no reward function could score, or one out of the loss, is left
    out of its group's mean and std and gets exactly 0 (TRL's convention for all-None
    rewards); a group with fewer than 2 valid rows gets 0. Returns [B].
    """
    _check_advantage_options(scale, std, estimator)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
    if rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards.numel()={rewards.numel()} is not a positive multiple of "
            f"group_size={group_size}"
        )
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        raise ValueError(f"rewards must be finite; non-finite at indices {bad[:10]}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if valid is not None:
        if valid.shape != rewards.shape:
            raise ValueError(f"valid {tuple(valid.shape)} must be [B] = {tuple(rewards.shape)}")
        if not bool(valid.all()):
            args = (scale, eps, std == "sample", zero_std_guard, estimator, lengths)
            return _valid_group_advantages(rewards, valid.bool(), group_size, *args)

    unbiased = std == "sample"
    r = rewards.view(-1, group_size)  # [n_groups, G]
    mean = r.mean(dim=1, keepdim=True)  # [n_groups, 1]
    std = r.std(dim=1, unbiased=unbiased, keepdim=True)  # [n_groups, 1]
    if estimator == "rloo":
        # r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) * (r_i - mean)
        adv = (r - mean) * (group_size / (group_size - 1))
    elif estimator == "reinforce_pp":
        adv = whiten(r - mean, None if lengths is None else lengths.view_as(r), unbiased)
    elif scale == "group":
        adv = (r - mean) / _nonzero(std + eps)
    elif scale == "batch":
        adv = (r - mean) / _nonzero(rewards.std(unbiased=unbiased) + eps)
    else:
        adv = r - mean
    if zero_std_guard:
        # The most important line: a group with (near) zero spread teaches nothing; a std
        # of 1e-8 would otherwise turn float noise into huge advantages.
        adv = torch.where(std > eps, adv, torch.zeros_like(adv))
    return adv.view(-1)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """scale, its zeros raised to the smallest normal float: with eps = 0 a flat group is
    0 / tiny = 0, not 0 / 0 = NaN; any other scale is unchanged, bit for bit."""
    return scale.clamp(min=torch.finfo(scale.dtype).tiny)


def _valid_group_advantages(
    rewards, valid, group_size, scale, eps, unbiased, zero_std_guard, estimator, lengths
) -> torch.Tensor:
    """group_advantages over the valid rows only (valid [B] bool, some False): the same
    conventions with each group's count of valid rows for G. Invalid rows get exactly 0."""
    r = rewards.view(-1, group_size)  # [n_groups, G]
    v = valid.view_as(r).to(r.dtype)  # [n_groups, G]
    n = v.sum(dim=1, keepdim=True)  # [n_groups, 1] valid rows per group
    mean = (r * v).sum(dim=1, keepdim=True) / n.clamp(min=1)
    centred = (r - mean) * v
    std = ((centred**2).sum(dim=1, keepdim=True) / (n - float(unbiased)).clamp(min=1)).sqrt()
    if estimator == "rloo":
        adv = centred * (n / (n - 1).clamp(min=1))
    elif estimator == "reinforce_pp":
        w = v if lengths is None else lengths.view_as(r).to(r.dtype) * v
        adv = whiten(centred, w, unbiased)
    elif scale == "group":
        adv = centred / _nonzero(std + eps)
    elif scale == "batch":
        flat, keep = rewards[valid], valid.sum()
        adv = centred / _nonzero(flat.std(unbiased=unbiased and bool(keep > 1)) + eps)
    else:
        adv = centred
    keep = (n >= 2) & (std > eps) if zero_std_guard else n >= 2
    return torch.where(keep & valid.view_as(r), adv, torch.zeros_like(adv)).view(-1)


def whiten(
    values: torch.Tensor, weights: torch.Tensor | None = None, unbiased: bool = False
) -> torch.Tensor:
    """(values - mean) / sqrt(var + WHITEN_EPS) over all entries, each weighted by `weights`
    (same shape; None: equal weights). unbiased: the variance of the sum of weights W is
    divided by W - 1 (verl's token-level whitening) instead of W."""
    w = torch.ones_like(values) if weights is None else weights.to(values.dtype)
    total = w.sum()
    mean = (w * values).sum() / total
    var = (w * (values - mean) ** 2).sum() / total
    if unbiased:
        var = var * total / (total - 1)
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS)


def informative_groups(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """Which groups teach something: population std of the group's rewards > eps, computed
    in float64 (DAPO's dynamic sampling keeps these and samples more). [B] -> [n_groups] bool."""
    r = rewards.double().view(-1, group_size)
    return r.std(dim=1, unbiased=False) > eps


def truncation_mask(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """The loss mask without the completions that hit max_completion_length (TRL's
    mask_truncated_completions): they leave the loss and its normaliser, and the trainer
    leaves them out of their group's statistics (advantage 0). mask [B, T], truncated [B]
    bool -> [B, T]."""
    if truncated.shape != mask.shape[:1]:
        raise ValueError(f"truncated {tuple(truncated.shape)} must be [B] = [{mask.shape[0]}]")
    return mask * (~truncated.bool()).unsqueeze(1).to(mask.dtype)


# --- Ratio and the clipped surrogate ----------------------------------------------------------


def policy_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    importance_sampling_level: str = "token",
    loss: str = "clip",
    delta: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate -min(ratio * A, clip(ratio, 1-eps_low, 1+eps_high) * A).

    logp_new, logp_old, mask: [B, T]; advantages: [B], broadcast to every token ("score by
    sequence, take gradients by token"). Returns (per_token [B, T], clip_frac scalar): the
    masked fraction of tokens where the clipped term is the active one (it gets no gradient).

    importance_sampling_level="sequence" (GSPO): one ratio per sequence, exp of the MEAN
    log-ratio over its completion tokens, clipped per sequence, the same value on each of
    its tokens. loss="cispo": -sg(min(ratio, eps_high)) * A * logp_new, the capped ratio
    detached (TRL's CISPO: eps_high is the cap itself); clip_frac counts capped tokens with
    A > 0. delta: the unclipped term's ratio capped at delta (TRL's two-sided clip).
    dual_clip: for A < 0 the loss is at most -A * dual_clip (verl's clip_ratio_c).
    log_ratio_clamp: the log-ratio clamped to [-c, c] before exp (verl, OpenRLHF: 20).
    """
    _check_loss_inputs(logp_new, logp_old, None, advantages, mask)
    _check_clip(eps_low, eps_high)
    _check_policy_options(importance_sampling_level, loss, delta, dual_clip)
    valid = mask.bool()
    adv = advantages.unsqueeze(1)  # [B, 1]
    ratio = importance_ratio(logp_new, logp_old, mask, importance_sampling_level, log_ratio_clamp)
    if loss == "cispo":
        weight = ratio.clamp(max=eps_high).detach()  # [B, T] or [B, 1]
        per_token = -weight * adv * torch.where(valid, logp_new, torch.zeros_like(logp_new))
        with torch.no_grad():
            capped = ((ratio > eps_high) & (adv > 0)).float().expand_as(logp_new)
            return per_token, masked_mean(capped, mask)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    per_token = -torch.min(unclipped * adv, clipped * adv)  # [B, T]; minus: we minimise
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.min(per_token, -adv * dual_clip), per_token)
    with torch.no_grad():
        active = ((ratio * adv) > (clipped * adv)).float().expand_as(logp_new)
        clip_frac = masked_mean(active, mask)
    return per_token.expand_as(logp_new), clip_frac


def importance_ratio(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    log_ratio_clamp: float | None = None,
) -> torch.Tensor:
    """exp(logp_new - logp_old) per token [B, T], or per sequence [B, 1]: exp of the mean
    log-ratio over the sequence's completion tokens (GSPO). Masked positions count 0:
    garbage there (inf, NaN) must not leak into the loss or the gradient through 0 * inf."""
    log_ratio = torch.where(mask.bool(), logp_new - logp_old, torch.zeros_like(logp_new))
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    if level == "sequence":
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)  # [B, 1]
        log_ratio = log_ratio.sum(dim=1, keepdim=True) / lengths  # a mean, not a sum
    return torch.exp(log_ratio)


# --- KL to the reference ----------------------------------------------------------------------


K3_MAX_LOG_RATIO = 40.0  # exp(40) ~ 2e17: summed over any batch, still finite in float32


def kl_k3(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(new || ref) per token: exp(d) - d - 1, d = ref - new.

    Never negative, unbiased over samples from the new policy, low variance. [B, T] -> [B, T].
    """
    if logp_new.shape != logp_ref.shape:
        raise ValueError(
            f"logp_new {tuple(logp_new.shape)} and logp_ref {tuple(logp_ref.shape)} differ"
        )
    # d capped at K3_MAX_LOG_RATIO: exp(d) of a float32 overflows at d ~ 88, and an inf (its
    # gradient a NaN) would poison the whole loss; below the cap nothing changes.
    d = (logp_ref - logp_new).clamp(max=K3_MAX_LOG_RATIO)
    return torch.exp(d) - d - 1


def kl_estimate(
    logp_new: torch.Tensor,
    logp_ref: torch.Tensor,
    estimator: str = "k3",
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(new || ref) [B, T] with d = logp_ref - logp_new: k1 = -d,
    k2 = d^2 / 2, k3 = exp(d) - d - 1. clamp: the estimate clamped to [-clamp, clamp] and,
    for k3, d to [-2 clamp, 2 clamp] first so exp cannot overflow (verl and OpenRLHF: 10;
    where the d clamp acts, the estimate is clamped anyway)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={estimator!r} is not one of {list(KL_ESTIMATORS)}")
    if estimator == "k3" and clamp is None:
        return kl_k3(logp_new, logp_ref)
    d = logp_ref - logp_new
    if estimator == "k1":
        value = -d
    elif estimator == "k2":
        value = 0.5 * d * d
    else:
        d = d.clamp(-2 * clamp, 2 * clamp)
        value = torch.exp(d) - d - 1
    return value if clamp is None else value.clamp(-clamp, clamp)


# --- Masking and normalisation ----------------------------------------------------------------


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """Reduce [B, T] per-token values to a scalar over the masked tokens.

    "sequence": mean over each sequence's tokens, then over sequences (the default);
    "token": sum over all tokens / number of tokens (DAPO): every token weighs the same;
    "constant": sum over all tokens / (B * max_completion_length) (Dr. GRPO): no length bias.
    """
    if LOSS_TYPE_ALIASES.get(mode, mode) not in AGGREGATIONS:
        valid = list(AGGREGATIONS) + sorted(LOSS_TYPE_ALIASES)
        raise ValueError(f"mode={mode!r} is not one of {valid}")
    mode = aggregation(mode)
    if per_token.shape != mask.shape or per_token.dim() != 2:
        raise ValueError(
            f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} must both be [B, T]"
        )
    if mode == "constant" and (max_completion_length is None or max_completion_length <= 0):
        raise ValueError(
            f'mode="constant" needs max_completion_length > 0, got {max_completion_length}'
        )
    masked = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))  # [B, T]
    if mode == "sequence":
        lengths = mask.sum(dim=1).clamp(min=1)  # [B]
        return (masked.sum(dim=1) / lengths).mean()
    if mode == "token":
        return masked.sum() / mask.sum().clamp(min=1)
    return masked.sum() / (per_token.shape[0] * max_completion_length)


def normaliser_count(loss_type: str, mask: torch.Tensor) -> float:
    """What the loss of a minibatch is divided by, up to constants shared by all of its
    micro-batches: completion tokens for "token", sequences otherwise ("constant"'s
    B * max_completion_length shares its max_completion_length). Only rows in the loss count:
    a row whose mask is all 0 (truncation masking, dynamic sampling's fill) adds nothing to
    the numerator, so counting it in the denominator would shrink every other row's weight
    (TRL #6369). mask: [b, T]."""
    if aggregation(loss_type) == "token":
        return float(mask.sum())
    return float((mask.sum(dim=1) > 0).sum())


def micro_batch_scale(
    loss_type: str,
    micro_mask: torch.Tensor,
    minibatch_mask: torch.Tensor,
    minibatch_count: float | None = None,
) -> float:
    """Factor turning a micro-batch's `aggregate` loss into its share of the loss of the whole
    minibatch, so that gradients accumulated over micro-batches equal the one-pass gradient:
    sequence -> b_micro / (rows of the minibatch in the loss); token -> tokens_micro /
    tokens_mini (aggregate clamps the count at 1); constant -> as sequence (same
    max_completion_length).
    `minibatch_count`: the minibatch's `normaliser_count` over all ranks; None: this
    process's minibatch alone. Masks: [b, T]."""
    total = (
        normaliser_count(loss_type, minibatch_mask) if minibatch_count is None else minibatch_count
    )
    if aggregation(loss_type) == "token":
        return float(micro_mask.sum().clamp(min=1)) / max(total, 1.0)
    return micro_mask.shape[0] / max(total, 1.0)  # aggregate divides by all b_micro rows


def rows_without_gradient(
    advantages: torch.Tensor, loss_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """[B] bool: the rows whose policy term is exactly 0 whatever the ratio: advantage
    exactly 0 (every surrogate is A x a function of the ratio), or out of the loss. With no
    other term reading them (beta = 0, no entropy bonus), skipping their forward and backward
    leaves the gradient as it is, as long as each micro-batch's share is taken of the whole
    minibatch's normaliser (`micro_batch_scale`). advantages, loss_rows: [B]."""
    none = advantages == 0
    if loss_rows is not None:
        none = none | (loss_rows == 0)
    return none


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over positions where mask is set (0 when none is)."""
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))
    return masked.sum() / mask.sum().clamp(min=1)


# --- The assembled loss -----------------------------------------------------------------------


def grpo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    logp_ref: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    beta: float = 0.0,
    loss_agg: str = "sequence",
    max_completion_length: int | None = None,
    token_weights: torch.Tensor | None = None,
    importance_sampling_level: str = "token",
    delta: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
    kl_estimator: str = "k3",
    kl_clamp: float | None = None,
    use_bias_correction_kl: bool = False,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate + beta * k3 KL per token, aggregated by `loss_agg`.

    logp_new, logp_old, logp_ref, mask: [B, T]; advantages: [B]. Returns (loss scalar,
    metrics). Every token statistic in the metrics is a mean over masked tokens only.
    token_weights [B, T] (optional, no gradient) multiply the policy term per token: the
    truncated importance weights that correct for an engine sampling from slightly other
    numerics than the trainer's (see `tis_weights`).
    The options of `policy_loss` (importance_sampling_level, delta, dual_clip,
    log_ratio_clamp; loss_agg="cispo" picks the CISPO surrogate) and of `kl_estimate`
    (kl_estimator, kl_clamp) apply; use_bias_correction_kl multiplies the KL term by the
    importance ratio (TRL's default). entropy [B, T] (the policy's, with gradient): its
    masked mean is the metric "entropy", and entropy_coef * entropy is subtracted from each
    token's loss (an entropy bonus, aggregated like the rest).
    """
    _check_loss_inputs(logp_new, logp_old, logp_ref, advantages, mask)
    for name, extra in (("token_weights", token_weights), ("entropy", entropy)):
        if extra is not None and extra.shape != logp_new.shape:
            raise ValueError(
                f"{name} {tuple(extra.shape)} must match logp_new {tuple(logp_new.shape)}"
            )
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and logp_ref is None:
        raise ValueError(f"beta={beta} > 0 needs logp_ref (reference log-probs), got None")
    options = {
        "importance_sampling_level": importance_sampling_level,
        "delta": delta,
        "dual_clip": dual_clip,
        "log_ratio_clamp": log_ratio_clamp,
    }
    surrogate = "cispo" if loss_agg == "cispo" else "clip"
    per_token, clip_frac = policy_loss(
        logp_new, logp_old, advantages, mask, eps_low, eps_high, loss=surrogate, **options
    )
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    kl = None
    if logp_ref is not None:
        kl = _kl_term(logp_new, logp_old, logp_ref, mask, kl_estimator, kl_clamp, options)
        if beta > 0:
            scaled = kl
            if use_bias_correction_kl:
                # The per-token ratio whatever the policy term's level: the KL is per token,
                # and a GSPO sequence ratio [B, 1] would add a gradient term of every token's
                # KL to every other token of the sequence (TRL #6586).
                scaled = kl * importance_ratio(logp_new, logp_old, mask, "token", log_ratio_clamp)
            per_token = per_token + beta * scaled
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy
    loss = aggregate(per_token, mask, loss_agg, max_completion_length)
    metrics = _loss_metrics(loss, clip_frac, logp_new, logp_old, advantages, mask, kl, entropy)
    if surrogate == "clip":
        metrics |= _clip_sides(logp_new, logp_old, advantages, mask, eps_low, eps_high)
    return loss, metrics


def _kl_term(logp_new, logp_old, logp_ref, mask, estimator, clamp, options) -> torch.Tensor:
    """The per-token KL estimate [B, T]; 0 where the mask is 0 (0 on both sides there, so
    garbage cannot reach the gradient)."""
    valid, zeros = mask.bool(), torch.zeros_like(logp_new)
    new, ref = torch.where(valid, logp_new, zeros), torch.where(valid, logp_ref, zeros)
    if estimator == "k3" and clamp is None:
        return kl_k3(new, ref)
    return kl_estimate(new, ref, estimator, clamp)


@torch.no_grad()
def _loss_metrics(loss, clip_frac, logp_new, logp_old, advantages, mask, kl, entropy):
    log_ratio = torch.where(mask.bool(), logp_new - logp_old, torch.zeros_like(logp_new))
    metrics = {
        "loss": loss.item(),
        "clip_frac": clip_frac.item(),
        "kl": masked_mean(kl, mask).item() if kl is not None else 0.0,
        "adv_std": advantages.std().item() if advantages.numel() > 1 else 0.0,
        "ratio_mean": masked_mean(torch.exp(log_ratio), mask).item(),
    }
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy, mask).item()
    return metrics


@torch.no_grad()
def _clip_sides(logp_new, logp_old, advantages, mask, eps_low, eps_high) -> dict[str, float]:
    """Token ratios outside the clip range on the side the clip acts on (per token)."""
    ratio = torch.exp(torch.where(mask.bool(), logp_new - logp_old, torch.zeros_like(logp_new)))
    adv = advantages.unsqueeze(1).expand_as(ratio)
    low = ((ratio < 1 - eps_low) & (adv < 0)).float()
    high = ((ratio > 1 + eps_high) & (adv > 0)).float()
    return {
        "clip_frac_low": masked_mean(low, mask).item(),
        "clip_frac_high": masked_mean(high, mask).item(),
    }


def tis_weights(
    logp_trainer: torch.Tensor,
    logp_engine: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    mode: str = "token_truncate",
) -> torch.Tensor:
    """Importance weights pi_trainer / pi_engine against the engine that sampled: [B, T].

    The engine sampled from pi_engine; the loss is built on the trainer's pi_trainer. Their
    ratio reweights each sampled token to the trainer's distribution. mode (TRL's
    vllm_importance_sampling_mode): "token_truncate" min(ratio, cap) per token (the cap
    bounds the variance); "token_mask" the ratio, 0 where it exceeds the cap;
    "sequence_truncate" / "sequence_mask" one ratio per sequence, exp of the SUM of its
    tokens' log-ratios (the probability ratio of the whole completion), capped or dropped
    (0) above the cap, on each of its tokens. 1 at masked positions (token modes).
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if mode not in TIS_MODES:
        raise ValueError(f"mode={mode!r} is not one of {list(TIS_MODES)}")
    _check_same_shape(logp_trainer=logp_trainer, logp_engine=logp_engine, mask=mask)
    log_w = torch.where(mask.bool(), logp_trainer - logp_engine, torch.zeros_like(logp_trainer))
    if mode.startswith("sequence"):
        log_w = log_w.sum(dim=1, keepdim=True)  # [B, 1]
    w = torch.exp(log_w)
    if mode.endswith("truncate"):
        w = w.clamp(max=cap)
    else:
        w = torch.where(w > cap, torch.zeros_like(w), w)
    return w.expand_as(logp_trainer)


# --- The objective: one record of what is optimised -------------------------------------------


def aggregation(loss_type: str) -> str:
    """The normaliser a loss_type names: one of AGGREGATIONS, TRL's aliases resolved."""
    resolved = LOSS_TYPE_ALIASES.get(loss_type, loss_type)
    if resolved not in AGGREGATIONS:
        valid = list(AGGREGATIONS) + sorted(LOSS_TYPE_ALIASES)
        raise ValueError(f"loss_type={loss_type!r} is not one of {valid}")
    return resolved


# Each peer's GRPO: every convention in which the trainers differ, as the peer's defaults
# set it (its GRPO recipe where its defaults are not GRPO). `trainer.profile` picks one; a
# key set explicitly overrides the profile's value.
PROFILES: dict[str, dict[str, Any]] = {
    "seed": {
        "advantage_std": "population",
        "advantage_eps": 1e-4,
        "zero_std_guard": True,
        "loss_type": "sequence",
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "log_ratio_clamp": None,
        "dual_clip": None,
        "kl_estimator": "k3",
        "kl_clamp": None,
        "use_bias_correction_kl": False,
    },
    # GRPOConfig's defaults: sample std (nanstd) + 1e-4, no zero guard, loss_type "dapo",
    # epsilon_high = epsilon, k3 times the importance ratio (use_bias_correction_kl).
    "trl": {
        "advantage_std": "sample",
        "advantage_eps": 1e-4,
        "zero_std_guard": False,
        "loss_type": "dapo",
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "log_ratio_clamp": None,
        "dual_clip": None,
        "kl_estimator": "k3",
        "kl_clamp": None,
        "use_bias_correction_kl": True,
    },
    # compute_grpo_outcome_advantage (torch.std + 1e-6), loss_agg_mode "token-mean",
    # clip_ratio 0.2, log-ratio clamped to +-20, dual-clip clip_ratio_c = 3, KL loss
    # "low_var_kl" (k3, d in [-20, 20], value in [-10, 10]).
    "verl": {
        "advantage_std": "sample",
        "advantage_eps": 1e-6,
        "zero_std_guard": False,
        "loss_type": "token",
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "log_ratio_clamp": 20.0,
        "dual_clip": 3.0,
        "kl_estimator": "k3",
        "kl_clamp": 10.0,
        "use_bias_correction_kl": False,
    },
    # The group_norm estimator (std + 1e-9), token-mean loss, eps_clip 0.2, log-ratio
    # clamped to +-20, no dual-clip by default, KL as a loss with k3 clamped to [-10, 10].
    "openrlhf": {
        "advantage_std": "sample",
        "advantage_eps": 1e-9,
        "zero_std_guard": False,
        "loss_type": "token",
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "log_ratio_clamp": 20.0,
        "dual_clip": None,
        "kl_estimator": "k3",
        "kl_clamp": 10.0,
        "use_bias_correction_kl": False,
    },
}
PROFILE_SOURCES = {
    "seed": "grpolab's own",
    "trl": "TRL 1.16 GRPOTrainer's defaults",
    "verl": "verl 0.9's GRPO recipe (core_algos)",
    "openrlhf": "OpenRLHF 0.11's GRPO recipe (group_norm, KL loss k3)",
}
# Keyword arguments a user's function may leave out: a function without them computes one
# fixed convention, which the preflight checks against the declared one. The menu's other
# options change the algorithm and need a function that takes them.
CONVENTION_KWARGS = (
    "valid",
    "std",
    "zero_std_guard",
    "log_ratio_clamp",
    "dual_clip",
    "kl_estimator",
    "kl_clamp",
    "use_bias_correction_kl",
)


@dataclass(frozen=True)
class Objective:
    """Everything that decides which "GRPO" is optimised, with TRL's names, validated on
    construction. The trainer's loss, the objective card and the preflight's expectations
    all read this one record."""

    num_generations: int = 8
    scale_rewards: str = "group"
    advantage_eps: float = 1e-4
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    loss_type: str = "sequence"  # as written (an alias allowed); `aggregation` resolves it
    max_completion_length: int | None = None
    temperature: float = 1.0
    num_iterations: int = 1
    logprob_source: str = "trainer"
    tis_cap: float | None = None  # importance weights against the engine (tis_mode)
    profile: str = "seed"  # whose conventions the fields below were resolved from
    advantage_std: str = "population"
    zero_std_guard: bool = True
    advantage_estimator: str = "grpo"
    log_ratio_clamp: float | None = None
    dual_clip: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    kl_estimator: str = "k3"
    kl_clamp: float | None = None
    use_bias_correction_kl: bool = False
    entropy_coef: float = 0.0
    mask_truncated_completions: bool = False
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 4  # extra generation rounds per step, at most
    tis_mode: str = "token_truncate"

    def __post_init__(self) -> None:
        agg = aggregation(self.loss_type)
        if agg == "constant" and not self.max_completion_length:
            raise ValueError('loss_type="constant" needs max_completion_length > 0')
        for name, valid in (
            ("scale_rewards", ADVANTAGE_SCALES),
            ("logprob_source", LOGPROB_SOURCES),
            ("profile", tuple(PROFILES)),
            ("tis_mode", TIS_MODES),
        ):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {list(valid)}")
        _check_clip(self.epsilon, self.epsilon_high)
        _check_advantage_options(self.scale_rewards, self.advantage_std, self.advantage_estimator)
        _check_policy_options(
            self.importance_sampling_level, self.surrogate, self.delta, self.dual_clip
        )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator={self.kl_estimator!r} is not one of {list(KL_ESTIMATORS)}"
            )
        for name in ("log_ratio_clamp", "kl_clamp"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None (off), got {value}")
        if self.surrogate == "cispo" and not self.epsilon_high > 1:
            raise ValueError(
                f"loss_type='cispo' caps the ratio at epsilon_high itself (TRL's CISPO), so it "
                f"must be > 1 (e.g. 5.0), got {self.epsilon_high}"
            )
        if self.dynamic_sampling_max_rounds < 0:
            raise ValueError(
                f"dynamic_sampling_max_rounds must be >= 0, got {self.dynamic_sampling_max_rounds}"
            )

    @property
    def aggregation(self) -> str:
        return aggregation(self.loss_type)

    @property
    def surrogate(self) -> str:
        return "cispo" if self.loss_type == "cispo" else "clip"

    @classmethod
    def of(cls, config: Any) -> Objective:
        """From an Objective, a mapping of its fields, or any object with some of its fields as
        attributes (a trainer config); missing fields take the defaults."""
        names = [f.name for f in fields(cls)]
        if isinstance(config, Objective):
            return config
        if isinstance(config, Mapping):
            unknown = sorted(set(config) - set(names))
            if unknown:
                raise ValueError(f"unknown objective keys {unknown}; valid keys: {names}")
            return cls(**config)
        return cls(**{n: getattr(config, n) for n in names if hasattr(config, n)})

    def advantage_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `group_advantages` (after rewards and group size); the
        conventions and the estimator only where they differ from the seed's, so a function
        with the seed's signature takes the seed's objective unchanged."""
        kwargs: dict[str, Any] = {"scale": self.scale_rewards, "eps": self.advantage_eps}
        extra = {
            "std": self.advantage_std,
            "zero_std_guard": self.zero_std_guard,
            "estimator": self.advantage_estimator,
        }
        defaults = {"std": "population", "zero_std_guard": True, "estimator": "grpo"}
        return kwargs | {k: v for k, v in extra.items() if v != defaults[k]}

    def loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `grpo_loss` (after the tensors) that this objective sets:
        the seed's five, and each further option where it differs from its default."""
        kwargs = {
            "eps_low": self.epsilon,
            "eps_high": self.epsilon_high,
            "beta": self.beta,
            "loss_agg": self.loss_type,
            "max_completion_length": self.max_completion_length,
        }
        extra = {name: getattr(self, name) for name in LOSS_OPTION_DEFAULTS}
        return kwargs | {k: v for k, v in extra.items() if v != LOSS_OPTION_DEFAULTS[k]}

    def differs_from_seed(self, name: str) -> bool:
        """Whether the resolved value of a profile convention is not the seed's."""
        return getattr(self, name) != PROFILES["seed"][name]

    @property
    def on_policy(self) -> bool:
        """logp_old is the sampling policy's own log-probs, taken by the trainer."""
        return self.logprob_source == "trainer"


# grpo_loss's options beyond the seed's and their defaults (passed only when set otherwise).
LOSS_OPTION_DEFAULTS: dict[str, Any] = {
    "importance_sampling_level": "token",
    "delta": None,
    "dual_clip": None,
    "log_ratio_clamp": None,
    "kl_estimator": "k3",
    "kl_clamp": None,
    "use_bias_correction_kl": False,
    "entropy_coef": 0.0,
}


def accepted_kwargs(fn: Callable, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`kwargs` without the conventions `fn` does not take (CONVENTION_KWARGS): a user's
    function written for one convention is called as it was written, and the preflight
    checks that it computes the declared one. Everything else is passed as given."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return dict(kwargs)
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params or k not in CONVENTION_KWARGS}


def objective_card(config: Any) -> str:
    """The resolved objective on one screen, printed at the start of every run: the profile
    and every resolved convention, marked * where it differs from the seed's.

    `config`: anything `Objective.of` takes."""
    o = Objective.of(config)
    lines = [
        f"GRPO objective, profile {o.profile} ({PROFILE_SOURCES[o.profile]}); * differs from "
        "the seed's",
        f"  groups        G = {o.num_generations} samples per prompt, contiguous",
        *_card_advantages(o),
        *_card_ratio(o),
        f"  KL            {_card_kl(o)}",
        f"  aggregation   {_card_aggregation(o)}",
        f"  inner epochs  num_iterations = {o.num_iterations}",
        *_card_menu(o),
    ]
    return "\n".join(lines)


def _mark(o: Objective, *names: str) -> str:
    return " *" if any(o.differs_from_seed(n) for n in names) else ""


def _card_advantages(o: Objective) -> list[str]:
    divisor = "G - 1" if o.advantage_std == "sample" else "G"
    kind = {"population": "population std", "sample": "sample std"}[o.advantage_std]
    std = {
        "group": f"{kind} of the group (divide by {divisor})",
        "batch": f"{kind} of the whole batch",
        "none": "none: mean-centred only (Dr. GRPO)",
    }[o.scale_rewards]
    eps = f"{o.advantage_eps:g}"
    formula = {
        "grpo": f"(r - mean_group) / ({std} + {eps})",
        "rloo": "r - mean of the group's other G - 1 rewards (RLOO), not scaled",
        "reinforce_pp": "r - mean_group, whitened over the batch (token-weighted, REINFORCE++)",
    }[o.advantage_estimator]
    guard = (
        f"exactly 0 where group std <= {eps}"
        if o.zero_std_guard
        else "no zero-std guard: an equal-reward group is 0, a near-equal one is divided by "
        f"std + {eps}"
    )
    return [
        f"  advantage     {formula}{_mark(o, 'advantage_std', 'advantage_eps')}"
        + (" (estimator *)" if o.advantage_estimator != "grpo" else ""),
        f"  zero std      {guard}{_mark(o, 'zero_std_guard')}",
    ]


def _card_ratio(o: Objective) -> list[str]:
    source = {
        "trainer": "an extra forward of the training model before any update (exact)",
        "engine": "the rollout engine's log-probs (saves a forward, biased)",
    }[o.logprob_source]
    if o.importance_sampling_level == "sequence":
        ratio = "exp(mean over the sequence's tokens of logp_new - logp_old) per sequence (GSPO) *"
    else:
        ratio = "exp(logp_new - logp_old) per token"
    clamp = "" if o.log_ratio_clamp is None else f"; log-ratio clamped to +-{o.log_ratio_clamp:g}"
    lo, hi = 1 - o.epsilon, 1 + o.epsilon_high
    if o.surrogate == "cispo":
        clip = f"CISPO: -sg(min(ratio, {o.epsilon_high:g})) * A * logp_new per token *"
    else:
        clip = (
            f"ratio in [1 - {o.epsilon:g}, 1 + {o.epsilon_high:g}] = [{lo:g}, {hi:g}]; per token "
            f"-min(ratio*A, clip(ratio)*A){_mark(o, 'epsilon', 'epsilon_high')}"
        )
        if o.delta is not None:
            clip += f"; unclipped ratio capped at delta = {o.delta:g} (two-sided) *"
        if o.dual_clip is not None:
            clip += f"; A < 0: loss at most {o.dual_clip:g} * |A| (dual-clip) *"
    return [
        f"  ratio         {ratio} at temperature {o.temperature:g}{clamp}"
        + _mark(o, "log_ratio_clamp"),
        f"  logp_old      {source}",
        f"  clip          {clip}",
    ]


def _card_kl(o: Objective) -> str:
    if o.beta == 0:
        return "off (beta = 0, no reference model)"
    formula = {
        "k1": "k1 = logp_new - logp_ref",
        "k2": "k2 = (logp_new - logp_ref)^2 / 2",
        "k3": "k3 = exp(d) - d - 1 with d = logp_ref - logp_new",
    }[o.kl_estimator]
    text = f"{formula}, beta = {o.beta:g}{_mark(o, 'kl_estimator')}"
    if o.kl_clamp is not None:
        text += f"; clamped to +-{o.kl_clamp:g} *"
    if o.use_bias_correction_kl:
        text += "; times the importance ratio (bias correction) *"
    return text


def _card_aggregation(o: Objective) -> str:
    normaliser = {
        "sequence": "mean over each sequence's completion tokens, then mean over sequences",
        "token": "sum over all completion tokens / number of completion tokens",
        "constant": f"sum over all completion tokens / (B * {o.max_completion_length})",
    }[o.aggregation]
    return f"{o.aggregation} ({o.loss_type}): {normaliser}{_mark(o, 'loss_type')}"


def _card_menu(o: Objective) -> list[str]:
    lines = []
    if o.tis_cap is not None:
        unit = (
            "per sequence (exp of the summed log-ratio)"
            if "sequence" in o.tis_mode
            else "per token"
        )
        how = "capped at" if o.tis_mode.endswith("truncate") else "dropped (0) above"
        lines.append(
            f"  engine        policy term x pi_trainer / pi_engine {unit}, {how} {o.tis_cap:g}"
            f" ({o.tis_mode})"
        )
    entropy = "masked mean reported"
    if o.entropy_coef:
        entropy += f"; bonus: entropy_coef = {o.entropy_coef:g} x entropy subtracted per token"
    lines.append(f"  entropy       {entropy}")
    if o.mask_truncated_completions:
        lines.append("  truncated     completions without EOS leave the loss and its normaliser")
    if o.dynamic_sampling:
        lines.append(
            "  sampling      dynamic: groups with reward std <= "
            f"{o.advantage_eps:g} dropped, up to {o.dynamic_sampling_max_rounds} more rounds"
        )
    return lines


# --- The function table -----------------------------------------------------------------------

CORE_FUNCTIONS = (
    "sequence_logprobs",
    "group_advantages",
    "policy_loss",
    "kl_k3",
    "aggregate",
    "grpo_loss",
)
# The menu's own steps a user's file may also replace (each checked when its option is on).
MENU_FUNCTIONS = ("tis_weights", "informative_groups", "truncation_mask", "micro_batch_scale")


@dataclass
class CoreFunctions:
    """The six functions a GRPO step calls (and the menu's three, and the micro-batch scaling
    of gradient accumulation), and where each came from
    ("grpolab" or a user's file). The trainer, the preflight, `--impl` and the drill all run
    through one of these; `grpolab.functions.core_functions` chooses it."""

    sequence_logprobs: Callable = sequence_logprobs
    group_advantages: Callable = group_advantages
    policy_loss: Callable = policy_loss
    kl_k3: Callable = kl_k3
    aggregate: Callable = aggregate
    grpo_loss: Callable = grpo_loss
    tis_weights: Callable = tis_weights
    informative_groups: Callable = informative_groups
    truncation_mask: Callable = truncation_mask
    micro_batch_scale: Callable = micro_batch_scale
    source: dict[str, str] = field(
        default_factory=lambda: dict.fromkeys(CORE_FUNCTIONS + MENU_FUNCTIONS, "grpolab")
    )
    path: str | None = None  # the user's file, when one replaced any function


# --- Input validation -------------------------------------------------------------------------


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"shapes must match: {listed}")


def _check_loss_inputs(logp_new, logp_old, logp_ref, advantages, mask) -> None:
    named = {"logp_new": logp_new, "logp_old": logp_old, "mask": mask}
    if logp_ref is not None:
        named["logp_ref"] = logp_ref
    _check_same_shape(**named)
    if logp_new.dim() != 2:
        raise ValueError(f"logp_new must be [B, T], got {tuple(logp_new.shape)}")
    if advantages.shape != logp_new.shape[:1]:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must be [B] with B = logp_new.shape[0] = "
            f"{logp_new.shape[0]}"
        )


def _check_clip(eps_low: float, eps_high: float) -> None:
    if not (0 <= eps_low < 1) or not math.isfinite(eps_low):
        raise ValueError(f"eps_low (epsilon) must be in [0, 1), got {eps_low}")
    if not (eps_high >= 0) or not math.isfinite(eps_high):
        raise ValueError(f"eps_high (epsilon_high) must be >= 0, got {eps_high}")


def _check_advantage_options(scale: str, std: str, estimator: str) -> None:
    for name, value, valid in (
        ("scale", scale, ADVANTAGE_SCALES),
        ("std", std, ADVANTAGE_STDS),
        ("estimator", estimator, ADVANTAGE_ESTIMATORS),
    ):
        if value not in valid:
            raise ValueError(f"{name}={value!r} is not one of {list(valid)}")


def _check_policy_options(level: str, loss: str, delta, dual_clip) -> None:
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level={level!r} is not one of {list(IMPORTANCE_SAMPLING_LEVELS)}"
        )
    if loss not in SURROGATES:
        raise ValueError(f"loss={loss!r} is not one of {list(SURROGATES)}")
    if delta is not None and not delta > 1:
        raise ValueError(f"delta must be > 1 (e.g. 1 + epsilon_high + 1) or None, got {delta}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (verl: 3.0) or None, got {dual_clip}")
    if loss == "cispo" and (delta is not None or dual_clip is not None):
        raise ValueError("delta and dual_clip bound the clipped surrogate; CISPO has none")
