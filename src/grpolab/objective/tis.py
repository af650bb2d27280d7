"""Truncated importance sampling against the engine that sampled (TRL's
vllm_importance_sampling_cap / _mode): each token's policy loss times pi_trainer / pi_engine,
capped or dropped above `tis_cap`, correcting for the engine's other numerics. The weights
come from the engine's log-probs, so logp_old must be the trainer's. Its checks: the weights
of a designed case (engine.is_weights), of the real batch before any update, where they are
exp of the summed log-ratio and 1 within the engine's own gap (engine.is_step_one), and of
stale rows whose weight underflows or overflows float32 (engine.is_finite)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpolab.check import Check, Mutant
from grpolab.objective.base import Needs, Option, max_abs
from grpolab.schema import Inert, SchemaError, above_or_off, key

# Per token or per sequence, capped (truncate) or dropped above the cap (mask).
TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class TisKeys:
    # Each token's policy loss times min(pi_trainer / pi_engine, tis_cap); needs the engine's
    # log-probs. None = off.
    tis_cap: float | None = key(None, **above_or_off(0, " (e.g. 2.0)"))
    # token_truncate | token_mask | sequence_truncate | sequence_mask (TRL's default; one
    # weight per sequence, exp of the summed log-ratio, 0 above tis_cap).
    tis_mode: str = key("token_truncate", choices=TIS_MODES)


def tis_weights(
    logp_trainer: torch.Tensor,
    logp_engine: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    mode: str = "token_truncate",
) -> torch.Tensor:
    """Importance weights pi_trainer / pi_engine against the engine that sampled: [B, T].

    The engine sampled from pi_engine; the loss is built on the trainer's pi_trainer. Their
    ratio reweights each sampled token to the trainer's distribution. mode: "token_truncate"
    min(ratio, cap) per token (the cap bounds the variance); "token_mask" the ratio, 0 where
    it exceeds the cap; "sequence_truncate" / "sequence_mask" one ratio per sequence, exp of
    the SUM of its tokens' log-ratios (the probability ratio of the whole completion), capped
    or dropped (0) above the cap, on each of its tokens. 1 at masked positions (token modes).
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if mode not in TIS_MODES:
        raise ValueError(f"mode={mode!r} is not one of {list(TIS_MODES)}")
    shapes = {tuple(t.shape) for t in (logp_trainer, logp_engine, mask)}
    if len(shapes) > 1:
        raise ValueError(
            f"shapes must match: logp_trainer {tuple(logp_trainer.shape)}, logp_engine "
            f"{tuple(logp_engine.shape)}, mask {tuple(mask.shape)}"
        )
    log_w = torch.where(mask.bool(), logp_trainer - logp_engine, torch.zeros_like(logp_trainer))
    if mode.startswith("sequence"):
        log_w = log_w.sum(dim=1, keepdim=True)  # [B, 1]
    w = torch.exp(log_w)
    if mode.endswith("truncate"):
        w = w.clamp(max=cap)
    else:
        w = torch.where(w > cap, torch.zeros_like(w), w)
    return w.expand_as(logp_trainer)


def rules(o) -> None:
    if o.tis_mode != "token_truncate" and o.tis_cap is None:
        raise SchemaError("tis_mode", o.tis_mode, "tis_cap set too")
    if o.tis_cap is not None and o.logprob_source != "trainer":
        raise SchemaError(
            "tis_cap", o.tis_cap, "logprob_source=trainer: the weights are pi_trainer / "
            "pi_engine, so logp_old must be the trainer's"
        )  # fmt: skip


def needs(o) -> tuple[Needs, ...]:
    if o.tis_cap is None:
        return ()
    mode = (Needs("tis_weights", "mode", "tis_mode"),) if o.tis_mode != "token_truncate" else ()
    return (Needs("grpo_loss", "token_weights", "tis_cap"), *mode)


