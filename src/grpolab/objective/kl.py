"""The KL term's conventions: the estimator (k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1 with
d = logp_ref - logp_new; the seed's is k3), a clamp (verl and OpenRLHF: 10, d clamped to twice
it first so exp cannot overflow) and TRL's bias correction (the KL term times the per-token
importance ratio). core.kl_estimate computes them; beta (the seed's) weighs the term."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from grpolab.check import Check, Mutant
from grpolab.objective.base import Option, Passed, max_abs
from grpolab.objective.profiles import profile_objective
from grpolab.schema import Inert, above_or_off, key

FORMULAS = {
    "k1": "k1 = logp_new - logp_ref",
    "k2": "k2 = (logp_new - logp_ref)^2 / 2",
    "k3": "k3 = exp(d) - d - 1 with d = logp_ref - logp_new",
}


@dataclass(frozen=True)
class KlKeys:
    kl_estimator: str = key("k3", choices=tuple(FORMULAS))
    kl_clamp: float | None = key(None, **above_or_off(0, " (verl: 10)"))
    use_bias_correction_kl: bool = False  # the KL term times the importance ratio (TRL's)


def reference(logp_new, logp_ref, o) -> torch.Tensor:
    """float64 per-token KL estimate of the declared estimator and clamp."""
    d = logp_ref.double() - logp_new.double()
    if o.kl_estimator == "k1":
        value = -d
    elif o.kl_estimator == "k2":
        value = d * d / 2
    else:
        if o.kl_clamp is not None:
            d = d.clamp(-2 * o.kl_clamp, 2 * o.kl_clamp)
        value = torch.exp(d) - d - 1
    return value if o.kl_clamp is None else value.clamp(-o.kl_clamp, o.kl_clamp)


def _card(o) -> dict[str, str]:
    if o.beta == 0:
        return {"KL": "off (beta = 0, no reference model)"}
    text = f"{FORMULAS[o.kl_estimator]}, beta = {o.beta:g}{o.mark('kl_estimator')}"
    if o.kl_clamp is not None:
        text += f"; clamped to +-{o.kl_clamp:g} *"
    if o.use_bias_correction_kl:
        text += "; times the importance ratio (bias correction) *"
    return {"KL": text}


def kl_convention(ctx):
    """The declared KL term in the assembled loss: at A = 0 the loss is the aggregated
    beta * KL (times the importance ratio under use_bias_correction_kl). Its value: the
    gradient is kl.gradient's (grpolab.checks.kl)."""
    o = ctx.objective
    g = torch.Generator().manual_seed(ctx.settings.seed + 2)
    logp_new, logp_old, _, mask = ctx.clip_case()
    logp_ref = logp_new + torch.randn(logp_new.shape, generator=g)
    if o.kl_clamp is not None:  # gaps where the clamps act
        logp_ref[0, :3] = logp_new[0, :3] + torch.tensor([12.0, -15.0, 25.0])
    beta = o.beta if o.beta > 0 else 0.04
    loss, _ = ctx.loss(logp_new, logp_old, logp_ref, torch.zeros(4), mask, beta=beta, L=8)
    per_token = beta * reference(logp_new, logp_ref, o)
    if o.use_bias_correction_kl:
        per_token = per_token * ctx.reference_ratio(logp_new, logp_old, mask, "token")
    expected = ctx.aggregate(per_token, mask.double(), 8)
    # float32 against float64: relative to the size of the value
    value, want = float(loss.detach()), float(expected.detach())
    gap = abs(value - want) / max(1.0, abs(want))
    what = f"{o.kl_estimator}" + (f", clamp {o.kl_clamp:g}" if o.kl_clamp else "")
    what += ", x importance ratio" if o.use_bias_correction_kl else ""
    return ctx.result(f"|loss - beta * KL ({what})| at A = 0", gap, "<= 1e-5", gap <= 1e-5)


