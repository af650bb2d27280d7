"""Goal 1, the log-probs: shifted by one, float32 before log-softmax, temperature applied.
Each is measured against float64 and against the seed's float32 log-softmax of the same
logits (grpolab.checks.tolerance); the values compared are float32 log-probs."""

from __future__ import annotations

import copy

import torch

from grpolab.check import Check, Mutant
from grpolab.checks import reference
from grpolab.checks.tolerance import precision_tolerance, tolerance_text
from grpolab.objective.base import max_abs


def row_by_row(ctx, model, batch, temperature: float) -> torch.Tensor:
    """The implementation's log-probs [B, T-1], one row per call. A batch lets it share a
    group's prompt forward, which rounds differently from the model's own forward (in bf16
    by whole units of the last place of the logits); alone, a row's logits are the model's,
    and what the log-prob checks compare is the log-softmax and its alignment alone."""
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    with torch.no_grad():
        rows = [
            ctx.impl.sequence_logprobs(model, *(a[i : i + 1] for a in args), temperature)[0]
            for i in range(batch.input_ids.shape[0])
        ]
    return torch.cat(rows)


def at_temperature_one(ctx):
    """(rows, completion tokens [B, T-1], float64 reference, plain float32, the
    implementation's log-probs) on the unpadded rows at T = 1, once per run."""

    def compute():
        batch = ctx.unpadded_rows()
        ref, plain = reference.logprobs_and_plain(ctx.model, batch, 1.0)
        logp = row_by_row(ctx, ctx.model, batch, 1.0)
        return batch, batch.completion_mask[:, 1:].bool(), ref, plain, logp

    return ctx.memo("logprobs.t1", compute)


def shift(ctx):
    batch, comp, ref, plain, logp = at_temperature_one(ctx)
    # The model's own labels loss (it shifts internally), one row at a time: the mean
    # completion log-prob of a row is minus that loss. The loss is a float32 computation
    # too, with its own distance from float64: a correct implementation may be as far from
    # it as that distance plus its own allowance.
    gaps, plain_gaps, loss_gaps = [], [], []
    with torch.no_grad():
        for i in range(batch.input_ids.shape[0]):
            keep = batch.attention_mask[i].bool()
            labels = batch.input_ids[i][keep].masked_fill(batch.completion_mask[i][keep] == 0, -100)
            row = batch.input_ids[i][keep][None]
            ce = ctx.model(input_ids=row, labels=labels[None]).loss.item()
            exact = ref[i][comp[i]].mean().item()
            gaps.append(abs(logp[i][comp[i]].double().mean().item() + ce))
            plain_gaps.append(abs(plain[i][comp[i]].double().mean().item() - exact))
            loss_gaps.append(abs(ce + exact))
    shift_gap, plain_gap, loss_gap = max(gaps), max(plain_gaps), max(loss_gaps)
    tol = precision_tolerance(plain_gap, max_abs(ref[comp]), torch.float32) + loss_gap
    return ctx.result(
        "max |mean completion logp + model's labels CE| per row",
        shift_gap,
        tolerance_text(tol, plain_gap, "float32 log-softmax", f" + the loss's {loss_gap:.1e}"),
        shift_gap <= tol,
    )


def float32(ctx):
    batch = ctx.unpadded_rows()
    comp = batch.completion_mask[:, 1:].bool()
    bf16 = copy.deepcopy(ctx.model).to(torch.bfloat16)
    logp_bf16 = row_by_row(ctx, bf16, batch, 1.0)
    ref, _ = reference.logprobs_and_plain(bf16, batch, 1.0)
    del bf16
    gap = max_abs((logp_bf16.double() - ref)[comp])
    # Not the gap: another forward of a bf16 model (a batch instead of one row, another CPU's
    # kernels) rounds its logits differently, by up to ~1e-3, hiding the bug's ~1e-2. What
    # shows the bug on any path: a bf16 log-softmax returns values on bf16's grid (8
    # significant bits), where float32 arithmetic lands only by chance (a few percent of the
    # values with |logp| > 1e-2).
    values = logp_bf16[comp & (logp_bf16.abs() > 1e-2)].float()
    on_grid = (values == values.bfloat16().float()).double().mean().item() if len(values) else 0.0
    return ctx.result(
        f"bf16 model: dtype {str(logp_bf16.dtype).removeprefix('torch.')}, share of log-probs "
        f"on the bf16 grid (max gap to float64 {gap:.1e})",
        on_grid,
        "float32, < 0.5",
        logp_bf16.dtype == torch.float32 and on_grid < 0.5,
    )


def temperature(ctx):
    batch, comp, ref1, _, logp1 = at_temperature_one(ctx)
    # Its own distance from float64 at T = 1: what its logits path (the fused lm-head's
    # chunks round differently from the model's head) costs before any temperature.
    own_gap = max_abs((logp1.double() - ref1)[comp])
    T = ctx.objective.temperature if ctx.objective.temperature != 1.0 else 0.7
    logp_t = row_by_row(ctx, ctx.model, batch, T)
    ref, plain = reference.logprobs_and_plain(ctx.model, batch, T)
    gap = max_abs((logp_t.double() - ref)[comp])
    plain_gap = max_abs((plain.double() - ref)[comp])
    # The logits' rounding is divided by T with them: at T its share of the gap is the gap at
    # T = 1 over T. A missing or misapplied temperature is wrong in the first digit.
    baseline = max(plain_gap, own_gap / T)
    tol = precision_tolerance(baseline, max_abs(ref[comp]), torch.float32)
    return ctx.result(
        f"max gap to softmax(logits / {T:g}) in float64 (at T = 1: {own_gap:.1e})",
        gap,
        tolerance_text(tol, baseline, "max(float32 log-softmax, its own gap at T = 1 / T)"),
        gap <= tol,
    )


CHECKS = (
    Check(
        "logprobs.shift",
        1,
        "logits at position t predict token t+1: use logits[:, :-1] with input_ids[:, 1:] and "
        "completion_mask[:, 1:]",
        shift,
        mutants=(Mutant("no_shift"),),
    ),
    Check(
        "logprobs.float32",
        1,
        "cast the logits to float32 before log_softmax (logits.float()); bf16 log-softmax loses "
        "~1e-2 per token",
        float32,
        mutants=(Mutant("bf16_log_softmax"),),
    ),
    Check(
        "logprobs.temperature",
        1,
        "divide the logits by the sampling temperature before log_softmax: the policy that "
        "sampled is softmax(logits / T)",
        temperature,
        mutants=(Mutant("no_temperature"),),
    ),
)
