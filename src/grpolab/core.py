"""The GRPO core: log-probs, group advantages, clipped ratio, k3 KL, aggregation, loss.

GRPO's twenty lines, exact, plus the variants users of GRPO trainers rely on. Every
function is a pure function of tensors. Shapes: B sequences (= n_prompts * G, the G samples
of a prompt contiguous), T tokens per sequence; log-prob tensors are [B, T-1], aligned with
input_ids[:, 1:].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import field

import torch

# The objective's units: what the core dispatches to by name, and (re-exported, __all__) the
# objective record, the profiles, the card and the menu's maths their units hold.
from grpolab.objective import (
    AGGREGATIONS,
    CONVENTION_KWARGS,
    ESTIMATORS,
    KL_OPTIONS,
    LOSS_OPTION_DEFAULTS,
    LOSS_OPTIONS,
    LOSS_TYPE_ALIASES,
    LOSS_TYPES,
    PROFILE_SOURCES,
    PROFILES,
    SURROGATE_OPTIONS,
    SURROGATES,
    UNIT_FUNCTIONS,
    Objective,
    accepted_kwargs,
    aggregation,
    check_value,
    objective_card,
    surrogate_of,
)
from grpolab.objective.base import masked_mean
from grpolab.objective.dynamic_sampling import informative_groups
from grpolab.objective.kl import FORMULAS as _KL_FORMULAS
from grpolab.objective.reinforce_pp import WHITEN_EPS, whiten
from grpolab.objective.tis import TIS_MODES, tis_weights
from grpolab.objective.truncation import truncation_mask

KL_ESTIMATORS = tuple(_KL_FORMULAS)

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
    tokens, when given: REINFORCE++ with a group baseline); both are units of
    grpolab.objective. valid: [B] bool, the rows that
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
    if estimator != "grpo":  # a registered estimator (grpolab.objective: rloo, reinforce_pp)
        weights = None if lengths is None else lengths.view_as(r)
        adv = ESTIMATORS[estimator].estimate(r - mean, group_size, weights, unbiased)
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
    if estimator != "grpo":
        weights = v if lengths is None else lengths.view_as(r).to(r.dtype) * v
        adv = ESTIMATORS[estimator].estimate(centred, n, weights, unbiased)
    elif scale == "group":
        adv = centred / _nonzero(std + eps)
    elif scale == "batch":
        flat, keep = rewards[valid], valid.sum()
        adv = centred / _nonzero(flat.std(unbiased=unbiased and bool(keep > 1)) + eps)
    else:
        adv = centred
    keep = (n >= 2) & (std > eps) if zero_std_guard else n >= 2
    return torch.where(keep & valid.view_as(r), adv, torch.zeros_like(adv)).view(-1)


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
    **surrogate_options: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate -min(ratio * A, clip(ratio, 1-eps_low, 1+eps_high) * A).

    logp_new, logp_old, mask: [B, T]; advantages: [B], broadcast to every token ("score by
    sequence, take gradients by token"). Returns (per_token [B, T], clip_frac scalar): the
    masked fraction of tokens where the clipped term is the active one (it gets no gradient).

    importance_sampling_level="sequence" (GSPO): one ratio per sequence, exp of the MEAN
    log-ratio over its completion tokens, clipped per sequence, the same value on each of
    its tokens. delta: the unclipped term's ratio capped at delta (TRL's two-sided clip).
    dual_clip: for A < 0 the loss is at most -A * dual_clip (verl's clip_ratio_c).
    log_ratio_clamp: the log-ratio clamped to [-c, c] before exp (verl, OpenRLHF: 20).
    loss: "clip", or a surrogate registered in grpolab.objective (SURROGATES: "cispo",
    "sapo"), computed by its unit from the same ratio, with its `surrogate_options`.
    """
    _check_loss_inputs(logp_new, logp_old, None, advantages, mask)
    _check_policy_options(eps_low, eps_high, importance_sampling_level, loss, delta, dual_clip)
    _check_surrogate_options(loss, surrogate_options)
    adv = advantages.unsqueeze(1)  # [B, 1]
    ratio = importance_ratio(logp_new, logp_old, mask, importance_sampling_level, log_ratio_clamp)
    if loss != "clip":
        per_token = SURROGATES[loss].per_token
        return per_token(ratio, adv, logp_new, mask, eps_low, eps_high, **surrogate_options)
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
    check_value("kl_estimator", estimator)
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
        raise ValueError(f"mode={mode!r} is not one of {list(LOSS_TYPES)}")
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
    entropy: torch.Tensor | None = None,
    **options: object,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate + beta * k3 KL per token, aggregated by `loss_agg`.

    logp_new, logp_old, logp_ref, mask: [B, T]; advantages: [B]. Returns (loss scalar,
    metrics). Every token statistic in the metrics is a mean over masked tokens only.
    token_weights [B, T] (optional, no gradient) multiply the policy term per token: the
    truncated importance weights that correct for an engine sampling from slightly other
    numerics than the trainer's (see `tis_weights`). entropy [B, T] (the policy's, with
    gradient): its masked mean is the metric "entropy".
    `options`: the objective's units' keywords (grpolab.objective: LOSS_OPTION_DEFAULTS):
    policy_loss's (importance_sampling_level, delta, dual_clip, log_ratio_clamp; a loss_agg
    naming a registered surrogate, "cispo" or "sapo", picks it, with its own options, as does
    `surrogate` whatever the loss_agg); the
    KL's (kl_estimator, kl_clamp, use_bias_correction_kl: the KL term times the importance
    ratio, TRL's default); entropy_coef (entropy_coef * entropy subtracted from each token's
    loss: an entropy bonus, aggregated like the rest).
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
    surrogate = options.pop("surrogate", None) or surrogate_of(loss_agg)
    policy, kl_options, entropy_coef = _split_loss_options(loss_agg, options)
    per_token, clip_frac = policy_loss(
        logp_new, logp_old, advantages, mask, eps_low, eps_high, loss=surrogate, **policy
    )
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    kl = None
    if logp_ref is not None:
        estimator, clamp, bias_correction = kl_options
        kl = _kl_term(logp_new, logp_ref, mask, estimator, clamp)
        if beta > 0:
            scaled = kl
            if bias_correction:
                # The per-token ratio whatever the policy term's level: the KL is per token,
                # and a GSPO sequence ratio [B, 1] would add a gradient term of every token's
                # KL to every other token of the sequence (TRL #6586).
                clamp_ratio = policy.get("log_ratio_clamp")
                scaled = kl * importance_ratio(logp_new, logp_old, mask, "token", clamp_ratio)
            per_token = per_token + beta * scaled
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy
    loss = aggregate(per_token, mask, loss_agg, max_completion_length)
    metrics = _loss_metrics(loss, clip_frac, logp_new, logp_old, advantages, mask, kl, entropy)
    if surrogate == "clip":
        metrics |= _clip_sides(logp_new, logp_old, advantages, mask, eps_low, eps_high)
    return loss, metrics


