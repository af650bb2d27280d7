"""The GRPO core: log-probs, group advantages, clipped ratio, k3 KL, aggregation, loss.

GRPO's twenty lines, exact, plus the variants users of GRPO trainers rely on. Every
function is a pure function of tensors. Shapes: B sequences (= n_prompts * G, the G samples
of a prompt contiguous), T tokens per sequence; log-prob tensors are [B, T-1], aligned with
input_ids[:, 1:].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

ADVANTAGE_SCALES = ("group", "batch", "none")
AGGREGATIONS = ("sequence", "token", "constant")
# TRL's loss_type names for the same normalisers.
LOSS_TYPE_ALIASES = {"grpo": "sequence", "bnpo": "token", "dapo": "token", "dr_grpo": "constant"}
LOGPROB_SOURCES = ("trainer", "engine")


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each sampled token under `model` at the sampling temperature.

    input_ids, attention_mask, completion_mask: [B, T] (prompt + completion, padded).
    Returns (logp [B, T-1] float32, mask [B, T-1] float32); logp[:, t] is the log-prob of
    input_ids[:, t+1], mask[:, t] = completion_mask[:, t+1].
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
    return token_logprobs, mask


# --- Group-relative advantages ----------------------------------------------------------------


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Reward minus its group's mean, divided by a std; exactly 0 where a group's std <= eps.

    rewards: [B], B = n_groups * group_size, the samples of one group contiguous.
    scale: "group" (population std of the group), "batch" (population std of the whole
    batch), "none" (mean-centred only, Dr. GRPO). Returns [B].
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale={scale!r} is not one of {list(ADVANTAGE_SCALES)}")
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

    r = rewards.view(-1, group_size)  # [n_groups, G]
    mean = r.mean(dim=1, keepdim=True)  # [n_groups, 1]
    std = r.std(dim=1, unbiased=False, keepdim=True)  # population std: divide by G
    if scale == "group":
        adv = (r - mean) / (std + eps)
    elif scale == "batch":
        adv = (r - mean) / (rewards.std(unbiased=False) + eps)
    else:
        adv = r - mean
    # The most important line: a group with (near) zero spread teaches nothing; a std of
    # 1e-8 would otherwise turn float noise into huge advantages.
    adv = torch.where(std > eps, adv, torch.zeros_like(adv))
    return adv.view(-1)


# --- Ratio and the clipped surrogate ----------------------------------------------------------


def policy_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate -min(ratio * A, clip(ratio, 1-eps_low, 1+eps_high) * A).

    logp_new, logp_old, mask: [B, T]; advantages: [B], broadcast to every token ("score by
    sequence, take gradients by token"). Returns (per_token [B, T], clip_frac scalar): the
    masked fraction of tokens where the clipped term is the active one (it gets no gradient).
    """
    _check_loss_inputs(logp_new, logp_old, None, advantages, mask)
    _check_clip(eps_low, eps_high)
    valid = mask.bool()
    adv = advantages.unsqueeze(1)  # [B, 1]
    # Masked positions get log-ratio 0: garbage there (inf, NaN) must not leak into the
    # loss or the gradient through 0 * inf.
    log_ratio = torch.where(valid, logp_new - logp_old, torch.zeros_like(logp_new))
    ratio = torch.exp(log_ratio)  # [B, T]
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)  # [B, T]; minus: we minimise
    with torch.no_grad():
        clip_frac = masked_mean(((ratio * adv) > (clipped * adv)).float(), mask)
    return per_token, clip_frac


# --- KL to the reference ----------------------------------------------------------------------


