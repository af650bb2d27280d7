"""packing.exact: the trainer's token-budget micro-batches, packed without padding
(batch.max_tokens_per_microbatch), give the padded path's log-probs and gradient. Both are
measured against the padded path's one pass on a float64 copy of the model, the packed path
as the trainer runs it: the rows cut by the token budget, each micro-batch packed (a group's
prompt once), its loss scaled by its share of the whole batch's normaliser, the gradients
accumulated (grpolab.checks.tolerance: no materially further from float64 than the padded
one pass)."""

from __future__ import annotations

import math

import torch

from grpolab import core
from grpolab.check import Check, Mutant
from grpolab.checks.context import signed_advantages
from grpolab.checks.gradients import (
    float64_rows,
    in_precision,
    model64,
    reference_gradient,
    rounding_dtype,
    shared_reference_forward,
)
from grpolab.checks.tolerance import precision_tolerance, tolerance_text
from grpolab.model.packed import packed_sizes, token_budget_parts

# The check's micro-batches: at most the configured budget, and small enough that the
# check's rows make at least this many (a cut between groups and one inside a group).
MIN_PARTS = 3


def check_budget(batch, configured: int) -> int:
    """The token budget the check cuts its rows with: the configured one, or less so that
    its few rows still make MIN_PARTS micro-batches."""
    prompt, completion, first = packed_sizes(
        batch.input_ids, batch.attention_mask, batch.completion_mask
    )
    total = int((completion + prompt * first).sum())
    return max(2, min(configured, math.ceil(total / MIN_PARTS)))


def _distance(model, reference: list[torch.Tensor]) -> float:
    """max |grad - reference| over the trained parameters, / max |reference|."""
    trained = [p for p in model.parameters() if p.requires_grad]
    scale = max((float(r.abs().max()) for r in reference if r is not None), default=0.0) or 1.0
    worst = 0.0
    for p, ref in zip(trained, reference, strict=True):
        if ref is not None:
            grad = torch.zeros_like(ref) if p.grad is None else p.grad
            worst = max(worst, float((grad.double() - ref.double()).abs().max()))
    return worst / scale


def packing_exact(ctx):
    s, impl, model = ctx.settings, ctx.impl, ctx.model
    batch = float64_rows(ctx.batch, s)
    o = s.objective
    B = batch.input_ids.shape[0]
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask, o.temperature)
    advantages = signed_advantages(B)
    L = o.max_completion_length or batch.input_ids.shape[1]

    def loss_of(logp, mask, rows=slice(None)) -> torch.Tensor:
        kwargs = o.loss_kwargs() | {"beta": 0.0, "max_completion_length": L}
        loss, _ = impl.grpo_loss(
            logp, logp.detach() + 0.05, None, advantages[rows], mask,
            **core.accepted_kwargs(impl.grpo_loss, kwargs),
        )  # fmt: skip
        return loss

    def packed(model, *args):
        return impl.sequence_logprobs(model, *args, packed=True)

    padded_fn, packed_fn = (in_precision(f, s.precision) for f in (impl.sequence_logprobs, packed))
    forward = shared_reference_forward(ctx, impl.sequence_logprobs, args)
    ref_logp, reference = reference_gradient(
        model64(ctx), impl.sequence_logprobs, args, loss_of, forward
    )
    valid = batch.completion_mask[:, 1:].bool()
    # The padded one pass: the plain path's distance, what the tolerance is made of.
    model.zero_grad(set_to_none=True)
    logp, mask = padded_fn(model, *args)
    loss_of(logp, mask).backward()
    padded_grad = _distance(model, reference)
    padded_logp = float((logp.detach() - ref_logp)[valid].abs().max())
    # The packed micro-batches, accumulated as the trainer does.
    model.zero_grad(set_to_none=True)
    budget = check_budget(batch, ctx.run.cfg.batch.max_tokens_per_microbatch)
    unit_mask = batch.completion_mask[:, 1:]
    packed_logp = 0.0
    parts = token_budget_parts(*args[:3], budget)
    for part in parts:
        rows = torch.tensor(part)
        logp, mask = packed_fn(model, *(a[rows] for a in args[:3]), o.temperature)
        gap = (logp.detach() - ref_logp[rows])[valid[rows]]
        packed_logp = max(packed_logp, float(gap.abs().max()) if gap.numel() else 0.0)
        scale = impl.micro_batch_scale(o.loss_type, unit_mask[rows], unit_mask)
        (loss_of(logp, mask, rows) * scale).backward()
    packed_grad = _distance(model, reference)
    model.zero_grad(set_to_none=True)
    dtype = rounding_dtype(model, s.precision)
    logp_tol = precision_tolerance(padded_logp, float(ref_logp[valid].abs().max()), dtype)
    grad_tol = precision_tolerance(padded_grad, 1.0, dtype)
    return ctx.result(
        f"max |logp - float64 copy's| over {len(parts)} packed micro-batches of <= {budget} "
        f"tokens (relative gradient gap {packed_grad:.1e}, padded one pass {padded_grad:.1e})"
        + (" (bf16 autocast)" if s.precision.bf16 else ""),
        packed_logp,
        f"{tolerance_text(logp_tol, padded_logp, 'padded')}; gradient <= {grad_tol:.2g}",
        packed_logp <= logp_tol and packed_grad <= grad_tol,
    )


CHECKS = (
    Check(
        "packing.exact",
        0,
        "rows packed into one sequence must each see only their own prompt and completion, at "
        "their own positions (a block-diagonal mask, positions restarting per row), and each "
        "micro-batch's loss must be scaled by its share of the whole batch's normaliser",
        packing_exact,
        when=lambda ctx: (
            ctx.run.cfg.batch.max_tokens_per_microbatch is not None
            and ctx.takes("sequence_logprobs", "packed")
        ),
        stage="run",
        mutants=(Mutant("packed_across_rows"),),
    ),
)
