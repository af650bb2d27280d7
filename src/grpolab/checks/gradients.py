"""The preflight's checks against a float64 copy of the model, on the configured run: the
trainer's memory-efficient log-probs against the seed's, the gradient accumulated over uneven
micro-batches and the gradient with the rows without gradient skipped, each against the
one-pass gradient of the copy (grpolab.checks.tolerance: no materially further from float64
than the plain path)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from grpolab import core
from grpolab.check import Check, Mutant
from grpolab.checks.context import PreflightBatch, PreflightSettings, few_group_rows
from grpolab.checks.reference import float64_logprobs
from grpolab.checks.tolerance import precision_tolerance, tolerance_text
from grpolab.core import CoreFunctions
from grpolab.model.precision import Precision, autocast

# Rows per float64 forward with grad: its activations and [rows, T, V] logits stay small.
REFERENCE_ROWS = 4


def float64_copy(model) -> torch.nn.Module:
    """The model in float64 for the references: 8 bytes a parameter, 16 with gradients."""
    return copy.deepcopy(model).double().eval()


def model64(ctx) -> torch.nn.Module:
    """The run's float64 copy, made once for the checks against it."""

    def make():
        ctx.say("log-probs and gradients against a float64 copy of the model")
        return float64_copy(ctx.model)

    return ctx.memo("float64 copy", make)


def in_precision(fn, precision: Precision):
    """fn(model, ...) with its forward in the run's precision (under bf16 the autocast the
    trainer's forwards run in): the checked and the plain path as training runs them, each
    against the float64 copy."""
    if not precision.bf16:
        return fn

    def run(model, *args, **kwargs):
        with autocast(precision, next(model.parameters()).device):
            return fn(model, *args, **kwargs)

    return run


def rounding_dtype(model, precision: Precision) -> torch.dtype:
    """The type whose last place the checks' floor counts in: bf16 under bf16 precision."""
    return torch.bfloat16 if precision.bf16 else next(model.parameters()).dtype


def _trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _grads(model) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for _, p in _trainable(model)]


def _max_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


@dataclass(frozen=True)
class Distance:
    """How far a gradient (and log-probs) are from a reference's."""

    grad: float  # max |grad - reference| over every parameter, / max |reference|
    worst: str  # the parameter where that is reached
    worst_abs: float  # its |grad - reference|
    logp: float = 0.0  # max |logp - reference| over completion tokens
    logp_scale: float = 0.0  # max |reference logp| over completion tokens


def grad_distance(model, reference: list[torch.Tensor | None]) -> Distance:
    """The model's current .grad against reference gradients (None: the parameter has none)."""
    scale = max((float(r.abs().max()) for r in reference if r is not None), default=0.0) or 1.0
    worst, worst_abs = "-", 0.0
    for (name, p), ref in zip(_trainable(model), reference, strict=True):
        if ref is not None:
            gap = _max_gap(torch.zeros_like(ref) if p.grad is None else p.grad, ref)
            if gap > worst_abs:
                worst, worst_abs = name, gap
    return Distance(worst_abs / scale, worst, worst_abs)


def reference_forward(model64, logprobs_fn, args) -> list:
    """logprobs_fn(model64, rows) for each slice of REFERENCE_ROWS rows, with their graphs:
    what reference_gradient backpropagates, once for every loss it is asked about."""
    B = args[0].shape[0]
    return [
        (rows, *logprobs_fn(model64, *(a[rows] for a in args[:3]), args[3]))
        for rows in (slice(r0, r0 + REFERENCE_ROWS) for r0 in range(0, B, REFERENCE_ROWS))
    ]


def reference_gradient(
    model64, logprobs_fn, args, loss_of, forward=None
) -> tuple[torch.Tensor, list]:
    """(logp [B, T-1], the parameters' gradients) of loss_of(logp, mask) for logp, mask =
    logprobs_fn(model64, *args) on the whole batch (args: input_ids, attention_mask,
    completion_mask, temperature), REFERENCE_ROWS rows per forward: d loss / d logp from the
    whole batch's log-probs, then each slice of rows backpropagated with its share of it
    (the chain rule: exact for any loss, whatever its normaliser). `forward`: the slices'
    forwards already run (reference_forward of the same model, function and args), kept for
    the next loss; None: run here and dropped."""
    forward = reference_forward(model64, logprobs_fn, args) if forward is None else forward
    logp = torch.cat([p[1].detach() for p in forward]).requires_grad_()
    loss_of(logp, torch.cat([p[2] for p in forward])).backward()
    upstream = logp.grad
    model64.zero_grad(set_to_none=True)
    for rows, part, _ in forward:
        (part * upstream[rows]).sum().backward(retain_graph=True)
    grads = _grads(model64)
    model64.zero_grad(set_to_none=True)
    return logp.detach(), grads


