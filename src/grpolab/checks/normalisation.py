"""Goal 6, the normalisation: the declared aggregation (sequence-, token- and constant-
normalised losses differ on unequal lengths), prompt and padding carrying no gradient, and
the gradient under accumulation equal to one pass over the rows in the loss."""

from __future__ import annotations

import torch

from grpolab import core
from grpolab.check import Check, Mutant
from grpolab.checks.context import signed_advantages
from grpolab.objective.base import max_abs

UNEQUAL_LENGTHS = (6, 1, 3, 4)


def unequal_lengths_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random per-token values [4, 6] and a mask of UNEQUAL_LENGTHS completion tokens: the
    case where sequence-, token- and constant-normalised losses all differ."""
    per_token = torch.randn(4, 6, generator=g)
    mask = torch.zeros(4, 6)
    for i, n in enumerate(UNEQUAL_LENGTHS):
        mask[i, :n] = 1
    return per_token, mask


def aggregation(ctx):
    o = ctx.objective
    g = torch.Generator().manual_seed(ctx.settings.seed)
    per_token, mask = unequal_lengths_batch(g)
    L = o.max_completion_length or 8
    values = {mode: float(core.aggregate(per_token, mask, mode, L)) for mode in core.AGGREGATIONS}
    got = float(ctx.impl.aggregate(per_token, mask, o.loss_type, L))
    # The assembled loss must use the same normaliser: at ratio 1 with A_i = -(i + 1) the
    # per-token values of row i are all i + 1, so only the normaliser decides the value.
    logp = torch.log(torch.rand(4, 6, generator=g) * 0.5 + 0.25)
    advantages = -torch.arange(1.0, 5.0)
    loss, _ = ctx.loss(logp, logp, None, advantages, mask, L=L)
    reference, _ = ctx.reference_policy(logp, logp, advantages, mask)
    expected = float(ctx.aggregate(reference.detach(), mask.double(), L))
    gap = max(abs(got - values[o.aggregation]), abs(float(loss) - expected))
    others = ", ".join(f"{m} {v:.3f}" for m, v in values.items() if m != o.aggregation)
    return ctx.result(
        f"|loss - {o.aggregation}-mean| on unequal lengths ({others})", gap, "<= 1e-5", gap <= 1e-5
    )


def masked_gradient(ctx):
    """The loss's gradient with respect to the log-probs: the model's backward adds nothing
    to it, so the log-probs are a leaf here."""
    batch = ctx.batch
    with torch.no_grad():
        logp, mask = ctx.impl.sequence_logprobs(
            ctx.model,
            batch.input_ids,
            batch.attention_mask,
            batch.completion_mask,
            ctx.objective.temperature,
        )
    logp_new = logp.detach().requires_grad_()
    advantages = signed_advantages(batch.input_ids.shape[0])
    loss, _ = ctx.loss(logp_new, logp_new.detach(), None, advantages, mask)
    loss.backward()
    leak = max_abs(logp_new.grad[~batch.completion_mask[:, 1:].bool()])
    return ctx.result(
        "max |d loss / d logp| on prompt and padding positions", leak, "== 0", leak == 0.0
    )


# Unequal lengths (tokens per row), two rows out of the loss when rows can leave it.
MINIBATCH_LENGTHS = (5, 1, 7, 3, 6, 2, 4, 7, 1)
MINIBATCH_SPLITS = ((9, 1), (9, 2), (9, 4), (3, 1), (3, 2), (5, 3))  # (mini_batch_size, micro)


def minibatch_invariance(ctx):
    """Each optimizer step's gradient accumulated over micro-batches with the trainer's
    scaling (micro_batch_scale) equals the gradient of that minibatch's loss in one pass over
    the rows in the loss, for several mini_batch_size / micro-batch splits (TRL PR #6024,
    ms-swift #10117, verl #5625: token-mean scaled by rows under accumulation; TRL #6369: rows
    out of the loss still counted). Ratio 1, float64: no clip bound is near."""
    o = ctx.objective
    T = max(MINIBATCH_LENGTHS)
    lengths = torch.tensor(MINIBATCH_LENGTHS)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()  # [9, T]
    if o.mask_truncated_completions or o.dynamic_sampling:
        mask[[2, 6]] = 0.0  # a truncated row and a filler: out of the loss
    g = torch.Generator().manual_seed(ctx.settings.seed + 3)
    logp = -torch.rand(mask.shape, generator=g, dtype=torch.float64) - 0.1  # [9, T]
    adv = torch.randn(mask.shape[0], generator=g, dtype=torch.float64)  # [9]

    def grad_of(rows, scale=1.0) -> torch.Tensor:  # of the loss of `rows`, w.r.t. all logp
        leaf = logp.clone().requires_grad_(True)
        loss, _ = ctx.loss(leaf[rows], logp[rows].detach(), None, adv[rows], mask[rows], L=T + 1)
        (grad,) = torch.autograd.grad(torch.as_tensor(loss) * scale, leaf, allow_unused=True)
        return torch.zeros_like(logp) if grad is None else grad

    worst = 0.0
    for mini, micro in MINIBATCH_SPLITS:
        for start in range(0, mask.shape[0], mini):
            rows = torch.arange(start, min(start + mini, mask.shape[0]))
            kept = rows[mask[rows].sum(1) > 0]
            reference = grad_of(kept) if len(kept) else torch.zeros_like(logp)
            accumulated = torch.zeros_like(logp)
            for m in range(0, len(rows), micro):
                part = rows[m : m + micro]
                share = ctx.impl.micro_batch_scale(o.loss_type, mask[part], mask[rows])
                accumulated += grad_of(part, share)
            scale = max(max_abs(reference), 1e-30)
            worst = max(worst, max_abs(accumulated - reference) / scale)
    # float64 sums of at most 9 x 7 terms, each of the size of the largest: far below 1e-10.
    return ctx.result(
        f"max relative |grad(micro-batches, trainer's scaling) - grad(one pass over the rows "
        f"in the loss)| over {len(MINIBATCH_SPLITS)} (mini_batch_size, micro) splits",
        worst,
        "<= 1e-10",
        worst <= 1e-10,
    )


CHECKS = (
    Check(
        "norm.aggregation",
        6,
        "sequence-mean is ((x * m).sum(1) / m.sum(1).clamp(min=1)).mean(); token-mean is "
        "(x * m).sum() / m.sum(); constant is (x * m).sum() / (B * L)",
        aggregation,
        mutants=(Mutant("token_mean_declared_sequence"),),
    ),
    Check(
        "norm.masked_gradient",
        6,
        "mask = completion_mask[:, 1:] (not attention_mask): prompt and padding tokens must "
        "carry no gradient",
        masked_gradient,
        mutants=(Mutant("prompt_in_mask"),),
    ),
    Check(
        "norm.minibatch_invariance",
        6,
        "under gradient accumulation each micro-batch's loss is scaled by its share of the "
        "minibatch's normaliser, counted over the rows in the loss: tokens_micro / "
        "tokens_minibatch for token-mean, b_micro / (rows of the minibatch in the loss) for "
        "sequence-mean and constant; rows out of the loss (truncation masking, dynamic "
        "sampling's fill) count in neither (TRL PR #6024, TRL #6369)",
        minibatch_invariance,
        when=lambda ctx: ctx.settings.accumulation,
        mutants=(
            Mutant("micro_scale_by_rows", {"loss_type": "token"}),
            Mutant(
                "sequence_counts_masked_rows",
                {"loss_type": "sequence", "mask_truncated_completions": True},
            ),
        ),
        declared_only=True,
    ),
)