def kl_k3(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(new || ref) per token: exp(d) - d - 1, d = ref - new.

    Never negative, unbiased over samples from the new policy, low variance. [B, T] -> [B, T].
    """
    if logp_new.shape != logp_ref.shape:
        raise ValueError(
            f"logp_new {tuple(logp_new.shape)} and logp_ref {tuple(logp_ref.shape)} differ"
        )
    d = logp_ref - logp_new
    return torch.exp(d) - d - 1


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
    B * max_completion_length shares its max_completion_length). mask: [b, T]."""
    return float(mask.sum()) if aggregation(loss_type) == "token" else float(mask.shape[0])


def micro_batch_scale(
    loss_type: str,
    micro_mask: torch.Tensor,
    minibatch_mask: torch.Tensor,
    minibatch_count: float | None = None,
) -> float:
    """Factor turning a micro-batch's `aggregate` loss into its share of the loss of the whole
    minibatch, so that gradients accumulated over micro-batches equal the one-pass gradient:
    sequence -> b_micro / b_mini; token -> tokens_micro / tokens_mini (aggregate clamps the
    count at 1); constant -> b_micro / b_mini (same max_completion_length).
    `minibatch_count`: the minibatch's `normaliser_count` over all ranks; None: this
    process's minibatch alone. Masks: [b, T]."""
    total = (
        normaliser_count(loss_type, minibatch_mask) if minibatch_count is None else minibatch_count
    )
    if aggregation(loss_type) == "token":
        return float(micro_mask.sum().clamp(min=1)) / max(total, 1.0)
    return micro_mask.shape[0] / total


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
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate + beta * k3 KL per token, aggregated by `loss_agg`.

    logp_new, logp_old, logp_ref, mask: [B, T]; advantages: [B]. Returns (loss scalar,
    metrics). Every token statistic in the metrics is a mean over masked tokens only.
    token_weights [B, T] (optional, no gradient) multiply the policy term per token: the
    truncated importance weights that correct for an engine sampling from slightly other
    numerics than the trainer's (see `tis_weights`).
    """
    _check_loss_inputs(logp_new, logp_old, logp_ref, advantages, mask)
    if token_weights is not None and token_weights.shape != logp_new.shape:
        raise ValueError(
            f"token_weights {tuple(token_weights.shape)} must match logp_new "
            f"{tuple(logp_new.shape)}"
        )
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and logp_ref is None:
        raise ValueError(f"beta={beta} > 0 needs logp_ref (reference log-probs), got None")
    per_token, clip_frac = policy_loss(logp_new, logp_old, advantages, mask, eps_low, eps_high)
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    kl = None
    if logp_ref is not None:
        valid, zeros = mask.bool(), torch.zeros_like(logp_new)
        # 0 on both sides at masked positions: k3 = 0 there and garbage cannot reach the grad.
        kl = kl_k3(torch.where(valid, logp_new, zeros), torch.where(valid, logp_ref, zeros))
        if beta > 0:
            per_token = per_token + beta * kl
    loss = aggregate(per_token, mask, loss_agg, max_completion_length)

    with torch.no_grad():
        log_ratio = torch.where(mask.bool(), logp_new - logp_old, torch.zeros_like(logp_new))
        ratio = torch.exp(log_ratio)
        adv = advantages.unsqueeze(1).expand_as(ratio)
        low = ((ratio < 1 - eps_low) & (adv < 0)).float()
        high = ((ratio > 1 + eps_high) & (adv > 0)).float()
        metrics = {
            "loss": loss.item(),
            "clip_frac": clip_frac.item(),
            "clip_frac_low": masked_mean(low, mask).item(),
            "clip_frac_high": masked_mean(high, mask).item(),
            "kl": masked_mean(kl, mask).item() if kl is not None else 0.0,
            "adv_std": advantages.std().item() if advantages.numel() > 1 else 0.0,
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
    return loss, metrics


def tis_weights(
    logp_trainer: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance weights min(pi_trainer / pi_engine, cap) per token: [B, T].

    The engine sampled from pi_engine; the loss is built on the trainer's pi_trainer. Their
    ratio reweights each sampled token to the trainer's distribution; the cap bounds the
    variance. 1 at masked positions.
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    _check_same_shape(logp_trainer=logp_trainer, logp_engine=logp_engine, mask=mask)
    log_w = torch.where(mask.bool(), logp_trainer - logp_engine, torch.zeros_like(logp_trainer))
    return torch.exp(log_w).clamp(max=cap)


# --- The objective: one record of what is optimised -------------------------------------------


def aggregation(loss_type: str) -> str:
    """The normaliser a loss_type names: one of AGGREGATIONS, TRL's aliases resolved."""
    resolved = LOSS_TYPE_ALIASES.get(loss_type, loss_type)
    if resolved not in AGGREGATIONS:
        valid = list(AGGREGATIONS) + sorted(LOSS_TYPE_ALIASES)
        raise ValueError(f"loss_type={loss_type!r} is not one of {valid}")
    return resolved


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
    tis_cap: float | None = None  # truncated importance weights against the engine

    def __post_init__(self) -> None:
        agg = aggregation(self.loss_type)
        if agg == "constant" and not self.max_completion_length:
            raise ValueError('loss_type="constant" needs max_completion_length > 0')
        if self.scale_rewards not in ADVANTAGE_SCALES:
            raise ValueError(
                f"scale_rewards={self.scale_rewards!r} is not one of {list(ADVANTAGE_SCALES)}"
            )
        if self.logprob_source not in LOGPROB_SOURCES:
            raise ValueError(
                f"logprob_source={self.logprob_source!r} is not one of {list(LOGPROB_SOURCES)}"
            )
        _check_clip(self.epsilon, self.epsilon_high)

    @property
    def aggregation(self) -> str:
        return aggregation(self.loss_type)

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
        """The keyword arguments of `group_advantages` (after rewards and group size)."""
        return {"scale": self.scale_rewards, "eps": self.advantage_eps}

    def loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `grpo_loss` (after the tensors) that this objective sets."""
        return {
            "eps_low": self.epsilon,
            "eps_high": self.epsilon_high,
            "beta": self.beta,
            "loss_agg": self.loss_type,
            "max_completion_length": self.max_completion_length,
        }

    @property
    def on_policy(self) -> bool:
        """logp_old is the sampling policy's own log-probs, taken by the trainer."""
        return self.logprob_source == "trainer"


def objective_card(config: Any) -> str:
    """The resolved objective on one screen, printed at the start of every run.

    `config`: anything `Objective.of` takes."""
    o = Objective.of(config)
    agg = o.aggregation
    normaliser = {
        "sequence": "mean over each sequence's completion tokens, then mean over sequences",
        "token": "sum over all completion tokens / number of completion tokens",
        "constant": f"sum over all completion tokens / (B * {o.max_completion_length})",
    }[agg]
    std = {
        "group": "population std of the group (divide by G)",
        "batch": "population std of the whole batch",
        "none": "none: mean-centred only (Dr. GRPO)",
    }[o.scale_rewards]
    source = {
        "trainer": "an extra forward of the training model before any update (exact)",
        "engine": "the rollout engine's log-probs (saves a forward, biased)",
    }[o.logprob_source]
    kl = (
        "off (beta = 0, no reference model)"
        if o.beta == 0
        else f"k3 = exp(d) - d - 1 with d = logp_ref - logp_new, beta = {o.beta:g}"
    )
    lines = [
        "GRPO objective",
        f"  groups        G = {o.num_generations} samples per prompt, contiguous",
        f"  advantage     (r - mean_group) / ({std} + {o.advantage_eps:g});"
        f" exactly 0 where group std <= {o.advantage_eps:g}",
        f"  ratio         exp(logp_new - logp_old) at temperature {o.temperature:g}",
        f"  logp_old      {source}",
        f"  clip          ratio in [1 - {o.epsilon:g}, 1 + {o.epsilon_high:g}] ="
        f" [{1 - o.epsilon:g}, {1 + o.epsilon_high:g}]; per token -min(ratio*A, clip(ratio)*A)",
        f"  KL            {kl}",
        f"  aggregation   {agg} ({o.loss_type}): {normaliser}",
        f"  inner epochs  num_iterations = {o.num_iterations}",
    ]
    if o.tis_cap is not None:
        lines.append(
            f"  engine        policy term x min(pi_trainer / pi_engine, {o.tis_cap:g}) per token"
        )
    return "\n".join(lines)


# --- The function table -----------------------------------------------------------------------

CORE_FUNCTIONS = (
    "sequence_logprobs",
    "group_advantages",
    "policy_loss",
    "kl_k3",
    "aggregate",
    "grpo_loss",
)


@dataclass
class CoreFunctions:
    """The six functions a GRPO step calls, and where each came from ("grpolab" or a user's
    file). The trainer, the preflight, `--impl` and the drill all run through one of these;
    `grpolab.functions.core_functions` chooses it."""

    sequence_logprobs: Callable = sequence_logprobs
    group_advantages: Callable = group_advantages
    policy_loss: Callable = policy_loss
    kl_k3: Callable = kl_k3
    aggregate: Callable = aggregate
    grpo_loss: Callable = grpo_loss
    source: dict[str, str] = field(default_factory=lambda: dict.fromkeys(CORE_FUNCTIONS, "grpolab"))
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
