"""Goal 5, the KL: k3 = exp(d) - d - 1 with d = logp_ref - logp_new, never negative, exactly 0
for equal policies, and with the mean over samples of the new policy equal to the exact KL.
On real next-token distributions of the user's model and a perturbed copy (the reference).
And its gradient, not only its value: kl_k3's and the assembled loss's KL term's, against
float64. The declared KL conventions' checks live in grpolab.objective.kl."""

from __future__ import annotations

import torch

from grpolab import core
from grpolab.check import Check, Mutant
from grpolab.objective.base import max_abs
from grpolab.objective.kl import reference as reference_kl


def distributions(ctx):
    """(logp_new, logp_ref [4, V] float64, kl_k3 over the vocabulary [4, V], the generator
    that drew the perturbation), once per run."""

    def compute():
        g = torch.Generator().manual_seed(ctx.settings.seed)
        batch = ctx.batch
        with torch.no_grad():
            logits = ctx.model(
                input_ids=batch.input_ids[:4],
                attention_mask=batch.attention_mask[:4],
                position_ids=core.position_ids(batch.attention_mask[:4]),
            ).logits[:, :-1]
            rows = logits[batch.completion_mask[:4, 1:].bool()][:4].double()  # [4, V]
        noise = torch.randn(rows.shape, generator=g, dtype=torch.float64)
        logp_new = torch.log_softmax(rows, -1)
        logp_ref = torch.log_softmax(rows + noise, -1)
        return logp_new, logp_ref, ctx.impl.kl_k3(logp_new, logp_ref), g

    return ctx.memo("kl.distributions", compute)


def nonnegative(ctx):
    _, _, kl, _ = distributions(ctx)
    lowest = kl.min().item()
    return ctx.result("min KL estimate over the vocabulary", lowest, ">= 0", lowest >= -1e-9)


def identical(ctx):
    logp_new, _, _, _ = distributions(ctx)
    same = max_abs(ctx.impl.kl_k3(logp_new, logp_new))
    return ctx.result("max |KL| for identical policies", same, "== 0", same <= 1e-9)


def tracks_exact(ctx):
    """The estimator's mean over samples of the new policy, in the limit of infinitely many
    samples: sum_v p_new(v) * estimate(v). Only k3 with d = ref - new gives KL(new || ref)."""
    logp_new, logp_ref, kl, g = distributions(ctx)
    exact = (logp_new.exp() * (logp_new - logp_ref)).sum(-1)  # [4]
    expected_estimate = (logp_new.exp() * kl.double()).sum(-1)  # [4]
    rel = ((expected_estimate - exact).abs() / exact.clamp(min=1e-12)).max().item()
    idx = torch.multinomial(logp_new.exp(), 4096, replacement=True, generator=g)  # [4, n]
    mc = ctx.impl.kl_k3(logp_new.gather(1, idx), logp_ref.gather(1, idx)).double().mean().item()
    return ctx.result(
        f"max relative gap of E_p[estimate] to the exact KL (KL {exact.mean().item():.3f}, "
        f"4096-sample mean {mc:.3f})",
        rel,
        "<= 1e-3",
        rel <= 1e-3,
    )


def gradient_case(ctx):
    """float64 (logp_new, logp_old, logp_ref, advantages, mask) with pi != pi_ref: the clip
    case's policies (padding in one row) and a reference 0.5 nats off per token; where a KL
    clamp is declared, gaps where it acts."""
    g = torch.Generator().manual_seed(ctx.settings.seed + 4)
    logp_new, logp_old, adv, mask = (t.double() for t in ctx.clip_case())
    logp_ref = logp_new + 0.5 * torch.randn(logp_new.shape, generator=g, dtype=torch.float64)
    if ctx.objective.kl_clamp is not None:
        logp_ref[0, :3] = logp_new[0, :3] + torch.tensor([12.0, -15.0, 25.0], dtype=torch.float64)
    return logp_new, logp_old, logp_ref, adv, mask


def _relative(got: torch.Tensor | None, expected: torch.Tensor) -> float:
    """max |got - expected| / max |expected|; no gradient at all (None) counts as 0."""
    got = torch.zeros_like(expected) if got is None else got.double()
    return max_abs(got - expected) / max(max_abs(expected), 1e-12)