def kl_bias_correction_gradient(ctx):
    """Under GSPO (sequence-level ratio) with KL bias correction, d loss / d logp_new of the
    KL term equals a float64 reference whose KL is multiplied by the per-token ratio. A [B, 1]
    sequence ratio gives nearly the same loss and another gradient (TRL #6586): measured with
    the policy term's share removed."""
    o = dataclasses.replace(ctx.objective, importance_sampling_level="sequence")
    gspo = ctx.with_objective(o)
    g = torch.Generator().manual_seed(ctx.settings.seed + 3)
    logp_new, logp_old, adv, mask = (t.double() for t in gspo.clip_case())
    logp_ref = logp_new + 0.5 * torch.randn(logp_new.shape, generator=g, dtype=torch.float64)
    beta = o.beta if o.beta > 0 else 0.04

    def grad_of(b: float) -> torch.Tensor:
        new = logp_new.clone().requires_grad_(True)
        loss, _ = gspo.loss(new, logp_old, logp_ref, adv, mask, beta=b, L=8)
        (grad,) = torch.autograd.grad(torch.as_tensor(loss), new)
        return grad.double()

    kl_grad = grad_of(beta) - grad_of(0.0)  # the KL term's share of the gradient [4, 8]
    ref_new = logp_new.double().clone().requires_grad_(True)
    ratio = gspo.reference_ratio(ref_new, logp_old, mask, "token")
    per_token = beta * reference(ref_new, logp_ref, o) * ratio
    (expected,) = torch.autograd.grad(gspo.aggregate(per_token, mask.double(), 8), ref_new)
    gap = max_abs(kl_grad - expected) / max(max_abs(expected), 1e-12)
    # float64 inputs: grpolab's is ~1e-13 off; a loss computed in float32 inside ~1e-6 (the
    # policy term's gradient cancels in the difference); a sequence ratio is ~0.5 off.
    return ctx.result(
        "max |grad of the KL term - float64 reference (KL x per-token ratio)| / max |grad| "
        "(GSPO, bias correction)",
        gap,
        "<= 1e-4",
        gap <= 1e-4,
    )


def convention_declared(o) -> bool:
    return (o.kl_estimator, o.kl_clamp, o.use_bias_correction_kl) != ("k3", None, False)


def _bias_correction_declared(ctx) -> bool:
    """Where the KL is bias-corrected with the clipped surrogate and the loss takes a
    sequence-level ratio (GSPO)."""
    o = ctx.objective
    return (
        o.use_bias_correction_kl
        and o.policy_term == "clip"
        and ctx.takes("grpo_loss", "importance_sampling_level")
    )


TRL = profile_objective("trl", beta=0.04)
KL = Option(
    name="kl",
    trl={"use_bias_correction_kl": "use_bias_correction_kl"},
    reads_every_row="beta",
    keys=KlKeys,
    loss=(
        Passed("kl_estimator", unless="k3", convention=True),
        Passed("kl_clamp", unless=None, convention=True),
        Passed("use_bias_correction_kl", unless=False, convention=True),
    ),
    card=_card,
    inert=(
        Inert(
            ("objective.kl_estimator", "objective.kl_clamp", "objective.use_bias_correction_kl"),
            ("objective.beta",),
            lambda c: c.objective.beta == 0,
            "with objective.beta=0: there is no KL term (set objective.beta > 0 for one)",
        ),
    ),
    checks=(
        Check(
            "kl.convention",
            5,
            "the declared KL: estimator (k1 = -d, k2 = d^2/2, k3 = exp(d) - d - 1 with d = ref - "
            "new), clamp, and for use_bias_correction_kl the KL times the importance ratio",
            kl_convention,
            when=lambda ctx: convention_declared(ctx.objective),
            mutants=(
                Mutant("kl_without_ratio", TRL),
                Mutant("kl_unclamped", profile_objective("verl", beta=0.04)),
            ),
            blame_before="kl.gradient",  # a wrong value has a wrong gradient too
            declared_only=True,
        ),
        Check(
            "kl.bias_correction_gradient",
            5,
            "KL bias correction multiplies each token's KL by that token's own ratio "
            "exp(logp_new - logp_old), even under GSPO: the sequence ratio [B, 1] adds every "
            "token's KL to every other token's gradient while the loss looks normal (TRL #6586)",
            kl_bias_correction_gradient,
            when=_bias_correction_declared,
            mutants=(Mutant("kl_sequence_ratio", TRL),),
            blame_before="kl.gradient",  # the case of it that GSPO's sequence ratio gets wrong
            declared_only=True,
        ),
    ),
)