def token_weights(o, fns, micro) -> tuple[torch.Tensor, dict[str, float]]:
    """The importance weights against the engine's log-probs ([b, T-1], the function table's
    tis_weights) and their sums: weight, tokens, tokens (sequences) the cap truncated or
    dropped, sequences."""
    mask = micro.mask
    weights = fns.tis_weights(micro.logp_old, micro.engine_logprobs, mask, o.tis_cap, **_mode(o))
    hit = (weights >= o.tis_cap) if o.tis_mode.endswith("truncate") else (weights == 0)
    return weights, {
        "weight": float((weights * mask).sum()),
        "tokens": float(mask.sum()),
        "capped": float((hit * mask).sum()),
        "capped_rows": float(((hit * mask).sum(1) > 0).sum()),
        "rows": float((mask.sum(1) > 0).sum()),
    }


def metrics(o, sums: dict[str, float]) -> dict[str, float]:
    """The weights' mean, the share of tokens and of sequences the cap truncated or dropped,
    and under tis_mode *_mask the share dropped (all of them: the loss was exactly 0, which
    the loop stops on)."""
    tokens, rows = max(sums["tokens"], 1.0), max(sums["rows"], 1.0)
    out = {
        "tis/weight_mean": sums["weight"] / tokens,
        "tis/capped_frac": sums["capped"] / tokens,
        "tis/capped_seq_frac": sums["capped_rows"] / rows,
    }
    if o.tis_mode.endswith("mask"):
        out["tis/dropped_frac"] = out["tis/capped_frac"]
    return out


def _card(o) -> dict[str, str]:
    if o.tis_cap is None:
        return {}
    unit = "per sequence (exp of the summed log-ratio)" if "sequence" in o.tis_mode else "per token"
    how = "capped at" if o.tis_mode.endswith("truncate") else "dropped (0) above"
    return {
        "engine": f"policy term x pi_trainer / pi_engine {unit}, {how} {o.tis_cap:g} ({o.tis_mode})"
    }


def engine_is_weights(ctx):
    o = ctx.objective
    g = torch.Generator().manual_seed(3)
    trainer = -torch.rand(4, 5, generator=g) * 2
    engine = trainer + torch.randn(4, 5, generator=g) * 0.4
    engine[0] = trainer[0] - 0.5  # a sequence the trainer finds far likelier (ratio e^2.5)
    mask = torch.ones(4, 5)
    mask[2, 2:] = 0
    mode = {} if o.tis_mode == "token_truncate" else {"mode": o.tis_mode}
    got = ctx.impl.tis_weights(trainer, engine, mask, o.tis_cap, **mode).double()
    log_w = ((trainer - engine).double() * mask).expand(4, 5)
    if o.tis_mode.startswith("sequence"):
        log_w = log_w.sum(1, keepdim=True).expand(4, 5)
    w = torch.exp(log_w)
    w = w.clamp(max=o.tis_cap) if o.tis_mode.endswith("truncate") else w * (w <= o.tis_cap)
    gap = max_abs((got - w)[mask.bool()])
    return ctx.result(
        f"max |weight - (pi_trainer / pi_engine, {o.tis_mode} at {o.tis_cap:g})|",
        gap,
        "<= 1e-5",
        gap <= 1e-5,
    )


F32_EPS = float(torch.finfo(torch.float32).eps)


def _mode(o) -> dict:
    return {} if o.tis_mode == "token_truncate" else {"mode": o.tis_mode}


def float64_weights(trainer, engine, mask, o) -> tuple[torch.Tensor, torch.Tensor]:
    """(the declared weights [B, T] in float64, their log before the cap [B, T]): exp of each
    token's log-ratio, or of its sequence's summed log-ratio, capped or dropped above tis_cap."""
    log_w = torch.where(mask.bool(), trainer.double() - engine.double(), torch.zeros(()).double())
    if o.tis_mode.startswith("sequence"):
        log_w = log_w.sum(1, keepdim=True).expand_as(log_w)
    w = torch.exp(log_w)
    w = w.clamp(max=o.tis_cap) if o.tis_mode.endswith("truncate") else w * (w <= o.tis_cap)
    return w, log_w


