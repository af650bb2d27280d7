"""Goal 5, the KL: k3 = exp(d) - d - 1 with d = logp_ref - logp_new, never negative, exactly 0
for equal policies, and with the mean over samples of the new policy equal to the exact KL.
On real next-token distributions of the user's model and a perturbed copy (the reference).
The declared KL conventions' checks live in grpolab.objective.kl."""

from __future__ import annotations

import torch

from grpolab import core
from grpolab.check import Check, Mutant
from grpolab.objective.base import max_abs


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
)
