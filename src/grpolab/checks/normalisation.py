"""Goal 6, the normalisation: the declared aggregation (sequence-, token- and constant-
normalised losses differ on unequal lengths), prompt and padding carrying no gradient, the
EOS that ends a completion carrying it, and the gradient under accumulation equal to one pass
over the rows in the loss, with the tokens (rows) each micro-batch's loss is divided by
counted over every micro-batch and rank."""

from __future__ import annotations

import torch

from grpolab import core
from grpolab.check import Check, Mutant
from grpolab.checks.context import PreflightBatch, grad_rows, signed_advantages
from grpolab.objective import rows_can_leave_loss
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


def stop_ids(ctx) -> list[int]:
    """The engine's stop tokens, EOS first (the batch's, else the model config's EOS)."""
    if ctx.batch.stop_ids:
        return list(ctx.batch.stop_ids)
    eos = getattr(ctx.model.config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids:
        raise ValueError("neither the batch nor the model config names an EOS token")
    return ids


def finished_rows(ctx) -> tuple[PreflightBatch, torch.Tensor, int]:
    """(the real batch's first grad rows with every completion finished, each row's EOS
    column [B], how many ended in a stop token as sampled): a completion cut at the length
    limit has its last token replaced by the EOS id, so that every row has an EOS where the
    engine puts it (and, where pad == EOS, the id a padding mask would also match)."""
    batch = grad_rows(ctx.batch, ctx.settings)
    stops = stop_ids(ctx)
    columns = torch.arange(batch.input_ids.shape[1])
    last = (batch.completion_mask.bool() * columns).max(dim=1).values  # [B]
    rows = torch.arange(len(last))
    sampled = torch.isin(batch.input_ids[rows, last], torch.tensor(stops))
    input_ids = batch.input_ids.clone()
    input_ids[rows[~sampled], last[~sampled]] = stops[0]
    finished = PreflightBatch(
        input_ids, batch.attention_mask, batch.completion_mask, batch.rewards, batch.group_size
    )
    return finished, last, int(sampled.sum())


def eos_in_loss(ctx):
    """The EOS that ends each finished completion is inside the loss mask and carries
    gradient (TRL PRs #4970, #6357: padding found by its id where pad == EOS masked the real
    EOS too, and the model never learned to stop): the implementation's log-probs and mask on
    the real batch's rows, the loss's gradient at each EOS's log-prob, signed advantages."""
    batch, last, sampled = finished_rows(ctx)
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    with torch.no_grad():
        logp, mask = ctx.impl.sequence_logprobs(ctx.model, *args, ctx.objective.temperature)
    logp_new = logp.detach().requires_grad_()
    advantages = signed_advantages(batch.input_ids.shape[0])
    loss, _ = ctx.loss(logp_new, logp_new.detach(), None, advantages, mask)
    (grad,) = torch.autograd.grad(torch.as_tensor(loss), logp_new, allow_unused=True)
    grad = torch.zeros_like(logp_new) if grad is None else grad
    rows = torch.arange(len(last))
    at_eos = last - 1  # logp[:, t] is the log-prob of input_ids[:, t + 1]
    left_out = (mask[rows, at_eos] == 0) | (grad[rows, at_eos] == 0)
    return ctx.result(
        f"completions whose EOS is out of the loss mask or gets no gradient, of {len(rows)} "
        f"({sampled} ended in EOS as sampled, the rest given one)",
        int(left_out.sum()),
        "== 0",
        not bool(left_out.any()),
    )


def split_rows(B: int, minibatch: int, micro: int, world: int) -> list[list[list[torch.Tensor]]]:
    """The trainer's cut of B rows over `world` ranks (contiguous shares), each rank's share
    into minibatches of `minibatch` rows (one optimizer step each) and those into micro-batches
    of `micro`: [optimizer step][rank] -> that rank's micro-batches (row indices)."""
    per_rank = B // world
    steps = []
    for start in range(0, per_rank, minibatch):
        ranks = []
        for r in range(world):
            first = r * per_rank
            rows = torch.arange(first + start, first + min(start + minibatch, per_rank))
            ranks.append([rows[m : m + micro] for m in range(0, len(rows), micro)])
        steps.append(ranks)
    return steps


def counted_normalisers(ctx, mask, L, steps) -> tuple[float, float, float]:
    """(worst relative gap, that micro-batch's normaliser, its minibatch's count): each
    micro-batch's loss of ones (the implementation's aggregate, times its micro_batch_scale
    share with the count summed over ranks, as the trainer scales it) divides its own sum by
    a normaliser; that must be the whole minibatch's count over every rank: its mask's tokens
    ("token") or its rows in the loss (sequence, constant)."""
    o = ctx.objective
    token = core.aggregation(o.loss_type) == "token"
    worst, shown = 0.0, (0.0, 0.0)
    for ranks in steps:
        rank_masks = [mask[torch.cat(micros)] for micros in ranks]
        count = sum(core.normaliser_count(o.loss_type, m) for m in rank_masks)  # all ranks
        expected = float(mask[torch.cat([torch.cat(m) for m in ranks])].sum()) if token else count
        for micros, rank_mask in zip(ranks, rank_masks, strict=True):
            for rows in micros:
                m = mask[rows]
                value = float(ctx.impl.aggregate(m.clone(), m, o.loss_type, L))
                share = float(ctx.impl.micro_batch_scale(o.loss_type, m, rank_mask, count))
                own = {"token": m.sum(), "sequence": (m.sum(1) > 0).sum(), "constant": m.sum() / L}
                total = float(own[core.aggregation(o.loss_type)])
                if total == 0:
                    continue  # no row of it in the loss: it adds nothing
                normaliser = total / (value * share) if value * share else float("inf")
                gap = abs(normaliser - expected) / max(expected, 1.0)
                if gap >= worst:
                    worst, shown = gap, (normaliser, expected)
    return worst, *shown


def token_count(ctx):
    """The count each micro-batch's loss is divided by, summed over micro-batches, ranks and
    accumulation steps as the trainer sums it, is the mask's (verl #7321: the micro-batch's
    own count; SkyRL PR #1296: each DDP worker's own; ms-swift #10117: divided by the
    accumulation steps twice): on the real batch's mask, under the run's split on one
    process and its minibatches over 2 ranks."""
    o = ctx.objective
    mask = ctx.batch.completion_mask[:, 1:].float()
    B = mask.shape[0]
    if rows_can_leave_loss(o):
        mask[[1, B // 2 + 1]] = 0.0  # a truncated row and a filler: out of the loss
    L = o.max_completion_length or mask.shape[1]
    minibatch = min(ctx.settings.minibatch or B, B)
    micro = min(ctx.settings.grad_rows or minibatch, minibatch)
    per_rank = max(1, minibatch // 2)
    splits = {
        f"mini {minibatch} x micro {micro}": split_rows(B, minibatch, micro, 1),
        f"2 ranks x mini {per_rank} x micro {max(1, per_rank // 2)}": split_rows(
            B - B % 2, per_rank, max(1, per_rank // 2), 2
        ),
    }
    gaps = {name: counted_normalisers(ctx, mask, L, steps) for name, steps in splits.items()}
    name = max(gaps, key=lambda k: gaps[k][0])
    (worst, counted, count), unit = gaps[name], "tokens" if o.aggregation == "token" else "rows"
    return ctx.result(
        f"max relative gap of the {unit} a micro-batch's scaled loss is divided by to the "
        f"minibatch's count over every rank ({' and '.join(splits)}; worst {counted:.6g} "
        f"against {count:g} under {name})",
        worst,
        "<= 1e-5",
        worst <= 1e-5,
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
    if rows_can_leave_loss(o):
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
        "norm.eos",
        6,
        "the EOS that ends a finished completion is a sampled token: keep it in the mask "
        "(completion_mask[:, 1:]), never find padding by its token id (pad == EOS for many "
        "tokenizers, SmolLM2's included), or the model never learns to stop",
        eos_in_loss,
        mutants=(Mutant("eos_as_padding"),),
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
    Check(
        "norm.token_count",
        6,
        "a micro-batch's loss must be divided by the whole minibatch's count over every rank "
        "and accumulation step: scale it by its share of the count the trainer hands in "
        "(minibatch_count, summed over ranks), not by its own count, its rank's, or once more "
        "by the number of micro-batches",
        token_count,
        when=lambda ctx: ctx.settings.accumulation,
        mutants=(Mutant("micro_scale_local_count"),),
        declared_only=True,
    ),
)