def weight_gaps(got, trainer, engine, mask, o) -> torch.Tensor:
    """Each weight's relative distance from float64 [B, T] over the tolerance its float32
    inputs allow (<= 1 passes; inf where a weight is not finite): the log of a weight sums
    float32 log-probs, each rounded by up to an ulp of its size, so exp's relative error is
    that sum's rounding. A weight within that of the cap may land on either side of it."""
    expected, log_w = float64_weights(trainer, engine, mask, o)
    size = torch.where(mask.bool(), trainer.double().abs() + engine.double().abs(), 0.0)
    if o.tis_mode.startswith("sequence"):
        size = size.sum(1, keepdim=True).expand_as(size)
    tol = 8 * F32_EPS * size + 4 * F32_EPS
    got = got.double()
    gap = (got - expected).abs() / (expected.abs() * tol).clamp(min=1e-30)
    gap = torch.where(expected.abs() < 1e-30, (got - expected).abs() / 1e-30, gap)
    tie = (log_w - math.log(o.tis_cap)).abs() <= tol
    either = torch.minimum(gap, (got - o.tis_cap).abs() / (o.tis_cap * tol))
    gap = torch.where(tie, torch.minimum(either, got.abs() / 1e-30), gap)
    gap = torch.where(torch.isfinite(got), gap, torch.full_like(gap, math.inf))
    return torch.where(mask.bool(), gap, torch.zeros_like(gap))


def trainer_logprobs(ctx) -> torch.Tensor:
    """The trainer's log-probs of the real batch [B, T-1] before any update (no gradient)."""

    def compute():
        b = ctx.batch
        args = (b.input_ids, b.attention_mask, b.completion_mask, ctx.objective.temperature)
        with torch.no_grad():
            return ctx.impl.sequence_logprobs(ctx.model, *args)[0]

    return ctx.memo("tis.trainer_logprobs", compute)


def engine_is_step_one(ctx):
    """On the real batch before any update, the weights of the trainer's log-probs against the
    engine's: each exp of its (summed) masked log-ratio within the float32 rounding of its
    inputs, finite; and the mean of those the cap leaves alone 1 within the engine's own
    gap (NeMo-RL PR #2269: a sequence weight of 0.06 at step 1 while the policy ratio was
    1.0001; unsloth-zoo PR #870: a sequence weight summed from token ratios)."""
    o = ctx.objective
    trainer, engine = trainer_logprobs(ctx), ctx.batch.engine_logprobs
    mask = ctx.batch.completion_mask[:, 1:].float()
    got = ctx.impl.tis_weights(trainer, engine, mask, o.tis_cap, **_mode(o)).detach()
    worst = float(weight_gaps(got, trainer, engine, mask, o).max())
    gap = torch.where(mask.bool(), (trainer.double() - engine.double()).abs(), 0.0)
    reach = gap.sum(1).max() if o.tis_mode.startswith("sequence") else gap.max()
    expected, _ = float64_weights(trainer, engine, mask, o)
    free = mask.bool() & (expected < o.tis_cap) & (expected > 0)  # left alone by the cap
    mean = float(got.double()[free].mean()) if free.any() else 1.0
    allowed = math.expm1(float(reach)) + 8 * F32_EPS
    off = abs(mean - 1) / allowed if math.isfinite(mean) else math.inf
    return ctx.result(
        f"real batch, step 1 ({o.tis_mode}, cap {o.tis_cap:g}): max weight gap to float64 exp "
        f"of the {'summed ' if 'sequence' in o.tis_mode else ''}log-ratio over its float32 "
        f"rounding, and |mean weight - 1| = {abs(mean - 1):.2e} over the engine's gap "
        f"exp({float(reach):.1e}) - 1",
        max(worst, off),
        "<= 1",
        max(worst, off) <= 1,
    )