def _split_loss_options(loss_agg: str, options: dict) -> tuple[dict, tuple, float]:
    """grpo_loss's options as (policy_loss's, (kl_estimator, kl_clamp,
    use_bias_correction_kl), entropy_coef); an option no unit declares is a ValueError."""
    unknown = sorted(set(options) - set(LOSS_OPTIONS))
    if unknown:
        raise ValueError(f"unknown grpo_loss options {unknown}; valid: {sorted(LOSS_OPTIONS)}")
    policy = {k: v for k, v in options.items() if LOSS_OPTIONS[k].policy}
    kl = tuple(options.get(k, LOSS_OPTION_DEFAULTS[k]) for k in KL_OPTIONS)
    return policy, kl, float(options.get("entropy_coef", 0.0))


def _kl_term(logp_new, logp_ref, mask, estimator, clamp) -> torch.Tensor:
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


# --- The function table -----------------------------------------------------------------------

CORE_FUNCTIONS = (
    "sequence_logprobs",
    "group_advantages",
    "policy_loss",
    "kl_k3",
    "aggregate",
    "grpo_loss",
)
# The step functions the objective's units bring (tis_weights, informative_groups, ...:
# grpolab.objective.UNIT_FUNCTIONS) and the micro-batch scaling of gradient accumulation: a
# user's file may replace these too (each checked when its option is on).
MENU_FUNCTIONS = (*UNIT_FUNCTIONS, "micro_batch_scale")
_GRPOLAB_FUNCTIONS = (
    {name: globals()[name] for name in CORE_FUNCTIONS}
    | UNIT_FUNCTIONS
    | {"micro_batch_scale": micro_batch_scale}
)

