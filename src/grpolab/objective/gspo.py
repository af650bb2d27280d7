"""GSPO (`importance_sampling_level: sequence`): one ratio per sequence, exp of the MEAN of its
tokens' log-ratios, clipped per sequence; each of its tokens carries that value
(core.importance_ratio computes it). A sequence-level loss is one value per sequence: under
the sequence aggregation each sequence weighs the same."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from grpolab.check import Check, Mutant
from grpolab.objective.base import Option, Passed, max_abs
from grpolab.schema import key

SEQUENCE = {"importance_sampling_level": "sequence"}


@dataclass(frozen=True)
class GspoKeys:
    # token | sequence (GSPO): the level of the importance ratio.
    importance_sampling_level: str = key("token", choices=("token", "sequence"))


def _card(o) -> dict[str, str]:
    if o.importance_sampling_level != "sequence":
        return {}
    return {
        "ratio": "exp(mean over the sequence's tokens of logp_new - logp_old) per sequence "
        f"(GSPO) * at temperature {o.temperature:g}"
    }


def _case(ctx):
    """Unequal lengths; ratios whose per-sequence geometric mean is inside the clip range for
    one row and outside for the other."""
    return ctx.ratio_case(
        [
            [1.1, 0.95, 1.05, 1.0, 1.02, 0.98],
            [1.6, 1.4, 1.5, 1.0, 1.0, 1.0],
            [0.9, 1.1, 1, 1, 1, 1],
        ],
        [1.0, 1.0, -0.5],
        [6, 3, 2],
    )


def gspo_ratio(ctx):
    case = _case(ctx)
    (values, _, _), (ref, _, _) = ctx.values_and_grads(*case)
    gap = max_abs((values.double() - ref)[case[3].bool()])
    return ctx.result(
        "max |per_token - sequence-level clipped surrogate (exp of the mean log-ratio)|",
        gap,
        "<= 1e-5",
        gap <= 1e-5,
    )


def gspo_length_weighting(ctx):
    logp_new, logp_old, adv, mask = _case(ctx)
    L = mask.shape[1]
    new = logp_new.clone().requires_grad_(True)
    loss, _ = ctx.loss(new, logp_old, None, adv, mask, L=L)
    ctx.backward(loss)
    ref_new = logp_new.double().clone().requires_grad_(True)
    per_token, _ = ctx.reference_policy(ref_new, logp_old, adv, mask)
    expected = ctx.aggregate(per_token, mask.double(), L)
    expected.backward()
    value_gap = abs(float(loss.detach()) - float(expected.detach()))
    gap = max(value_gap, max_abs(new.grad.double() - ref_new.grad))
    return ctx.result(
        f"max |loss or its grad - sequence-level loss under {ctx.objective.aggregation} "
        "aggregation| (lengths 6, 3, 2)",
        gap,
        "<= 1e-5",
        gap <= 1e-5,
    )


F32_EPS = float(torch.finfo(torch.float32).eps)


def wide_clip(o):
    """The declared ratio under the clipped surrogate with bounds no probe reaches: at A = 1
    each token's loss is -ratio for any ratio in (1e-6, 1e9)."""
    return dataclasses.replace(
        o, loss_type=o.aggregation, surrogate=None, epsilon=1 - 1e-6, epsilon_high=1e9,
        delta=None, dual_clip=None,
    )  # fmt: skip


