"""The float64 references the checks hold each function to, written apart from the code they
check: the model's own log-probs with the log-softmax in float64, the declared advantages,
importance ratio and policy term. The units of the objective bring their own pieces (a
surrogate's term, an estimator's advantages, the KL's conventions); this module composes them
for the declared objective."""

from __future__ import annotations

import math

import torch

from grpolab import core
from grpolab.core import Objective
from grpolab.objective import ESTIMATORS, SURROGATES, delta, dual_clip, log_ratio_clamp

# --- Log-probs -----------------------------------------------------------------------------------


def logits(model, input_ids, attention_mask) -> torch.Tensor:
    """The model's own logits at the positions that predict a token: [B, T-1, V]."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=core.position_ids(attention_mask),
    )
    return out.logits[:, :-1]


def logprobs_of(logits, input_ids, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """log_softmax(logits / T) computed in `dtype`, at the sampled tokens: [B, T-1]."""
    logp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def float64_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    """(logp [B, T-1] float64, mask [B, T-1]) with the log-softmax in float64, zeros where
    masked; differentiable. The logits are the model's own, in its dtype: on a float64 copy
    of the model this is the float64 reference of the whole computation (the seed's code is
    not, even there: it casts the logits to float32 before its log-softmax)."""
    out = logits(model, input_ids, attention_mask)
    logp = logprobs_of(out, input_ids, temperature, torch.float64)
    mask = completion_mask[:, 1:].double()
    return logp * mask, mask


def logprobs_and_plain(model, batch, temperature: float):
    """The log-softmax of the model's own logits in float64 (the reference) and in float32
    (the seed's plain path, what a correct implementation is held to): two [B, T-1]."""
    with torch.no_grad():
        out = logits(model, batch.input_ids, batch.attention_mask)
        return tuple(
            logprobs_of(out, batch.input_ids, temperature, dtype)
            for dtype in (torch.float64, torch.float32)
        )


# --- Advantages ----------------------------------------------------------------------------------


def advantages(
    rewards: torch.Tensor, G: int, o: Objective, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 advantages of the declared convention and estimator (scale: group)."""
    r = rewards.double().view(-1, G)
    centred = r - r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=o.advantage_std == "sample", keepdim=True)
    if o.advantage_estimator != "grpo":
        adv = ESTIMATORS[o.advantage_estimator].reference(rewards, G, o, lengths).view_as(r)
    else:  # a flat group with eps = 0 is 0 / 0: 0, as group_advantages defines it
        scale = std + o.advantage_eps
        adv = torch.where(scale > 0, centred / scale.clamp(min=1e-300), torch.zeros_like(centred))
    if o.zero_std_guard:
        adv = torch.where(std > o.advantage_eps, adv, torch.zeros_like(adv))
    return adv.view(-1)


# --- The ratio and the policy term -------------------------------------------------------------


def log_ratio_bounds(o: Objective) -> list[float]:
    """Every log-ratio at which the declared policy term changes branch (sorted): the clip's
    1 - eps and 1 + eps_high with delta and dual-clip's c, or the surrogate's own bounds; the
    log-ratio clamp."""
    if o.policy_term == "clip":
        clip = [1 - o.epsilon, 1 + o.epsilon_high]
        ratios = [*clip, *delta.BOUND.bounds(o), *dual_clip.BOUND.bounds(o)]
    else:
        ratios = SURROGATES[o.policy_term].bounds(o)
    bounds = [math.log(r) for r in ratios if r > 0]
    return sorted(set(bounds + log_ratio_clamp.bounds(o)))


def ratio(o: Objective, logp_new, logp_old, mask, level: str | None = None) -> torch.Tensor:
    """float64 importance ratio at `level` (None: the declared one)."""
    new, old = logp_new.double(), logp_old.double()
    log_ratio = torch.where(mask.bool(), new - old, torch.zeros_like(new))
    if o.log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-o.log_ratio_clamp, o.log_ratio_clamp)
    if (level or o.importance_sampling_level) == "sequence":
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    return torch.exp(log_ratio)


def policy(o: Objective, logp_new, logp_old, adv, mask):
    """float64 per-token loss [B, T] of the declared policy term (differentiable w.r.t.
    logp_new), and the tokens where its bound is active (the clip; a surrogate's own)."""
    new, valid = logp_new.double(), mask.bool()
    r = ratio(o, new, logp_old, mask)
    A = adv.double().unsqueeze(1)
    if o.policy_term != "clip":
        per_token, active = SURROGATES[o.policy_term].reference(r, A, new, valid, o)
    else:
        clipped = r.clamp(1 - o.epsilon, 1 + o.epsilon_high)
        unclipped = r if o.delta is None else r.clamp(max=o.delta)
        per_token = -torch.min(unclipped * A, clipped * A)
        if o.dual_clip is not None:
            per_token = torch.where(A < 0, torch.min(per_token, -A * o.dual_clip), per_token)
        active = (r * A) > (clipped * A)
    return per_token.expand_as(new), active.expand_as(new) & valid