CoreFunctions = dataclasses.make_dataclass(
    "CoreFunctions",
    [(name, Callable, field(default=fn)) for name, fn in _GRPOLAB_FUNCTIONS.items()]
    + [
        ("source", dict[str, str], field(
            default_factory=lambda: dict.fromkeys(_GRPOLAB_FUNCTIONS, "grpolab"))),
        ("path", str | None, field(default=None)),  # the user's file, when it replaced any
    ],
)  # fmt: skip
CoreFunctions.__doc__ = """The six functions a GRPO step calls, the units' step functions and
the micro-batch scaling of gradient accumulation, by name, and where each came from
(`source`: "grpolab" or a user's file). The trainer, the preflight, `--impl` and the drill all
run through one of these; `grpolab.functions.core_functions` chooses it."""


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


def _check_policy_options(eps_low, eps_high, level: str, loss: str, delta, dual_clip) -> None:
    """Each option as its unit declares it (grpolab.objective), named by the keyword."""
    check_value("epsilon", eps_low, "eps_low")
    check_value("epsilon_high", eps_high, "eps_high")
    check_value("importance_sampling_level", level)
    if loss != "clip" and loss not in SURROGATES:
        raise ValueError(f"loss={loss!r} is not one of {['clip', *SURROGATES]}")
    check_value("delta", delta)
    check_value("dual_clip", dual_clip)
    if loss != "clip" and (delta is not None or dual_clip is not None):
        raise ValueError(f"delta and dual_clip bound the clipped surrogate; {loss} has none")


def _check_surrogate_options(loss: str, options: dict) -> None:
    allowed = SURROGATE_OPTIONS.get(loss, ())
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"loss={loss!r} takes no options {unknown}; its own: {list(allowed)}")


def _check_advantage_options(scale: str, std: str, estimator: str) -> None:
    check_value("scale_rewards", scale, "scale")
    check_value("advantage_std", std, "std")
    check_value("advantage_estimator", estimator, "estimator")


__all__ = [
    "AGGREGATIONS",
    "CONVENTION_KWARGS",
    "CORE_FUNCTIONS",
    "KL_ESTIMATORS",
    "LOSS_OPTION_DEFAULTS",
    "LOSS_TYPES",
    "LOSS_TYPE_ALIASES",
    "MENU_FUNCTIONS",
    "PROFILES",
    "PROFILE_SOURCES",
    "TIS_MODES",
    "WHITEN_EPS",
    "CoreFunctions",
    "Objective",
    "accepted_kwargs",
    "aggregate",
    "aggregation",
    "group_advantages",
    "grpo_loss",
    "importance_ratio",
    "informative_groups",
    "kl_estimate",
    "kl_k3",
    "masked_mean",
    "micro_batch_scale",
    "normaliser_count",
    "objective_card",
    "policy_loss",
    "position_ids",
    "rows_without_gradient",
    "sequence_logprobs",
    "tis_weights",
    "token_entropy",
    "truncation_mask",
    "whiten",
]
