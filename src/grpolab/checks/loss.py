"""Goal 7, the assembled loss: finite, honest metrics (means over completion tokens only), and
one SGD step on it raising the completions with a positive advantage relative to the others;
and NaN in masked slots reaching neither the loss nor its gradient."""

from __future__ import annotations

import copy
import math

import torch

from grpolab import core
from grpolab.check import Check, Mutant
from grpolab.checks.context import FEW_ROWS, PreflightBatch
from grpolab.objective.base import max_abs
from grpolab.objective.kl import reference as reference_kl


def perturbed(ctx):
    """The clip case with a reference policy: the loss and metrics of the implementation
    with KL on, and the generator that drew the reference, once per run."""

    def compute():
        g = torch.Generator().manual_seed(ctx.settings.seed + 1)
        logp_new, logp_old, adv, mask = ctx.clip_case()
        # Padding at ratio e, far from any mean of the real ratios: the clip case's two padded
        # ratios, 1 +- the mean epsilon, average to 1, as the real ones nearly do, so a mean
        # over every slot could land within the tolerance of the masked one.
        logp_new = torch.where(mask.bool(), logp_new, logp_old + 1.0)
        logp_ref = logp_old + 0.3 * torch.randn(logp_old.shape, generator=g)
        beta = ctx.objective.beta if ctx.objective.beta > 0 else 0.04
        loss, metrics = ctx.loss(logp_new, logp_old, logp_ref, adv, mask, beta=beta, L=8)
        return (logp_new, logp_old, logp_ref, adv, mask), beta, loss, metrics, g

    return ctx.memo("loss.perturbed", compute)


def finite(ctx):
    _, _, loss, _, _ = perturbed(ctx)
    loss = torch.as_tensor(loss)
    ok = bool(torch.isfinite(loss).all()) and loss.numel() == 1
    return ctx.result("loss on a perturbed policy with KL", float(loss), "finite scalar", ok)


def metrics(ctx):
    """The metrics against a direct masked computation of each."""
    (logp_new, logp_old, logp_ref, adv, mask), beta, loss, metrics, g = perturbed(ctx)
    valid = mask.bool()
    ratio = torch.exp(logp_new.double() - logp_old.double())
    _, clipped = ctx.reference_policy(logp_new, logp_old, adv, mask)
    kl = reference_kl(logp_new, logp_ref, ctx.objective)
    direct = {
        "loss": float(loss),
        "clip_frac": clipped.double().sum().item() / valid.sum().item(),
        "kl": kl[valid].mean().item(),
        "ratio_mean": ratio[valid].mean().item(),
    }
    if "entropy" in metrics or ctx.takes("grpo_loss", "entropy"):
        # The policy's entropy, handed to the loss: its metric is the masked mean.
        entropy = torch.rand(mask.shape, generator=g) * 2
        _, with_entropy = ctx.loss(
            logp_new, logp_old, logp_ref, adv, mask, beta, 8, entropy=entropy
        )
        metrics = metrics | {"entropy": with_entropy.get("entropy", float("nan"))}
        direct["entropy"] = entropy.double()[valid].mean().item()
    gaps = {k: abs(float(metrics.get(k, float("nan"))) - v) for k, v in direct.items()}
    worst_key = max(gaps, key=lambda k: gaps[k] if math.isfinite(gaps[k]) else math.inf)
    worst = gaps[worst_key]
    return ctx.result(
        f"max |metric - direct masked computation| (worst: {worst_key})",
        worst,
        "<= 1e-4",
        math.isfinite(worst) and worst <= 1e-4,
    )


def distinct_rows(batch: PreflightBatch, n: int) -> PreflightBatch:
    """Up to n rows holding distinct sequences, in batch order: a confident model samples one
    completion G times, and +1 and -1 on two copies of it cancel in the gradient exactly,
    leaving nothing for an SGD step to show. A batch of one sequence gets a second: a copy
    of it whose last completion token is another token."""
    pairs = zip(batch.input_ids, batch.attention_mask, strict=True)
    keys = [tuple((row * m).tolist()) for row, m in pairs]
    rows = [keys.index(k) for k in list(dict.fromkeys(keys))[:n]]
    picked = batch.rows(torch.tensor(rows))
    if len(rows) > 1 or not picked.completion_mask.any():
        return picked
    twice = picked.rows(torch.tensor([0, 0]))
    last = int(picked.completion_mask[0].nonzero().max())
    token = int(twice.input_ids[1, last])
    twice.input_ids[1, last] = token - 1 if token > 0 else 1
    return twice


