"""Goal 3, the ratio: logp_old from an extra forward of the same model in the same mode,
exactly 1 before the first update; and the engine's log-probs against the trainer's."""

from __future__ import annotations

import torch

from grpolab import core
from grpolab.check import Check
from grpolab.checks.context import few_group_rows, signed_advantages
from grpolab.checks.tolerance import precision_tolerance, tolerance_text
from grpolab.model.policy import eval_mode
from grpolab.objective.base import max_abs


def old_logprobs(ctx):
    """(rows, the log-prob arguments, logp_old [B, T-1]): an extra forward in train mode, as
    the trainer runs it (dropout left on would show here), no gradient; once per run."""

    def compute():
        batch = few_group_rows(ctx.batch, ctx.settings)
        args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
        args += (ctx.objective.temperature,)
        ctx.model.train()
        try:
            with torch.no_grad():
                logp_old, _ = ctx.impl.sequence_logprobs(ctx.model, *args)
        finally:
            ctx.model.eval()
        return batch, args, logp_old

    return ctx.memo("ratio.old", compute)


def initial(ctx):
    batch, args, logp_old = old_logprobs(ctx)
    ctx.model.train()
    try:
        logp_new, mask = ctx.impl.sequence_logprobs(ctx.model, *args)  # the first inner step
    finally:
        ctx.model.eval()
    valid = batch.completion_mask[:, 1:].bool()
    dev = max_abs(torch.exp(logp_new.detach() - logp_old)[valid] - 1)
    advantages = signed_advantages(batch.input_ids.shape[0])
    _, metrics = ctx.loss(logp_new, logp_old, None, advantages, mask)
    dev = max(dev, abs(float(metrics["ratio_mean"]) - 1))
    return ctx.result(
        "max |ratio - 1| on the first inner step (and |ratio_mean - 1|)",
        dev,
        "<= 1e-3",
        dev <= 1e-3,
    )


def engine_agreement(ctx):
    batch, args, logp_old = old_logprobs(ctx)
    s = ctx.settings
    valid = batch.completion_mask[:, 1:].bool()
    gaps = (batch.engine_logprobs.double() - logp_old.double())[valid].abs()
    worst = gaps.max().item() if gaps.numel() else 0.0
    tol, bound = s.engine_gap_max, f"<= {s.engine_gap_max:g}"
    if s.precision.bf16:
        plain = plain_bf16_gap(ctx.model, args, logp_old, valid)
        tol = precision_tolerance(plain, max_abs(logp_old[valid]), torch.bfloat16)
        bound = tolerance_text(tol, plain, "a plain bf16 autocast forward")
    return ctx.result(
        f"engine vs trainer float32 logp: max gap (mean {gaps.mean().item():.2e})",
        worst,
        bound,
        worst <= tol,
    )


@torch.no_grad()
def plain_bf16_gap(model, args: tuple, logp: torch.Tensor, valid: torch.Tensor) -> float:
    """Max |log-prob| distance of the seed's log-probs under plain bf16 autocast from the
    float32 `logp` [B, T-1]: how far a bf16 engine may be from the trainer's float32."""
    with eval_mode(model), torch.autocast(args[0].device.type, dtype=torch.bfloat16):
        plain, _ = core.sequence_logprobs(model, *args)
    return max_abs((plain.double() - logp.double())[valid])


CHECKS = (
    Check(
        "ratio.initial",
        3,
        "logp_old must come from the same model, same inputs and same mode (dropout off or "
        "identical) right before the first update; ratio = exp(new - old)",
        initial,
    ),
    Check(
        "engine.agreement",
        0,
        "the engine and the trainer must compute log-probs the same way: same temperature, same "
        "weights (sync after each update), same dtype",
        engine_agreement,
        when=lambda ctx: ctx.batch.engine_logprobs is not None,
    ),
)
