"""GSPO (`importance_sampling_level: sequence`): one ratio per sequence, exp of the MEAN of its
tokens' log-ratios, clipped per sequence; each of its tokens carries that value
(core.importance_ratio computes it). A sequence-level loss is one value per sequence: under
the sequence aggregation each sequence weighs the same."""

from __future__ import annotations

from dataclasses import dataclass

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
    value_gap = abs(float(loss) - float(expected.detach()))
    gap = max(value_gap, max_abs(new.grad.double() - ref_new.grad))
    return ctx.result(
        f"max |loss or its grad - sequence-level loss under {ctx.objective.aggregation} "
        "aggregation| (lengths 6, 3, 2)",
        gap,
        "<= 1e-5",
        gap <= 1e-5,
    )


def _declared(ctx) -> bool:
    return ctx.objective.importance_sampling_level == "sequence"


GSPO = Option(
    name="gspo",
    keys=GspoKeys,
    loss=(Passed("importance_sampling_level", "importance_sampling_level", "token", policy=True),),
    card=_card,
    checks=(
        Check(
            "gspo.ratio",
            4,
            "GSPO's ratio is exp of the MEAN of a sequence's token log-ratios (masked), one per "
            "sequence, clipped per sequence: exp of the sum shrinks long sequences to 0",
            gspo_ratio,
            when=_declared,
            mutants=(Mutant("gspo_exp_of_sum", SEQUENCE),),
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
