"""The engine's samples against the trainer's: the tokens the loss trains are the tokens the
engine drew (engine.trained_tokens), and under top-k / top-p each was drawn from the declared
truncated distribution while every log-prob, the engine's and the trainer's, is of the
untruncated one, as the objective card declares (engine.sampling). On the real batch, against
the model's own logits in float64."""

from __future__ import annotations

import math

import torch

from grpolab.check import Check, Mutant
from grpolab.checks import reference
from grpolab.checks.tolerance import precision_tolerance
from grpolab.objective.base import max_abs

ROWS_PER_FORWARD = 4  # [rows, T, V] float64 logits at a time


def kept(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[n, V] bool: the tokens softmax(scaled) keeps under top-k, then top-p over what top-k
    kept (transformers' order, the hf engine's and vLLM's): top-k keeps the k largest; top-p
    keeps a token when the mass of the tokens strictly more likely than it is < top_p."""
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if 0 < top_k < scaled.shape[-1]:
        keep = scaled >= torch.topk(scaled, top_k, dim=-1).values[:, -1:]
    if top_p < 1:
        p = torch.softmax(scaled.masked_fill(~keep, -math.inf), dim=-1)  # [n, V]
        ascending, order = torch.sort(p, dim=-1)
        above = ascending.flip(-1).cumsum(-1).flip(-1) - ascending  # strictly more likely
        keep = keep & (above < top_p).scatter(-1, order, above < top_p)
    return keep


def in_kept_set(scaled, tokens, top_k: int, top_p: float, slack: float) -> torch.Tensor:
    """[n] bool: each token is in the kept set of softmax(scaled [n, V]) with the engine's
    numerics allowed for: logits `slack` nats closer to the k-th, the mass above it e^(2
    slack) times smaller (the engine's logits may be that far from these)."""
    ok = torch.ones(len(tokens), dtype=torch.bool)
    own = scaled.gather(-1, tokens[:, None])  # [n, 1]
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        ok &= (own >= kth - slack).squeeze(-1)
    if top_p < 1:
        cut = kept(scaled, top_k, 1.0)  # top-p runs over what top-k kept
        p = torch.softmax(scaled.masked_fill(~cut, -math.inf), dim=-1)
        above = (p * (scaled > own + slack)).sum(-1)  # strictly above, beyond the slack
        ok &= above < top_p
    return ok


def distributions(ctx):
    """On the real batch's completion tokens: (the tokens [n], each a float64 log-prob of the
    untruncated and of the truncated distribution [n], whether it is in the kept set [n],
    the float32 log-softmax's largest distance from float64), once per run."""

    def compute():
        o, batch, slack = ctx.objective, ctx.batch, ctx.settings.engine_gap_max
        parts = []
        for r0 in range(0, batch.input_ids.shape[0], ROWS_PER_FORWARD):
            rows = slice(r0, r0 + ROWS_PER_FORWARD)
            ids, valid = batch.input_ids[rows], batch.completion_mask[rows, 1:].bool()
            with torch.no_grad():
                logits = reference.logits(ctx.model, ids, batch.attention_mask[rows])[valid]
            scaled = logits.double() / o.temperature  # [n, V]
            tokens = ids[:, 1:][valid]
            raw = torch.log_softmax(scaled, -1)
            cut = torch.log_softmax(
                scaled.masked_fill(~kept(scaled, o.top_k, o.top_p), -math.inf), -1
            )
            plain = torch.log_softmax(logits.float() / o.temperature, -1).gather(
                -1, tokens[:, None]
            )
            parts.append(
                (
                    raw.gather(-1, tokens[:, None]).squeeze(-1),
                    cut.gather(-1, tokens[:, None]).squeeze(-1),
                    in_kept_set(scaled, tokens, o.top_k, o.top_p, slack),
                    (plain.squeeze(-1).double() - raw.gather(-1, tokens[:, None]).squeeze(-1)),
                )
            )
        raw, cut, ok, plain = (torch.cat(p) for p in zip(*parts, strict=True))
        return raw, cut, ok, max_abs(plain)

    return ctx.memo("sampling.distributions", compute)


def read_as_truncated(logp, raw, cut, tol: float) -> int:
    """Positions [n] whose log-probs are the truncated distribution's, not the untruncated
    one's: where the cut moves a log-prob by more than twice `tol` (the mass it removes,
    -log kept mass), nearer the truncated value than the untruncated."""
    apart = (cut - raw).abs() > 2 * tol
    return int((apart & ((logp - raw).abs() > 0.5 * (cut - raw).abs())).sum())


def sampling(ctx):
    """Under top-k / top-p, on the real batch: every sampled token is in the kept set of the
    model's softmax(logits / T) (an engine ignoring its top-k or temperature draws outside
    it: tinker-feedback #148); and the engine's and the trainer's log-probs are both of the
    untruncated distribution the objective card declares, not of the truncated one (TRL
    #6945: vLLM's processed log-probs against the raw ones make an unchanged policy's ratio
    the kept mass; prime-rl PR #3186: a trainer scoring its sampler's top-k)."""
    o, batch = ctx.objective, ctx.batch
    raw, cut, ok, plain_gap = distributions(ctx)
    valid = batch.completion_mask[:, 1:].bool()
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask, o.temperature)
    with torch.no_grad():
        logp, _ = ctx.impl.sequence_logprobs(ctx.model, *args)
    tol = precision_tolerance(plain_gap, max_abs(raw), torch.float32)
    trainer = read_as_truncated(logp[valid].double(), raw, cut, max(tol, 1e-4))
    engine = 0
    if batch.engine_logprobs is not None:
        gap = ctx.settings.engine_gap_max
        engine = read_as_truncated(batch.engine_logprobs[valid].double(), raw, cut, gap)
    outside = int((~ok).sum())
    cut_text = ", ".join(
        [f"top-k {o.top_k}"] * (o.top_k > 0) + [f"top-p {o.top_p:g}"] * (o.top_p < 1)
    )
    return ctx.result(
        f"of {len(ok)} sampled tokens ({cut_text} at T = {o.temperature:g}): {outside} outside "
        f"the kept set; log-probs of the truncated distribution, not the untruncated one "
        f"declared: trainer {trainer}, engine "
        + (str(engine) if batch.engine_logprobs is not None else "(none reported)"),
        outside + trainer + engine,
        "== 0",
        outside + trainer + engine == 0,
    )


def trained_tokens(ctx):
    """The tokens the loss trains are the tokens the engine drew: the mask the trainer's
    log-probs come with has no position the engine did not sample (a response prefix, a
    prompt or re-tokenised token: ms-swift #10106) and leaves none of them out, row by row
    (the engine's count of each completion, its EOS included, is the loss's)."""
    batch = ctx.batch
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    with torch.no_grad():
        _, mask = ctx.impl.sequence_logprobs(ctx.model, *args, ctx.objective.temperature)
    sampled = batch.completion_mask[:, 1:].bool()  # the engine's tokens, as it returned them
    trained = mask.bool()
    extra, missing = int((trained & ~sampled).sum()), int((sampled & ~trained).sum())
    rows = int((trained.sum(1) != sampled.sum(1)).sum())
    return ctx.result(
        f"positions trained that the engine did not sample ({extra}) or sampled and left out "
        f"({missing}), of {int(sampled.sum())}; rows whose counts differ: {rows}",
        extra + missing,
        "== 0",
        extra + missing == 0,
    )


CHECKS = (
    Check(
        "engine.trained_tokens",
        0,
        "the loss trains exactly the tokens the engine sampled (completion_mask[:, 1:]): no "
        "prompt, prefix or re-tokenised token the engine never produced, and every sampled "
        "one, its EOS included",
        trained_tokens,
    ),
    Check(
        "engine.sampling",
        0,
        "under top-k / top-p the engine samples from the truncated softmax(logits / T), and "
        "every log-prob, the engine's and the trainer's, is of the untruncated softmax(logits "
        "/ T) (as the objective card declares): score the full distribution, never the "
        "sampler's renormalised top-k / top-p",
        sampling,
        when=lambda ctx: ctx.objective.truncated_sampling,
        mutants=(Mutant("logprobs_top_k", {"top_k": 20}),),
        blame_before="logprobs.shift",
        declared_only=True,
    ),
)
