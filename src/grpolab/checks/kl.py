"""Goal 5, the KL: k3 = exp(d) - d - 1 with d = logp_ref - logp_new, never negative, exactly 0
for equal policies, and with the mean over samples of the new policy equal to the exact KL.
On real next-token distributions of the user's model and a perturbed copy (the reference).
And its gradient, not only its value: kl_k3's and the assembled loss's KL term's, against
float64. The declared KL conventions' checks live in grpolab.objective.kl."""

from __future__ import annotations

import math

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


# A token's log-prob is moved this far to read the loss's weight of its KL (off any clamp's
# kink no step matters: the declared estimator's float64 value is read at both points).
WEIGHT_STEP = 0.3


def token_weights(ctx, logp_new, logp_old, logp_ref, mask, beta, phi) -> torch.Tensor:
    """How much the loss weighs each token's declared KL term phi [B, T] (float64): the
    loss's change when that token alone moves by WEIGHT_STEP, over phi's change there (the
    aggregations are linear in the per-token terms, each term a function of its own token);
    NaN where phi barely changes (a clamp holds it) or out of the mask."""
    zeros, base = torch.zeros(logp_new.shape[0], dtype=torch.float64), phi(logp_new)

    def loss_at(x) -> float:
        loss, _ = ctx.loss(x, logp_old, logp_ref, zeros, mask, beta=beta, L=8)
        return float(torch.as_tensor(loss).detach())

    f0, scale = loss_at(logp_new), max_abs(base[mask.bool()])
    w = torch.full_like(base, math.nan)
    for b, t in mask.nonzero().tolist():
        moves = []
        for step in (WEIGHT_STEP, -WEIGHT_STEP):
            x = logp_new.clone()
            x[b, t] += step
            moves.append((float(phi(x)[b, t] - base[b, t]), x))
        d_phi, x = max(moves, key=lambda m: abs(m[0]))
        if abs(d_phi) > 1e-3 * scale:
            w[b, t] = (loss_at(x) - f0) / d_phi
    return w


def gradient(ctx):
    """The KL term's gradient is the derivative of its value (SkyRL #1340: the estimator
    under torch.no_grad, so the KL loss was a constant; NeMo-RL PR #2506: k2's gradient equal
    to k1's). On a probe with pi != pi_ref, float64 inputs: kl_k3's gradient against float64
    1 - exp(d); at A = 0 (the policy term is 0) the loss's gradient at each token against the
    float64 derivative of the declared estimator (clamp; bias correction: x the token's
    ratio) times the weight the loss gives that token's KL value, read off the loss itself
    (so the aggregation and the sign are the loss's, which norm.aggregation and
    loss.sgd_direction check); and d loss / d beta, the loss at A = 0 over beta, not 0."""
    o = ctx.objective
    logp_new, logp_old, logp_ref, _, mask = gradient_case(ctx)
    beta = o.beta if o.beta > 0 else 0.04

    def phi(new):  # the declared per-token KL term, float64 [B, T]
        value = reference_kl(new, logp_ref, o)
        if o.use_bias_correction_kl:
            value = value * ctx.reference_ratio(new, logp_old, mask, "token")
        return value

    new = logp_new.clone().requires_grad_(True)
    zeros = torch.zeros(logp_new.shape[0], dtype=torch.float64)
    loss, _ = ctx.loss(new, logp_old, logp_ref, zeros, mask, beta=beta, L=8)
    loss = torch.as_tensor(loss)
    grad = torch.zeros_like(new)
    if loss.requires_grad:
        (found,) = torch.autograd.grad(loss, new, allow_unused=True)
        grad = grad if found is None else found.double()
    ref_new = logp_new.clone().requires_grad_(True)
    (derivative,) = torch.autograd.grad(phi(ref_new).sum(), ref_new)  # per token: separable
    w = token_weights(ctx, logp_new, logp_old, logp_ref, mask, beta, phi)
    read = ~torch.isnan(w)
    expected = torch.where(read, w * derivative, 0.0)
    term = max_abs((grad - expected)[read]) / max(max_abs(expected[read]), 1e-12)
    k3 = k3_gradient_gap(ctx, logp_new, logp_ref)
    dbeta = float(loss.detach()) / beta
    worst = max(k3, term) if dbeta != 0 else math.inf
    what = o.kl_estimator + (f", clamp {o.kl_clamp:g}" if o.kl_clamp is not None else "")
    what += ", x importance ratio" if o.use_bias_correction_kl else ""
    # float64 inputs: a float64 computation is ~1e-13 off; one in float32 inside ~1e-6; no
    # gradient, or another estimator's, is off by the size of the gradient itself.
    return ctx.result(
        f"max relative gap of the KL's gradient to float64 ({what}): kl_k3's {k3:.1e}, the "
        f"loss's KL term's {term:.1e} ({int(read.sum())} tokens); d loss / d beta {dbeta:.3g}",
        worst,
        "<= 1e-4, d loss / d beta != 0",
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
