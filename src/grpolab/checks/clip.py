"""Goal 4, the clip: min acts in both directions, eps_low and eps_high on the right sides, on
probe ratios on both sides of both bounds and both signs of the advantage (`Context.clip_case`,
placed off every bound of the declared objective). Under a surrogate of another kind (CISPO,
SAPO) the same checks hold its own term to its float64 reference; the options' checks live in
their units (grpolab.objective)."""

from __future__ import annotations

import torch

from grpolab.check import Check, Mutant
from grpolab.objective.base import max_abs


def measured(ctx):
    """The clip case's (per_token, clip_frac, grad) and reference (per_token, active, grad),
    the valid tokens and those between the two bounds, once per run."""

    def compute():
        o = ctx.objective
        logp_new, logp_old, adv, mask = ctx.clip_case()
        impl, ref = ctx.values_and_grads(logp_new, logp_old, adv, mask)
        valid = mask.bool()
        # Tokens whose ratio lies between the two bounds: clipped or not depends on which eps
        # is applied on which side. clip.asymmetric judges them; the other checks judge the
        # rest, whose treatment no assignment of the two eps changes (so each measures its
        # own thing).
        r = torch.exp(logp_new.double() - logp_old.double())  # [4, 8]
        small, large = sorted((o.epsilon, o.epsilon_high))
        between = valid & (
            ((r >= 1 - large) & (r <= 1 - small)) | ((r >= 1 + small) & (r <= 1 + large))
        )
        return impl, ref, valid, between

    return ctx.memo("clip.case", compute)


def values(ctx):
    (per_token, _, _), (ref, _, _), valid, between = measured(ctx)
    gap = max_abs((per_token.double() - ref)[valid & ~between])
    return ctx.result(
        "max |per_token - (-min(r*A, clip(r)*A))| on a perturbed policy, both signs of A "
        "(ratios off the band between the two bounds)",
        gap,
        "<= 1e-5",
        gap <= 1e-5,
    )


def gradient(ctx):
    (_, _, grad), (_, _, ref_grad), valid, between = measured(ctx)
    outside = valid & ~between
    zero = outside & (ref_grad == 0)  # where the declared loss is flat: the clip is active
    clipped_grad = max_abs(grad[zero])
    live = outside & ~zero
    min_live = grad[live].abs().min().item() if live.any() else 1.0
    return ctx.result(
        f"max |grad| on clipped tokens (min |grad| elsewhere {min_live:.2g})",
        clipped_grad,
        "== 0 on clipped, != 0 elsewhere",
        clipped_grad == 0.0 and min_live > 0,
    )


def asymmetric(ctx):
    o = ctx.objective
    (per_token, _, _), (ref, _, _), _, between = measured(ctx)
    mismatch = int(((per_token.double() - ref).abs() > 1e-5)[between].sum())
    return ctx.result(
        f"tokens between 1+-eps_low and 1+-eps_high treated wrongly (eps {o.epsilon:g}/"
        f"{o.epsilon_high:g})",
        mismatch,
        "0",
        mismatch == 0,
    )


def clip_frac(ctx):
    (_, frac, _), (_, active, _), valid, _ = measured(ctx)
    direct = active.double().sum().item() / valid.sum().item()
    gap = abs(float(frac) - direct)
    return ctx.result(
        f"|clip_frac - direct count| (direct {direct:.3f})", gap, "<= 1e-6", gap <= 1e-6
    )


CHECKS = (
    Check(
        "clip.values",
        4,
        "per_token = -torch.min(ratio * A, clamp(ratio, 1 - eps_low, 1 + eps_high) * A): min "
        "(not max), and the minus sign because we minimise",
        values,
        mutants=(Mutant("max_not_min"),),
    ),
    Check(
        "clip.gradient",
        4,
        "the clipped term must be the active one (and get no gradient) only where it is "
        "smaller: check torch.min and the clamp bounds",
        gradient,
    ),
    Check(
        "clip.asymmetric",
        4,
        "eps_low bounds the ratio from below (1 - eps_low), eps_high from above (1 + eps_high): "
        "are they swapped?",
        asymmetric,
        mutants=(Mutant("eps_swapped"),),
        # A clip that acts where it should off the band between the two bounds (clip.gradient
        # passes) with wrong values has its bounds misplaced; one that acts in the wrong places
        # is wrong in its values first (min for max).
        blame_before="clip.values",
        blame_unless="clip.gradient",
    ),
    Check(
        "clip.clip_frac",
        4,
        "clip_frac = masked mean of ((ratio * A) > (clipped * A)) over completion tokens",
        clip_frac,
    ),
)