def reference_logprobs(impl: CoreFunctions):
    """The log-prob function the float64 copy runs for the gradient checks: the float64
    reference itself when the log-probs checked are grpolab's own (the same maths, so the
    copy's one forward serves logprobs.fused_vs_naive too), else the implementation's own (a
    user's path held to itself under accumulation, skipping and packing)."""
    own = impl.source.get("sequence_logprobs", "grpolab").startswith("grpolab")
    return float64_logprobs if own else impl.sequence_logprobs


def shared_reference_forward(ctx, logprobs_fn, args) -> list:
    """reference_forward on the run's float64 copy, run once for the checks whose losses
    differ but whose rows, function and temperature are the same (fused_vs_naive, split,
    skip, packing); dropped with the float64 copy."""
    key = "float64 forward"
    held = ctx.shared.get(key)
    same = (
        held is not None
        and held[0] is logprobs_fn
        and held[1][3] == args[3]
        and all(torch.equal(a, b) for a, b in zip(held[1][:3], args[:3], strict=True))
    )
    if not same:
        ctx.release(key)
        ctx.shared[key] = (logprobs_fn, args, reference_forward(model64(ctx), logprobs_fn, args))
    return ctx.shared[key][2]


def _masked_sum(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (logp * mask).sum()


def logprob_distances(
    model, model64, args, paths: dict, reference=float64_logprobs, forward=None
) -> dict[str, Distance]:
    """Each of `paths` (name -> a sequence_logprobs-like function) on `model`, against
    `reference` on `model64`: log-probs and the gradient of sum(logp * mask) reaching the
    parameters. args: (input_ids, attention_mask, completion_mask, temperature); `forward`:
    reference_forward of `reference` on `model64` already run (None: run here)."""
    valid = args[2][:, 1:].bool()
    ref_logp, ref_grads = reference_gradient(model64, reference, args, _masked_sum, forward)
    scale = _max_gap(ref_logp[valid], torch.zeros_like(ref_logp[valid]))
    out = {}
    for name, fn in paths.items():
        model.zero_grad(set_to_none=True)
        logp, mask = fn(model, *args)
        _masked_sum(logp, mask).backward()
        grad = grad_distance(model, ref_grads)
        model.zero_grad(set_to_none=True)
        gap = _max_gap(logp.detach()[valid], ref_logp[valid])
        out[name] = dataclasses.replace(grad, logp=gap, logp_scale=scale)
    return out


def batch_loss(impl: CoreFunctions, s: PreflightSettings, advantages: torch.Tensor, T: int):
    """loss_of(logp, mask, rows): the implementation's loss of `rows` (all by default) with
    their `advantages` [B], at a ratio of exp(-0.05) to a detached logp_old, no KL; T: the
    batch's width (the completion length the loss is told when none is configured)."""
    o = s.objective
    L = o.max_completion_length or T

    def loss_of(logp, mask, rows=slice(None)) -> torch.Tensor:
        kwargs = o.loss_kwargs() | {"beta": 0.0, "max_completion_length": L}
        loss, _ = impl.grpo_loss(
            logp, logp.detach() + 0.05, None, advantages[rows], mask,
            **core.accepted_kwargs(impl.grpo_loss, kwargs),
        )  # fmt: skip
        return loss

    return loss_of


@dataclass(frozen=True)
class OnePass:
    """The loss of every row of a batch on the float64 copy, and the run's one pass over it."""

    ref_logp: torch.Tensor  # [B, T-1] the float64 copy's log-probs
    reference: list  # the float64 copy's gradients (None: the parameter has none)
    grad: float  # the run's one-pass gradient: max |grad - reference| / max |reference|
    logp: float  # its log-probs: max |logp - ref_logp| over completion tokens


def batch_args(batch: PreflightBatch, s: PreflightSettings) -> tuple:
    """(input_ids, attention_mask, completion_mask, temperature): a log-prob call's."""
    return batch.input_ids, batch.attention_mask, batch.completion_mask, s.objective.temperature


def one_pass(ctx, batch: PreflightBatch, advantages: torch.Tensor) -> OnePass:
    """The float64 copy's gradient of the loss of every row of `batch` (`advantages` [B]) and
    the run's one pass over the same rows in its precision against it: what the accumulated
    micro-batches of split.gradient_invariance and packing.exact are held to (the same rows
    and loss: computed once)."""
    s, impl, model = ctx.settings, ctx.impl, ctx.model
    args = batch_args(batch, s)
    loss_of = batch_loss(impl, s, advantages, args[0].shape[1])

    def compute() -> OnePass:
        reference_fn = reference_logprobs(impl)
        forward = shared_reference_forward(ctx, reference_fn, args)
        ref_logp, reference = reference_gradient(model64(ctx), reference_fn, args, loss_of, forward)
        model.zero_grad(set_to_none=True)
        logp, mask = in_precision(impl.sequence_logprobs, s.precision)(model, *args)
        loss_of(logp, mask).backward()
        grad = grad_distance(model, reference).grad
        model.zero_grad(set_to_none=True)
        valid = args[2][:, 1:].bool()
        return OnePass(ref_logp, reference, grad, _max_gap(logp.detach()[valid], ref_logp[valid]))

    rows = hash(tuple(args[0].flatten().tolist()))  # the same token rows
    return ctx.memo(f"one pass {rows} {advantages.tolist()}", compute)


def accumulated_gradients(
    ctx, batch: PreflightBatch, advantages: torch.Tensor, parts, scale_fn
) -> tuple[float, float]:
    """(one pass, accumulated): the distances from the float64 copy's one-pass gradient of
    the loss of every row (`advantages` [B]) of the gradient of one pass over all rows, and of
    the gradient accumulated over `parts` (row indices), each part's loss scaled by
    scale_fn(loss_type, its mask, the whole batch's mask), relative to max |grad|."""
    s, impl, model = ctx.settings, ctx.impl, ctx.model
    args = batch_args(batch, s)
    loss_of = batch_loss(impl, s, advantages, args[0].shape[1])
    whole = one_pass(ctx, batch, advantages)
    logprobs = in_precision(impl.sequence_logprobs, s.precision)
    model.zero_grad(set_to_none=True)
    unit_mask = batch.completion_mask[:, 1:]
    for rows in parts:
        if len(rows):
            logp, mask = logprobs(model, *(a[rows] for a in args[:3]), args[3])
            scale = scale_fn(s.objective.loss_type, unit_mask[rows], unit_mask)
            (loss_of(logp, mask, rows) * scale).backward()
    accumulated = grad_distance(model, whole.reference).grad
    model.zero_grad(set_to_none=True)
    return whole.grad, accumulated


def alternating(B: int) -> torch.Tensor:
    """[B] advantages 1, -0.5, 1, ...: both signs, unequal sizes."""
    return torch.tensor([1.0, -0.5] * (B // 2) + [1.0] * (B % 2))


def split_invariance(ctx):
    """The gradient of the batch accumulated over micro-batches with the trainer's loss
    scaling equals the gradient in one pass (the wrong normaliser under accumulation shows
    here): both against the one-pass gradient of the same functions on a float64 copy."""
    s = ctx.settings
    batch = few_group_rows(ctx.batch, s)
    B = batch.input_ids.shape[0]
    # Uneven micro-batches: the longest sequences alone, then the rest in two parts.
    order = torch.argsort(batch.completion_mask[:, 1:].sum(1), descending=True)
    # (a partition of the rows: a micro-batch of one row leaves B = 1, one part)
    first, half = max(1, B // 4), max(1, B // 4, B // 2)
    parts = [order[:first], order[first:half], order[half:]]
    whole, split = accumulated_gradients(ctx, batch, alternating(B), parts, core.micro_batch_scale)
    tol = precision_tolerance(whole, 1.0, rounding_dtype(ctx.model, s.precision))
    return ctx.result(
        "max |grad(3 uneven micro-batches) - grad(one pass, float64 copy)| / max |grad|"
        + (" (bf16 autocast)" if s.precision.bf16 else ""),
        split,
        tolerance_text(tol, whole, "one pass"),
        split <= tol,
    )


def skip_invariance(ctx):
    """The update that skips the rows without gradient (core.rows_without_gradient: a third
    of the rows given advantage 0 here) equals the full update: the gradient accumulated over
    micro-batches of the other rows, each scaled by its share of the whole batch's normaliser
    as the trainer does, against the one-pass gradient of every row on a float64 copy."""
    s = ctx.settings
    batch = few_group_rows(ctx.batch, s)
    B = batch.input_ids.shape[0]
    advantages = alternating(B)
    advantages[:: 3 if B > 2 else 2] = 0.0
    kept = torch.nonzero(~core.rows_without_gradient(advantages)).view(-1)
    parts = [kept[: len(kept) // 2], kept[len(kept) // 2 :]]
    whole, skipped = accumulated_gradients(
        ctx, batch, advantages, parts, ctx.impl.micro_batch_scale
    )
    tol = precision_tolerance(whole, 1.0, rounding_dtype(ctx.model, s.precision))
    return ctx.result(
        f"max |grad(the {len(kept)} of {B} rows with an advantage, in 2 micro-batches) - "
        "grad(every row, one pass, float64 copy)| / max |grad|"
        + (" (bf16 autocast)" if s.precision.bf16 else ""),
        skipped,
        tolerance_text(tol, whole, "one pass"),
        skipped <= tol,
    )


def fused_vs_naive(ctx):
    """The trainer's memory-efficient log-probs and the seed's code, each against a float64
    copy of the model: values and the gradient reaching the model's parameters."""
    from grpolab.model.logprobs import shared_prefix_status, split_model, token_logprobs

    s, model = ctx.settings, ctx.model
    batch = few_group_rows(ctx.batch, s)
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask, s.objective.temperature)

    def trainers(model, *args):
        return token_logprobs(model, *args, shared_prefix=s.shared_prefix)

    paths = {"fused": trainers, "naive": core.sequence_logprobs}
    paths = {name: in_precision(fn, s.precision) for name, fn in paths.items()}
    forward = shared_reference_forward(ctx, float64_logprobs, args)
    fused, naive = logprob_distances(model, model64(ctx), args, paths, forward=forward).values()
    dtype = rounding_dtype(model, s.precision)
    tol = precision_tolerance(naive.logp, naive.logp_scale, dtype)
    grad_tol = precision_tolerance(naive.grad, 1.0, dtype)
    reason = split_model(model).reason
    path = "fused" if reason is None else f"naive fallback ({reason})"
    if reason is None and s.shared_prefix:
        why_not = shared_prefix_status(model, *args[:3])
        path += ", one forward per prompt" if why_not is None else f", one per row ({why_not})"
    path += ", bf16 autocast" if s.precision.bf16 else ""
    return ctx.result(
        f"{path}: max |logp - float64 copy's| (relative gradient gap {fused.grad:.1e}, "
        f"naive {naive.grad:.1e})",
        fused.logp,
        f"{tolerance_text(tol, naive.logp, 'naive')}; gradient <= {grad_tol:.2g}",
        fused.logp <= tol and fused.grad <= grad_tol,
    )


CHECKS = (
    Check(
        "logprobs.fused_vs_naive",
        0,
        "the chunked lm-head path is further from float64 than the seed's log-softmax on this "
        "model: set runtime.logprobs=naive and report the model",
        fused_vs_naive,
        when=lambda ctx: ctx.run.settings.fused_logprobs,
        stage="run",
    ),
    Check(
        "split.gradient_invariance",
        0,
        "the loss of each micro-batch must be scaled by its share of the whole batch's "
        "normaliser (tokens for token-mean, sequences for sequence-mean)",
        split_invariance,
        stage="run",
    ),
    Check(
        "update.skip_invariance",
        0,
        "a row whose advantage is 0 must add exactly 0 to the loss (every term A x a function of "
        "the ratio) and the skipped rows must stay in the normaliser; a loss with a term that "
        "reads every row needs runtime.skip_zero_advantage=false",
        skip_invariance,
        when=lambda ctx: ctx.run.settings.skip_zero_advantage,
        stage="run",
        mutants=(Mutant("loss_reads_every_row"),),
    ),
)
