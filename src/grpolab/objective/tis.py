"""Truncated importance sampling against the engine that sampled (TRL's
vllm_importance_sampling_cap / _mode): each token's policy loss times pi_trainer / pi_engine,
capped or dropped above `tis_cap`, correcting for the engine's other numerics. The weights
come from the engine's log-probs, so logp_old must be the trainer's."""

from __future__ import annotations

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


TIS = Option(
    name="tis",
    keys=TisKeys,
    rules=rules,
    needs=needs,
    card=_card,
    inert=(
        Inert(
            ("objective.tis_cap",),
            ("rollout.engine", "rollout.top_k", "rollout.top_p"),
            lambda c: c.rollout.engine == "vllm" and (c.rollout.top_k > 0 or c.rollout.top_p < 1),
            "with rollout.engine=vllm and top_k / top_p: vLLM returns no log-probs of the "
            "untruncated distribution to weight against",
        ),
    ),
    checks=(
        Check(
            "engine.is_weights",
            0,
            "importance weights pi_trainer / pi_engine = exp(logp_trainer - logp_engine); per "
            "sequence: exp of the summed log-ratio; truncate caps, mask zeroes above the cap",
            engine_is_weights,
            when=lambda ctx: ctx.objective.tis_cap is not None,
            mutants=(Mutant("seq_is_wrong_sign", {"tis_cap": 3.0, "tis_mode": "sequence_mask"}),),
            declared_only=True,
        ),
    ),
)