def sgd_direction(ctx):
    """One small SGD step with the implementation's loss over a few rows of distinct sequences
    (advantages +1, -1, +1, ...), taken on float32 weights: a copy of a low-precision model
    (its rounding would swallow the step), else the model's own weights swapped for stepped
    ones during its forwards (no copy; the originals are put back). Every forward runs in
    micro-batches of the trainer's size (where training fits), the gradient accumulated."""
    batch, model = distinct_rows(ctx.batch, FEW_ROWS), ctx.model
    B = batch.input_ids.shape[0]
    if B < 2:
        return ctx.result("the batch holds no completion token", 0, "-", True)
    fp32 = all(p.dtype == torch.float32 for p in model.parameters())
    policy = model if fp32 else copy.deepcopy(model).float()
    policy.eval()
    micro = ctx.settings.grad_rows or B
    parts = [slice(r, r + micro) for r in range(0, B, micro)]
    T = ctx.objective.temperature

    def args(part):
        return batch.input_ids[part], batch.attention_mask[part], batch.completion_mask[part], T

    def logprobs() -> tuple[torch.Tensor, torch.Tensor]:  # [B, T-1] each, with no gradient
        with torch.no_grad():
            pieces = [core.sequence_logprobs(policy, *args(part)) for part in parts]
        return torch.cat([lp for lp, _ in pieces]), torch.cat([m for _, m in pieces])

    advantages = torch.tensor([1.0 if r % 2 == 0 else -1.0 for r in range(B)])
    before, mask = logprobs()
    policy.zero_grad(set_to_none=True)
    for part in parts:
        logp_new, impl_mask = ctx.impl.sequence_logprobs(policy, *args(part))
        loss, _ = ctx.loss(logp_new, before[part], None, advantages[part], impl_mask)
        ctx.backward(loss)
        del logp_new, impl_mask, loss
    after, _ = _stepped(policy, logprobs)
    change = ((after - before) * mask).sum(1) / mask.sum(1).clamp(min=1)  # [B]
    up = change[advantages > 0].mean().item()
    down = change[advantages < 0].mean().item()
    # To first order the gap up - down grows by c * |grad(A>0) - grad(A<0)|^2 >= 0 whatever
    # the overlap of the two gradients, so the gap is the robust measure.
    return ctx.result(
        f"mean logp change after one SGD step: A>0 {up:+.2e}, A<0 {down:+.2e}",
        up - down,
        "> 0 (A>0 rises relative to A<0)",
        up - down > 0,
    )


@torch.no_grad()
def _stepped(policy, forward):
    """`forward()` after a step of length 1e-3 along -grad, the weights put back after."""
    trained = [p for p in policy.parameters() if p.grad is not None]
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in trained)).item() if trained else 0
    originals = [p.data for p in trained]
    for p in trained:
        p.data = p.data - 1e-3 / max(norm, 1e-12) * p.grad
        p.grad = None
    try:
        return forward()
    finally:
        for p, original in zip(trained, originals, strict=True):
            p.data = original


def _loss_and_grad(ctx, logp_new, logp_old, logp_ref, adv, mask):
    """(loss, d loss / d logp_new) of the implementation with KL on, float64 inputs."""
    new = logp_new.detach().clone().requires_grad_(True)
    loss, _ = ctx.loss(new, logp_old, logp_ref, adv, mask, beta=0.04, L=8)
    loss = torch.as_tensor(loss)
    (grad,) = torch.autograd.grad(loss, new, allow_unused=True)
    return loss.detach().double(), torch.zeros_like(new) if grad is None else grad.double()


def masked_nan(ctx):
    """NaN planted in the masked slots of logp_old, logp_ref and logp_new (padding a gather
    or an engine can fill with anything) leaves the loss and its gradient what they are
    without it (OpenRLHF PR #1240: NaN * 0 = NaN)."""
    logp_new, logp_old, adv, mask = ctx.clip_case()
    mask = mask.clone()
    mask[0, 5:], mask[3, 2:4] = 0, 0  # padding at the end, and a hole (a tool's tokens)
    g = torch.Generator().manual_seed(ctx.settings.seed + 2)
    logp_ref = logp_old + 0.3 * torch.randn(logp_old.shape, generator=g, dtype=torch.float64)
    clean = _loss_and_grad(ctx, logp_new, logp_old, logp_ref, adv, mask)
    hole = ~mask.bool()
    poisoned = [torch.where(hole, torch.nan, t) for t in (logp_new, logp_old, logp_ref)]
    loss, grad = _loss_and_grad(ctx, *poisoned, adv, mask)
    gap = max(max_abs(loss - clean[0]), max_abs(grad - clean[1]))
    if not (torch.isfinite(loss).all() and torch.isfinite(grad).all()):
        gap = math.inf
    # Both sides compute the same float64 values; only the order of masked zeros may differ.
    tol = 1e-12 * (1 + max_abs(clean[0]) + max_abs(clean[1]))
    return ctx.result(
        f"max |loss, grad with NaN in {int(hole.sum())} masked slots - without| (KL on)",
        gap,
        f"<= {tol:.1e}",
        gap <= tol,
    )


CHECKS = (
    Check("loss.finite", 7, "the loss must be a finite scalar on a real batch", finite),
    Check(
        "loss.metrics",
        7,
        "metrics are means over completion tokens only (mask them), and loss is the value returned",
        metrics,
        mutants=(Mutant("unmasked_ratio_mean"), Mutant("entropy_unmasked_metric")),
    ),
    Check(
        "loss.sgd_direction",
        7,
        "minimising the loss must raise the log-probs of positive-advantage completions: check "
        "the sign of per_token",
        sgd_direction,
        mutants=(Mutant("sign_flipped"),),
        blame_before="norm.aggregation",
    ),
    Check(
        "loss.masked_nan",
        0,
        "a NaN in a masked slot (padding of logp_old, logp_ref or logp_new) reaches the loss or "
        "its gradient: NaN * 0 is NaN, so select with torch.where(mask, x, 0) before any "
        "arithmetic instead of multiplying by the mask (OpenRLHF PR #1240)",
        masked_nan,
        when=lambda ctx: ctx.settings.masked_nan,
        mutants=(Mutant("nan_times_mask"),),
        blame_before="loss.metrics",
        declared_only=True,
    ),
)
