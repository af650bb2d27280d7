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

from grpolab.check import Check, Mutant
from grpolab.checks.context import few_group_rows
from grpolab.checks.gradients import (
    alternating,
    batch_args,
    batch_loss,
    grad_distance,
    in_precision,
    one_pass,
    rounding_dtype,
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


def packing_exact(ctx):
    s, impl, model = ctx.settings, ctx.impl, ctx.model
    batch = few_group_rows(ctx.batch, s)
    B = batch.input_ids.shape[0]
    args = batch_args(batch, s)
    advantages = alternating(B)  # split.gradient_invariance's: their one pass is shared
    loss_of = batch_loss(impl, s, advantages, args[0].shape[1])
    padded = one_pass(ctx, batch, advantages)  # the plain path's distance: the tolerance's

    def packed(model, *args):
        return impl.sequence_logprobs(model, *args, packed=True)

    packed_fn = in_precision(packed, s.precision)
    valid = batch.completion_mask[:, 1:].bool()
    # The packed micro-batches, accumulated as the trainer does.
    model.zero_grad(set_to_none=True)
    budget = check_budget(batch, ctx.run.settings.max_tokens_per_microbatch)
    unit_mask = batch.completion_mask[:, 1:]
    packed_logp = 0.0
    parts = token_budget_parts(*args[:3], budget)
    for part in parts:
        rows = torch.tensor(part)
        logp, mask = packed_fn(model, *(a[rows] for a in args[:3]), args[3])
        gap = (logp.detach() - padded.ref_logp[rows])[valid[rows]]
        packed_logp = max(packed_logp, float(gap.abs().max()) if gap.numel() else 0.0)
        scale = impl.micro_batch_scale(s.objective.loss_type, unit_mask[rows], unit_mask)
        (loss_of(logp, mask, rows) * scale).backward()
    packed_grad = grad_distance(model, padded.reference).grad
    model.zero_grad(set_to_none=True)
    dtype = rounding_dtype(model, s.precision)
    scale = float(padded.ref_logp[valid].abs().max()) if valid.any() else 0.0
    logp_tol = precision_tolerance(padded.logp, scale, dtype)
    grad_tol = precision_tolerance(padded.grad, 1.0, dtype)
    return ctx.result(
        f"max |logp - float64 copy's| over {len(parts)} packed micro-batches of <= {budget} "
        f"tokens (relative gradient gap {packed_grad:.1e}, padded one pass {padded.grad:.1e})"
        + (" (bf16 autocast)" if s.precision.bf16 else ""),
        packed_logp,
        f"{tolerance_text(logp_tol, padded.logp, 'padded')}; gradient <= {grad_tol:.2g}",
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
            ctx.run.settings.max_tokens_per_microbatch is not None
            and ctx.takes("sequence_logprobs", "packed")
        ),
        stage="run",
        mutants=(Mutant("packed_across_rows"),),
    ),
)
