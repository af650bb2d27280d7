"""engine.sync_coverage: the weight sync reaches every trained parameter of an engine that
samples from its own copy (vLLM; the hf engine's bf16 copies). Each group of trained
parameters (the output head, with the input embedding where they are tied; the input
embedding; the LoRA adapters on either; the other LoRA adapters; every other trained weight)
is moved alone, the engine synced as the trainer syncs it and checked (`check_sync`: the
canary, or every bf16 copy against one made afresh), then the weights are put back and
synced again. A sync that skips a group leaves the engine on its old values, which the
check sees because the move is made large enough to: the trainer's own canary log-probs move
by PROBE_MOVE nats (prime-rl PR #2823, vLLM PR #51665: a tied lm_head left stale)."""

from __future__ import annotations

import torch

from grpolab.check import Check, Mutant
from grpolab.rollout.common import CANARY_TEXT, WeightSyncError, trainer_logprobs

PROBE_MOVE = 1.0  # nats of the canary's log-probs: past any engine's sync tolerance
FIRST_SCALE = 0.05  # relative to each weight's root mean square
MAX_DOUBLINGS = 8


def parameter_groups(model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    """The trained parameters by what a sync may handle apart: name -> parameters."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    head_params = {id(p) for p in (head.parameters() if head is not None else ())}
    embed_params = {id(p) for p in (embed.parameters() if embed is not None else ())}
    groups: dict[str, list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        lora = "lora_" in name
        if id(p) in head_params:
            group = "the output head (tied to the input embedding)" if tied else "the output head"
        elif id(p) in embed_params:
            group = "the input embedding"
        else:
            group = "every other trained weight"
        if lora:
            group = "LoRA adapters" if group.startswith("every") else f"LoRA adapters on {group}"
        groups.setdefault(group, []).append(p)
    return groups


def canary_logprobs(engine, model) -> torch.Tensor:
    ids = list(engine.tokenizer(CANARY_TEXT, add_special_tokens=True)["input_ids"])[:64]
    return trainer_logprobs(model, ids)


@torch.no_grad()
def moved(engine, model, params: list[torch.nn.Parameter], seed: int) -> float:
    """Move `params` in place (a seeded random direction, scaled to each weight's size) until
    the trainer's canary log-probs move by PROBE_MOVE nats; returns that move. Written
    through `.data`, as a fused optimizer step writes them: no version counter moves, so
    nothing but the sync can tell a copy of them is stale."""
    before = canary_logprobs(engine, model)
    g = torch.Generator().manual_seed(seed)
    directions = []
    for p in params:
        rms = float(p.detach().float().pow(2).mean().sqrt())
        noise = torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)
        directions.append(noise * (rms if rms > 0 else 0.02))
    originals = [p.detach().clone() for p in params]
    scale, move = FIRST_SCALE, 0.0
    for _ in range(MAX_DOUBLINGS):
        for p, original, d in zip(params, originals, directions, strict=True):
            p.data.copy_(original + scale * d)
        move = float((canary_logprobs(engine, model) - before).abs().max())
        if move >= PROBE_MOVE:
            break
        scale *= 2
    return move


def probe_sync(engine, model, seed: int = 0) -> dict[str, str]:
    """Each group of `model`'s trained parameters moved alone, `engine` synced and checked:
    group -> what went wrong (nothing: empty). The weights are put back and synced after
    each group, the engine's check failing there too if the sync cannot restore them."""
    failed = {}
    for i, (group, params) in enumerate(parameter_groups(model).items()):
        originals, move = [p.detach().clone() for p in params], 0.0
        try:
            move = moved(engine, model, params, seed + i)
            engine.sync_weights(model)
            engine.check_sync(model)
        except WeightSyncError as err:
            failed[group] = f"moved by {move:.2g} nats on the canary, {err}"
        finally:
            with torch.no_grad():
                for p, original in zip(params, originals, strict=True):
                    p.data.copy_(original)
        try:
            engine.sync_weights(model)
        except WeightSyncError as err:
            failed.setdefault(group, f"put back: {err}")
    return failed


def holds_copy(engine, model) -> bool:
    """The engine samples from weights of its own (vLLM; hf under bf16 or on another model),
    which a sync must bring up to date; the hf engine in fp32 samples from `model` itself."""
    precision = getattr(engine, "precision", None)
    return getattr(engine, "model", None) is not model or bool(precision and precision.bf16)


def sync_coverage(ctx):
    engine, model = ctx.run.engine, ctx.model
    ctx.say("the weight sync on each group of trained parameters")
    groups = list(parameter_groups(model))
    failed = probe_sync(engine, model, ctx.settings.seed)
    first = next(iter(failed.items()), None)
    return ctx.result(
        f"groups of trained parameters the engine's sync left stale, of {len(groups)} ("
        + "; ".join(groups)
        + ")"
        + (f"; first: {first[0]}: {first[1]}" if first else ""),
        len(failed),
        "== 0",
        not failed,
    )


CHECKS = (
    Check(
        "engine.sync_coverage",
        0,
        "the sync must send every trained parameter and the engine load each: a tied output "
        "head is the input embedding (send it under both names, or the one the engine loads), "
        "and LoRA adapters on the head or the embedding are merged into the weight the engine "
        "samples with (prime-rl PR #2823, vLLM PR #51665)",
        sync_coverage,
        when=lambda ctx: holds_copy(ctx.run.engine, ctx.model),
        stage="run",
        mutants=(Mutant("sync_skips_head"),),
    ),
)