def stale_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp_new, logp_old, mask) [4, 300] float32: a stale 300-token sequence (0.7 per token,
    exp of its summed log-ratio below float32's range), and 6, 2 and 1 tokens of mixed
    log-ratios (where a mean of ratios is not exp of the mean log-ratio)."""
    T = 300
    logp_old = -torch.linspace(0.3, 2.5, 4 * T).view(4, T)
    log_r = torch.zeros(4, T)
    log_r[0] = math.log(0.7)
    log_r[1, :6] = torch.tensor([0.3, -0.2, 0.25, -0.1, 0.05, 0.4])
    log_r[2, :2] = torch.tensor([-0.5, 0.45])
    log_r[3, :1] = 0.2
    mask = (torch.arange(T)[None, :] < torch.tensor([T, 6, 2, 1])[:, None]).float()
    return logp_old + log_r, logp_old, mask


def ratio_gaps(ctx, logp_new, logp_old, mask) -> torch.Tensor:
    """Each sequence's ratio read off the implementation's policy loss (wide_clip, A = -1:
    each token's loss is max(ratio, clipped ratio)) at its token of least ratio, where a
    clip of that token's own ratio could not hide the sequence's (that is gspo.ratio's to
    find), against float64 exp of its mean masked log-ratio: [B] relative gaps over the
    float32 rounding of the mean (<= 1 passes; inf where a ratio is not finite)."""
    probe = ctx.with_objective(wide_clip(ctx.objective))
    B = logp_new.shape[0]
    per_token, _ = probe.policy(logp_new, logp_old, -torch.ones(B), mask)
    log_r = torch.where(mask.bool(), logp_new.double() - logp_old.double(), math.inf)
    least = log_r.argmin(1)  # [B]
    got = per_token.detach().double().gather(1, least[:, None]).squeeze(1)  # [B]
    expected = probe.reference_ratio(logp_new, logp_old, mask, "sequence").squeeze(1)
    size = (logp_new.double().abs() + logp_old.double().abs()) * mask
    tol = 8 * F32_EPS * (size.sum(1) / mask.sum(1).clamp(min=1) + 1)
    gap = (got - expected).abs() / (expected * tol)
    return torch.where(torch.isfinite(got), gap, math.inf)[mask.sum(1) > 0]


def gspo_sequence_ratio(ctx):
    """GSPO's ratio is the geometric mean of its token ratios: exp of the mean masked
    log-ratio, so ratio^L is their product. On stale and mixed designed rows and, where the
    batch has the engine's log-probs, on the real batch before any update (the trainer's
    log-probs against the engine's: 1 within the engine's gap): each against float64,
    finite (unsloth-zoo PR #870: a sum of token ratios; a product of 300 ratios of 0.7
    underflows float32)."""
    gaps = ratio_gaps(ctx, *stale_case())
    on = "stale and mixed designed rows"
    batch = ctx.batch
    if batch is not None and batch.engine_logprobs is not None:
        args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
        with torch.no_grad():
            logp, _ = ctx.impl.sequence_logprobs(ctx.model, *args, ctx.objective.temperature)
        mask = batch.completion_mask[:, 1:].float()
        gaps = torch.cat([gaps, ratio_gaps(ctx, logp, batch.engine_logprobs, mask)])
        on += " and the real batch against the engine's log-probs"
    worst = float(gaps.max())
    return ctx.result(
        f"max |sequence ratio - exp(mean log-ratio)| over its float32 rounding ({on})",
        worst,
        "<= 1",
        worst <= 1,
    )


def _declared(ctx) -> bool:
    return ctx.objective.importance_sampling_level == "sequence"


GSPO = Option(
    name="gspo",
    trl={"importance_sampling_level": "importance_sampling_level"},
    keys=GspoKeys,
    loss=(Passed("importance_sampling_level", unless="token", policy=True),),
    card=_card,
    checks=(
        Check(
            "gspo.sequence_ratio",
            4,
            "GSPO's sequence ratio is exp(mean of the masked token log-ratios), the L-th root of "
            "their product, computed in log space: not the mean or sum of the token ratios, and "
            "not a product of ratios, which under- or overflows on a long sequence",
            gspo_sequence_ratio,
            when=_declared,
            mutants=(
                Mutant("gspo_mean_of_ratios", SEQUENCE),
                Mutant("gspo_exp_of_sum", SEQUENCE),
            ),
            blame_before="clip.values",
            declared_only=True,
        ),
        Check(
            "gspo.ratio",
            4,
            "GSPO's ratio is exp of the MEAN of a sequence's token log-ratios (masked), one per "
            "sequence, clipped per sequence: exp of the sum shrinks long sequences to 0",
            gspo_ratio,
            when=_declared,
            mutants=(Mutant("gspo_clip_per_token", SEQUENCE),),
            blame_before="clip.values",
            declared_only=True,
        ),
        Check(
            "gspo.length_weighting",
            4,
            "a sequence-level loss is one value per sequence: with the sequence aggregation each "
            "sequence weighs the same; averaging the broadcast value over all tokens weighs long "
            "sequences more",
            gspo_length_weighting,
            when=_declared,
            mutants=(Mutant("gspo_length_weighted", SEQUENCE),),
            blame_before="ratio.initial",
            declared_only=True,
        ),
    ),
)