def k3_gradient_gap(ctx, logp_new, logp_ref) -> float:
    """kl_k3's d sum(k3) / d logp_new against float64 1 - exp(d), d = logp_ref - logp_new."""
    new = logp_new.clone().requires_grad_(True)
    value = torch.as_tensor(ctx.impl.kl_k3(new, logp_ref))
    grad = None
    if value.requires_grad:
        (grad,) = torch.autograd.grad(value.sum(), new, allow_unused=True)
    return _relative(grad, 1 - torch.exp(logp_ref - logp_new))


def gradient(ctx):
    """The KL term carries the gradient of its value (SkyRL #1340: the estimator under
    torch.no_grad, so the KL loss was a constant; NeMo-RL PR #2506: k2's gradient equal to
    k1's). On a probe with pi != pi_ref, float64 inputs: kl_k3's gradient against float64
    1 - exp(d); the assembled loss's KL share of the gradient, grad(beta) - grad(0) (the
    policy term cancels), against the float64 gradient of beta x the declared estimator
    (clamp, bias correction: x the per-token ratio); d loss / d beta, (loss(beta) - loss(0)) /
    beta, against the aggregated KL, which is not 0 here."""
    o = ctx.objective
    logp_new, logp_old, logp_ref, adv, mask = gradient_case(ctx)
    beta = o.beta if o.beta > 0 else 0.04

    def loss_and_grad(b: float) -> tuple[float, torch.Tensor | None]:
        new = logp_new.clone().requires_grad_(True)
        loss, _ = ctx.loss(new, logp_old, logp_ref, adv, mask, beta=b, L=8)
        loss = torch.as_tensor(loss)
        (grad,) = torch.autograd.grad(loss, new, allow_unused=True)
        return float(loss.detach()), torch.zeros_like(new) if grad is None else grad.double()

    (with_kl, grad_kl), (without, grad_0) = loss_and_grad(beta), loss_and_grad(0.0)
    ref_new = logp_new.clone().requires_grad_(True)
    per_token = reference_kl(ref_new, logp_ref, o)
    if o.use_bias_correction_kl:
        per_token = per_token * ctx.reference_ratio(ref_new, logp_old, mask, "token")
    kl = ctx.aggregate(per_token, mask, 8)  # d loss / d beta
    (expected,) = torch.autograd.grad(beta * kl, ref_new)
    kl = float(kl.detach())
    k3 = k3_gradient_gap(ctx, logp_new, logp_ref)
    term = _relative(grad_kl - grad_0, expected)
    dbeta = abs((with_kl - without) / beta - kl) / max(abs(kl), 1e-12)
    worst = max(k3, term, dbeta)
    what = o.kl_estimator + (f", clamp {o.kl_clamp:g}" if o.kl_clamp is not None else "")
    what += ", x importance ratio" if o.use_bias_correction_kl else ""
    # float64 inputs: a float64 computation is ~1e-13 off; one in float32 inside ~1e-6; no
    # gradient, or another estimator's, is off by the size of the gradient itself.
    return ctx.result(
        f"max relative gap of the KL's gradient to float64 ({what}): kl_k3's {k3:.1e}, the "
        f"loss's KL term's {term:.1e}, d loss / d beta's {dbeta:.1e} (KL {kl:.3f})",
        worst,
        "<= 1e-4",
        worst <= 1e-4,
    )


CHECKS = (
    Check(
        "kl.nonnegative",
        5,
        "use k3 = exp(d) - d - 1 with d = logp_ref - logp_new, not the naive logp_new - logp_ref "
        "(which can be negative)",
        nonnegative,
        mutants=(Mutant("naive_kl"),),
    ),
    Check("kl.identical", 5, "k3 must be exactly 0 when the two policies are equal", identical),
    Check(
        "kl.tracks_exact",
        5,
        "d = logp_ref - logp_new (not logp_new - logp_ref): only that sign makes the k3 mean "
        "over samples of the new policy equal KL(new || ref)",
        tracks_exact,
        mutants=(Mutant("reversed_k3"),),
    ),
    Check(
        "kl.gradient",
        5,
        "the KL term must carry its gradient, not only its value: no torch.no_grad or "
        ".detach() around the estimator (detach logp_ref only, never logp_new or exp(d)), and "
        "each estimator differentiated as itself (k3: 1 - exp(d); k2: logp_new - logp_ref; k1: "
        "1), or the KL loss is a constant that holds nothing back (SkyRL #1340, NeMo-RL "
        "PR #2506)",
        gradient,
        mutants=(
            Mutant("kl_no_grad"),
            Mutant("kl_detached_exp"),
            Mutant("kl_loss_no_grad"),
            Mutant("kl_k2_as_k1", {"kl_estimator": "k2", "beta": 0.04}),
        ),
    ),
)