def stale_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(trainer, engine, mask) [4, 300] float32: a stale sequence whose weight underflows
    float32 (0.7 per token over 300 tokens, TRL PR #7120), one whose weight overflows it, a
    short one near 1, and single tokens 100 nats apart either way."""
    T = 300
    trainer = -torch.linspace(0.2, 3.0, 4 * T).view(4, T)
    engine = trainer.clone()
    engine[0] = trainer[0] - math.log(0.7)  # trainer / engine = 0.7 per token
    engine[1] = trainer[1] + math.log(0.7)  # 1 / 0.7 per token
    engine[2, :5] = trainer[2, :5] + torch.tensor([0.1, -0.2, 0.05, 0.0, 0.1])
    trainer[3, :2] = torch.tensor([-1.0, -101.0])
    engine[3, :2] = torch.tensor([-101.0, -1.0])
    mask = torch.ones(4, T)
    mask[2, 5:] = 0
    mask[3, 2:] = 0
    return trainer, engine, mask


def engine_is_finite(ctx):
    """Weights of stale rows, whose exp(sum) leaves float32's range: finite, and the float64
    weights (0 where it underflows, the cap or 0 where it overflows). clamp(rho) / rho is
    0 / 0 there (TRL PR #7120), a NaN that no mask removes."""
    o = ctx.objective
    trainer, engine, mask = stale_rows()
    got = ctx.impl.tis_weights(trainer, engine, mask, o.tis_cap, **_mode(o)).detach().double()
    expected, _ = float64_weights(trainer, engine, mask, o)
    gap = torch.where(mask.bool(), (got - expected).abs(), 0.0)
    gap = torch.where(torch.isfinite(got) | ~mask.bool(), gap, math.inf)
    worst = float(gap.max())
    return ctx.result(
        f"max |weight - float64| on stale rows (exp of a summed log-ratio of -107 and +107 "
        f"nats; {o.tis_mode}, cap {o.tis_cap:g})",
        worst,
        "finite, <= 1e-5",
        worst <= 1e-5,
    )


def _declared(ctx) -> bool:
    return ctx.objective.tis_cap is not None


def _declared_with_engine(ctx) -> bool:
    return _declared(ctx) and ctx.batch.engine_logprobs is not None


TIS = Option(
    name="tis",
    keys=TisKeys,
    rules=rules,
    active=lambda o: o.tis_cap is not None,
    needs=needs,
    card=_card,
    trl={
        "vllm_importance_sampling_cap": "tis_cap",
        "vllm_importance_sampling_clip_max": "tis_cap",
        "vllm_importance_sampling_mode": "tis_mode",
    },
    functions={"tis_weights": tis_weights},
    token_weights=token_weights,
    metrics=metrics,
    engine_logprobs=lambda o: "objective.tis_cap",
    inert=(
        Inert(
            ("objective.tis_cap",),
            ("rollout.engine", "rollout.top_k", "rollout.top_p"),
            lambda c: c.rollout.engine == "vllm" and (c.rollout.top_k > 0 or c.rollout.top_p < 1),
            "with rollout.engine=vllm and top_k / top_p: vLLM returns no log-probs of the "
            "untruncated distribution to weight against",
        ),
        Inert(
            ("monitors.tis_capped_max",),
            ("objective.tis_cap",),
            lambda c: c.objective.tis_cap is None,
            "without objective.tis_cap: there are no importance weights to cap",
        ),
    ),
    checks=(
        Check(
            "engine.is_weights",
            0,
            "importance weights pi_trainer / pi_engine = exp(logp_trainer - logp_engine); per "
            "sequence: exp of the summed log-ratio; truncate caps, mask zeroes above the cap",
            engine_is_weights,
            when=_declared,
            mutants=(Mutant("seq_is_wrong_sign", {"tis_cap": 3.0, "tis_mode": "sequence_mask"}),),
            declared_only=True,
        ),
        Check(
            "engine.is_step_one",
            0,
            "before any update the weights are pi_trainer / pi_engine of the same policy, 1 "
            "within the engine's own gap: a sequence's weight is exp of the SUM of its masked "
            "token log-ratios (not the sum or mean of token ratios, nor a sum over prompt or "
            "padding positions, whose log-probs the engine never reported)",
            engine_is_step_one,
            when=_declared_with_engine,
            mutants=(
                Mutant("is_sum_of_ratios", {"tis_cap": 3.0, "tis_mode": "sequence_truncate"}),
                Mutant("is_weights_unmasked", {"tis_cap": 3.0, "tis_mode": "sequence_mask"}),
            ),
            blame_before="engine.is_weights",
            declared_only=True,
        ),
        Check(
            "engine.is_finite",
            0,
            "a stale sequence's exp(summed log-ratio) under- or overflows float32: cap or drop "
            "the weight itself (min(w, cap); 0 where w > cap), never clamp(w) / w, which is "
            "0 / 0 = NaN there (TRL PR #7120)",
            engine_is_finite,
            when=_declared,
            mutants=(
                Mutant("is_truncate_ratio", {"tis_cap": 2.0, "tis_mode": "sequence_truncate"}),
            ),
            declared_only=True,
        ),
    ),
)
