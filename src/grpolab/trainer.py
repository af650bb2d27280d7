"""The GRPO trainer: the loop, top to bottom, in `train` and `grpo_step`.

sample prompts_per_step prompts x G  -> rollout (eval mode, no grad)
-> rewards [B] -> group advantages [B]
-> logp_old (scheme A: a forward before any update; scheme B: the engine's)
-> logp_ref from a frozen copy when beta > 0 (LoRA: the policy with its adapters disabled)
-> num_iterations inner epochs over minibatches (gradient accumulation over micro-batches)
   -> grpo_loss -> backward -> clip grad norm -> AdamW step -> LR schedule
-> metrics, sample completions, checkpoints
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.markup import escape

from grpolab import core as core_module
from grpolab import dist as dist_module
from grpolab.checkpoint import (
    ADAPTER_DIR,
    check_same_model,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from grpolab.checks import CoreImpl
from grpolab.config import Config, objective_fields, to_dict, to_yaml, validate_world
from grpolab.dist import Dist
from grpolab.evaluate import accuracy_rewards, correct, evaluate_accuracy, evaluate_pass_at_k
from grpolab.memory import limit_heap_retention, release_freed_memory
from grpolab.models import load_policy
from grpolab.monitors import check_step, limits_for
from grpolab.preflight import preflight_gate
from grpolab.rewards import Rewards, load_rewards, score
from grpolab.rollout import build_engine
from grpolab.rollout.base import Rollout
from grpolab.tasks import load_task
from grpolab.tracking import Tracker, progress_bar

DEMO_MODEL_DIR = Path(__file__).parent / "data" / "demo-warmup"
RUN_FILES = (
    "config.yaml",
    "objective.txt",
    "preflight.json",
    "metrics.jsonl",
    "completions.jsonl",
    "summary.json",
)


class MonitorStop(RuntimeError):
    """A monitored quantity left its normal range and trainer.monitor is "stop"."""


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


# --- The core functions the loop calls (a learner's own implementation may replace them) ------


# The six core functions the loop calls, and where each came from (grpolab or a user's file).
CoreFns = CoreImpl


def default_core(logprobs_impl: str = "fused", shared_prefix: bool = True) -> CoreFns:
    """grpolab.core, with the memory-efficient grpolab.logprobs for the log-probs."""
    fns = CoreImpl()
    if logprobs_impl != "core":
        from grpolab.logprobs import token_logprobs

        def sequence_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0):
            return token_logprobs(
                model,
                input_ids,
                attention_mask,
                completion_mask,
                temperature,
                impl=logprobs_impl,
                shared_prefix=shared_prefix,
            )

        fns.sequence_logprobs = sequence_logprobs
        fns.source["sequence_logprobs"] = f"grpolab.logprobs ({logprobs_impl})"
    return fns


# --- Pure helpers -----------------------------------------------------------------------------


def lr_lambda(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """Multiplier of the base LR after `s` optimizer steps: linear warm-up, then constant or
    cosine to 0 at `total`."""

    def f(s: int) -> float:
        if warmup and s < warmup:
            return (s + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """torch.compile, in place, each part of every decoder layer that maps one tensor to one
    tensor (the MLP, the norms): their elementwise chains fuse into a few kernels, and the
    same code in every layer compiles to one graph. Attention stays eager: it takes the KV
    cache and its layer index, which would compile a graph per layer. Returns the count."""
    import inspect

    from transformers.modeling_layers import GradientCheckpointingLayer

    parts = []
    for layer in model.modules():
        if not isinstance(layer, GradientCheckpointingLayer):
            continue
        for child in layer.children():
            params = inspect.signature(child.forward).parameters.values()
            required = [p for p in params if p.default is inspect.Parameter.empty]
            if len(required) == 1 and required[0].kind != inspect.Parameter.VAR_POSITIONAL:
                parts.append(child)
    if not parts:
        raise ValueError(
            f"trainer.torch_compile=true: {type(model).__name__} has no transformers decoder "
            "layer parts (GradientCheckpointingLayer children taking one tensor) to compile"
        )
    for part in parts:
        part.compile(dynamic=True)
    return len(parts)


def fused_adamw_ok(params: list[torch.Tensor]) -> bool:
    """AdamW's fused kernel (one kernel per tensor, ~2x faster steps on small models) takes
    plain floating-point tensors on CPU or CUDA; sharded DTensors keep the default."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(
        not isinstance(p, DTensor) and p.is_floating_point() and p.device.type in ("cpu", "cuda")
        for p in params
    )


def unit_count(mode: str, unit_mask: torch.Tensor) -> float:
    """The loss normaliser's count for one optimizer-step unit: tokens for "token", sequences
    otherwise (constant's B * max_len shares its max_len with every micro-batch)."""
    mode = core_module.LOSS_TYPE_ALIASES.get(mode, mode)
    return float(unit_mask.sum()) if mode == "token" else float(unit_mask.shape[0])


def loss_scale(
    mode: str, micro_mask: torch.Tensor, unit_mask: torch.Tensor, unit_total: float | None = None
) -> float:
    """Factor turning a micro-batch's `aggregate` loss into its share of the loss of the whole
    optimizer-step unit, so accumulated gradients equal the one-pass gradient exactly:
    sequence -> b_micro / b_unit; token -> tokens_micro / tokens_unit (aggregate clamps the
    count at 1); constant -> b_micro / b_unit (same max_completion_length). `unit_total` is the
    unit's count over all ranks (`unit_count` all-reduced); None: this process's unit alone."""
    mode = core_module.LOSS_TYPE_ALIASES.get(mode, mode)
    total = unit_count(mode, unit_mask) if unit_total is None else unit_total
    if mode == "token":
        return float(micro_mask.sum().clamp(min=1)) / max(total, 1.0)
    return micro_mask.shape[0] / total


def is_on_policy(cfg: Config) -> bool:
    """One optimizer step per batch: the policy cannot change before the loss forward, so
    that forward's detached log-probs ARE scheme A's logp_old (no extra pass needed)."""
    t = cfg.trainer
    one_minibatch = t.mini_batch_size in (None, cfg.batch_size)
    return t.num_iterations == 1 and one_minibatch and t.logprob_source == "trainer"


def first_nonfinite(
    named: dict[str, torch.Tensor | None], mask: torch.Tensor | None = None
) -> str | None:
    """The first of the named tensors (in order) with a non-finite value where `mask` is set
    (everywhere without a mask), with a count."""
    for name, t in named.items():
        if t is None:
            continue
        bad = ~torch.isfinite(t)
        if mask is not None:
            bad = bad & mask.bool()
        if bad.any():
            return f"{name} ({int(bad.sum())} non-finite values)"
    return None


def grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# --- One GRPO step ----------------------------------------------------------------------------


@dataclass
class Run:
    """Everything the loop holds."""

    cfg: Config
    model: torch.nn.Module
    tokenizer: Any
    ref_model: torch.nn.Module | None
    engine: Any
    task: Any
    rewards: Rewards  # the training reward functions
    accuracy: Rewards  # the accuracy reward alone, for the accuracy metric and evaluation
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data_gen: torch.Generator
    core: CoreFns
    device: torch.device
    skipped_steps: int = 0
    consecutive_nonfinite: int = 0
    dist: Dist = dataclasses.field(default_factory=Dist)
    reducer: dist_module.GradientReducer | None = None  # ddp: sums gradients during backward


def grpo_step(run: Run, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One GRPO step. Returns (metrics, batch) where batch holds what a replay capsule needs."""
    cfg, t, model, C = run.cfg, run.cfg.trainer, run.model, run.core
    G = t.num_generations
    temperature = cfg.rollout.temperature
    timings: dict[str, float] = {}

    # 1. Rollout: eval mode, no grad, a per-step seed (a resumed run samples the same).
    tic = time.perf_counter()
    run.optimizer.zero_grad(set_to_none=True)  # the last step's gradients: not held meanwhile
    # Every rank draws the same global prompts and keeps its slice of whole groups.
    d = run.dist
    drawn = run.task.sample(t.prompts_per_step, run.data_gen)
    examples = drawn[dist_module.rank_slice(len(drawn), d)]
    seed = cfg.seed * 1_000_003 + step
    if d.on and t.rollout_split == "replicated":
        rollout = run.engine.generate([e.prompt for e in drawn], G, cfg.rollout.sampling(seed))
        rollout = slice_rollout(rollout, dist_module.rank_slice(rollout.batch_size, d))
    else:
        seed += 7_654_321 * d.rank  # rank 0 samples what a single process samples
        rollout = run.engine.generate([e.prompt for e in examples], G, cfg.rollout.sampling(seed))
    timings["time/rollout"] = time.perf_counter() - tic

    # 2. Rewards and group advantages.
    tic = time.perf_counter()
    scores = score(rollout, examples, run.rewards)
    rewards = scores.total  # [B]
    per_sample = [e for e in examples for _ in range(G)]
    is_correct = correct(rollout.completions, per_sample, run.accuracy)  # [B] bool
    # Advantages over the global batch ("batch" scaling needs every rank's rewards).
    all_rewards = dist_module.all_gather_cat(rewards, d)  # [B_global]
    advantages = C.group_advantages(all_rewards, G, scale=t.scale_rewards, eps=t.advantage_eps)
    adv_group_sum = float(advantages.view(-1, G).sum(dim=1).abs().max())  # monitored: ~0
    advantages = advantages[dist_module.rank_slice(len(advantages), d)]  # [B]
    timings["time/score"] = time.perf_counter() - tic

    dev = run.device
    input_ids = rollout.input_ids.to(dev)  # [B, T]
    attention_mask = rollout.attention_mask.to(dev)  # [B, T]
    completion_mask = rollout.completion_mask.to(dev)  # [B, T]
    advantages = advantages.to(dev)
    B = input_ids.shape[0]
    mini = t.mini_batch_size // d.world if t.mini_batch_size else B  # this rank's share
    micro = mini // t.gradient_accumulation_steps
    on_policy = is_on_policy(cfg)

    # 3. Old and reference log-probs, before any update.
    tic = time.perf_counter()
    logp_old = None  # [B, T-1]
    if t.logprob_source == "engine":
        if rollout.engine_logprobs is None:
            raise ValueError("trainer.logprob_source=engine but the engine returned no log-probs")
        logp_old = rollout.engine_logprobs.to(dev)
    elif not on_policy:
        with autocast(t.autocast, dev):  # the same precision as the loss forward: ratio 1
            logp_old = batched_logprobs(
                C, model, input_ids, attention_mask, completion_mask, micro, temperature
            )
    logp_ref = None  # [B, T-1]
    if t.beta > 0:
        with autocast(t.autocast, dev):
            logp_ref = reference_logprobs(
                run, input_ids, attention_mask, completion_mask, micro, temperature
            )
    timings["time/logprobs"] = time.perf_counter() - tic

    # 4. Inner epochs over minibatches; one optimizer step per minibatch.
    tic = time.perf_counter()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    weight_total = 0.0
    norms, unit_losses, skipped, nonfinite_what = [], [], 0, None
    perm_gen = torch.Generator().manual_seed(cfg.seed * 7_919 + step + 104_729 * d.rank)
    engine_logprobs = None if rollout.engine_logprobs is None else rollout.engine_logprobs.to(dev)
    ratio_dev, engine_gap = 0.0, None  # measured before this step's first update
    tis = {"capped": 0.0, "weight": 0.0, "tokens": 0.0}
    for epoch in range(t.num_iterations):
        order = torch.randperm(B, generator=perm_gen) if mini < B else torch.arange(B)
        for start in range(0, B, mini):
            unit = order[start : start + mini]
            unit_mask = completion_mask[unit, 1:]  # [mini, T-1]
            run.optimizer.zero_grad(set_to_none=True)
            unit_loss, bad = 0.0, None
            # The normaliser is global: the same count on every rank, so the ranks' summed
            # gradients are the single-process gradient of the global unit.
            unit_total = dist_module.all_sum(unit_count(t.loss_type, unit_mask), d)
            for m_start in range(0, mini, micro):
                # Ascending rows keep a group's samples adjacent (one prompt forward each).
                idx = unit[m_start : m_start + micro].sort().values
                with autocast(t.autocast, dev):  # the forward only; backward outside
                    logp, mask = C.sequence_logprobs(
                        model,
                        input_ids[idx],
                        attention_mask[idx],
                        completion_mask[idx],
                        temperature,
                    )  # [b, T-1], float32 whatever the matmul precision
                old = logp.detach() if logp_old is None else logp_old[idx]
                ref = None if logp_ref is None else logp_ref[idx]
                weights = None  # [b, T-1] truncated importance weights, engine -> trainer
                if t.tis_cap is not None:
                    if engine_logprobs is None:
                        raise ValueError(
                            "trainer.tis_cap needs the engine's log-probs; this engine returned "
                            "none (vLLM with top_k / top_p)"
                        )
                    weights = core_module.tis_weights(old, engine_logprobs[idx], mask, t.tis_cap)
                    tis["capped"] += float(((weights >= t.tis_cap) * mask).sum())
                    tis["weight"] += float((weights * mask).sum())
                    tis["tokens"] += float(mask.sum())
                if epoch == 0 and start == 0:  # the policy that sampled, not yet updated
                    ratio_dev = max(
                        ratio_dev, masked_max_abs(torch.exp(logp.detach() - old) - 1, mask)
                    )
                    if engine_logprobs is not None:
                        gap = masked_max_abs(engine_logprobs[idx] - logp.detach(), mask)
                        engine_gap = max(engine_gap or 0.0, gap)
                loss, m = C.grpo_loss(
                    logp,
                    old,
                    ref,
                    advantages[idx],
                    mask,
                    eps_low=t.epsilon,
                    eps_high=t.epsilon_high,
                    beta=t.beta,
                    loss_agg=t.loss_type,
                    max_completion_length=cfg.rollout.max_completion_length,
                    **({} if weights is None else {"token_weights": weights}),
                )
                given_old = None if logp_old is None else old  # on-policy: old is logp itself
                bad = bad or first_nonfinite(
                    {"logp_old": given_old, "logp_ref": ref, "logp_new": logp.detach()}, mask
                )
                bad = bad or first_nonfinite({"loss": loss.detach()})
                share = loss * loss_scale(t.loss_type, mask, unit_mask, unit_total)
                if run.reducer is not None and m_start + micro >= mini:  # the unit's last
                    run.reducer.arm()
                (share * dist_module.loss_multiplier(d)).backward()
                unit_loss += float(share.detach())
                w = float(mask.sum())
                weight_total += w
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * w
            if run.reducer is not None:
                run.reducer.wait()
            norm = dist_module.grad_norm(params, d) if d.on else grad_norm(params)
            bad = bad or first_nonfinite({"gradient": norm})
            if d.on and dist_module.any_rank(bad is not None, d):
                bad = bad or "a non-finite value on another rank"
            if bad is None and t.max_grad_norm > 0:
                if d.on:
                    dist_module.clip_gradients(params, norm, t.max_grad_norm)
                else:
                    torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
            if bad is not None:
                # The non-finite guard: nothing reaches the weights or the optimizer moments.
                run.optimizer.zero_grad(set_to_none=True)
                skipped += 1
                nonfinite_what = nonfinite_what or bad
            else:
                run.optimizer.step()
                run.scheduler.step()  # the schedule counts applied updates
                norms.append(float(norm))
            unit_losses.append(dist_module.all_sum(unit_loss, d) if d.on else unit_loss)
    run.engine.sync_weights(model)  # a separate engine (vLLM) samples the next step from these
    timings["time/update"] = time.perf_counter() - tic

    # 5. Metrics (over all ranks: token-weighted sums added, the rest averaged).
    if d.on:
        weight_total = dist_module.all_sum(weight_total, d)
        sums = {k: dist_module.all_sum(v, d) for k, v in sorted(sums.items())}
    metrics: dict[str, Any] = {
        **scores.metrics,  # reward/mean|std, rewards/<fn>/mean, frac_reward_zero_std, lengths
        "accuracy": float(is_correct.float().mean()),
        **{k: v / max(weight_total, 1.0) for k, v in sums.items()},  # token-weighted
        "loss": sum(unit_losses) / len(unit_losses),  # the loss each optimizer step saw
        "grad_norm": sum(norms) / len(norms) if norms else float("nan"),
        "lr": run.scheduler.get_last_lr()[0],
        "skipped": skipped,
        "monitor/ratio_dev": ratio_dev,
        "monitor/adv_group_sum": adv_group_sum,
        **({} if engine_gap is None else {"monitor/engine_gap": engine_gap}),
        **(
            {}
            if t.tis_cap is None
            else {
                "tis/weight_mean": tis["weight"] / max(tis["tokens"], 1.0),
                "tis/capped_frac": tis["capped"] / max(tis["tokens"], 1.0),
            }
        ),
        **timings,
    }
    metrics["time/step"] = sum(timings.values())
    sync_gap = getattr(run.engine, "last_sync_gap", None)  # vLLM: the verified sync's canary gap
    if sync_gap is not None:
        metrics["engine/sync_gap"] = sync_gap
    metrics["tokens_per_s"] = float(attention_mask.sum()) / max(metrics["time/step"], 1e-9)
    if d.on:
        worst = {k: v for k, v in metrics.items() if k.startswith("monitor/")}  # max, not mean
        metrics = dist_module.mean_metrics(metrics, d) | dist_module.max_metrics(worst, d)
        metrics["tokens_per_s"] *= d.world
    batch = {
        "step": step,
        "what": nonfinite_what,
        "input_ids": input_ids.cpu(),
        "attention_mask": attention_mask.cpu(),
        "completion_mask": completion_mask.cpu(),
        "rewards": rewards.cpu(),
        "advantages": advantages.cpu(),
        "logp_old": None if logp_old is None else logp_old.cpu(),
        "logp_ref": None if logp_ref is None else logp_ref.cpu(),
        "prompts": rollout.prompts,
        "completions": rollout.completions,
        "answers": [e.answer for e in examples for _ in range(G)],
    }
    return metrics, batch


def autocast(mode: str, device: torch.device):
    """bf16 matmuls for the model's forwards (weights and optimizer stay in the model dtype),
    or nothing."""
    if mode == "off":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def masked_max_abs(values: torch.Tensor, mask: torch.Tensor) -> float:
    """max |values| over the positions where mask is set (0 when none is)."""
    picked = values[mask.bool()]
    return float(picked.abs().max()) if picked.numel() else 0.0


def slice_rollout(r: Rollout, rows: slice) -> Rollout:
    """The rows `rows` of a rollout (whole groups), every per-sample field cut alike."""
    return dataclasses.replace(
        r,
        input_ids=r.input_ids[rows],
        attention_mask=r.attention_mask[rows],
        completion_mask=r.completion_mask[rows],
        group_ids=r.group_ids[rows] - r.group_ids[rows][0],
        prompts=r.prompts[rows],
        completions=r.completions[rows],
        truncated=r.truncated[rows],
        engine_logprobs=None if r.engine_logprobs is None else r.engine_logprobs[rows],
    )


@torch.no_grad()
def batched_logprobs(C, model, input_ids, attention_mask, completion_mask, chunk, temperature):
    """Log-probs of the whole batch in chunks of `chunk` rows, no grad: [B, T-1]."""
    out = []
    for s in range(0, input_ids.shape[0], chunk):
        logp, _ = C.sequence_logprobs(
            model,
            input_ids[s : s + chunk],
            attention_mask[s : s + chunk],
            completion_mask[s : s + chunk],
            temperature,
        )
        out.append(logp)
    return torch.cat(out)


def reference_logprobs(run: Run, input_ids, attention_mask, completion_mask, chunk, temperature):
    """Log-probs under the reference policy: the frozen copy, or under LoRA the same model with
    its adapters disabled (the base weights never change): [B, T-1]."""
    args = (input_ids, attention_mask, completion_mask, chunk, temperature)
    if run.ref_model is not None:
        return batched_logprobs(run.core, run.ref_model, *args)
    with run.model.disable_adapter():
        return batched_logprobs(run.core, run.model, *args)


def is_lora(model: torch.nn.Module) -> bool:
    """A peft model (checked without importing peft, an optional dependency)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def wrap_lora(model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    """`model` with LoRA adapters on trainer.lora_target_modules; only they are trainable."""
    t = cfg.trainer
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ImportError(
            f"trainer.lora_r={t.lora_r} needs peft: pip install 'grpolab[lora]'"
        ) from e
    lora = LoraConfig(
        r=t.lora_r,
        lora_alpha=t.lora_alpha,
        lora_dropout=t.lora_dropout,
        target_modules=list(t.lora_target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def load_lora_adapter(model: torch.nn.Module, checkpoint_dir: Path) -> None:
    """Restore the adapter weights a LoRA checkpoint holds in adapter/."""
    from peft import load_peft_weights, set_peft_model_state_dict

    adapter = checkpoint_dir / ADAPTER_DIR
    if not adapter.is_dir():
        raise ValueError(
            f"--resume {str(checkpoint_dir)!r}: no {ADAPTER_DIR}/ there (a full fine-tuning "
            "checkpoint); resume it with trainer.lora_r=0"
        )
    result = set_peft_model_state_dict(model, load_peft_weights(str(adapter)))
    if result.unexpected_keys:
        raise ValueError(
            f"--resume {str(checkpoint_dir)!r}: its adapter does not match trainer.lora_* "
            f"(unexpected {result.unexpected_keys[:3]})"
        )


# --- The run: setup, loop, checkpoints, summary ----------------------------------------------


def prepare_output_dir(output_dir: Path, resume: bool, overwrite: bool) -> None:
    holds_run = output_dir.is_dir() and (
        any((output_dir / f).exists() for f in RUN_FILES)
        or any(p.name.startswith("checkpoint-") for p in output_dir.iterdir())
    )
    if holds_run and not resume and not overwrite:
        raise FileExistsError(
            f"output_dir={str(output_dir)!r} holds another run; pass --resume to continue it, "
            "--overwrite to replace it, or choose another output_dir"
        )
    if holds_run and overwrite and not resume:
        for p in output_dir.iterdir():
            ours = p.name in (*RUN_FILES, "tensorboard", "nonfinite-capsule.pt")
            if ours or p.name.startswith(("checkpoint-", ".tmp-checkpoint-")):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    output_dir.mkdir(parents=True, exist_ok=True)


def load_start_model(cfg: Config, device: torch.device):
    """The model training starts from: a local directory / hub id, or the shipped demo model."""
    source = cfg.model.name_or_path
    if source is None:
        if not (DEMO_MODEL_DIR / "config.json").is_file():
            raise FileNotFoundError(
                f"the built-in demo model is missing at {DEMO_MODEL_DIR}; regenerate it with "
                "`grpolab warmup`"
            )
        source = str(DEMO_MODEL_DIR)
    elif not Path(source).expanduser().exists() and (
        source.startswith((".", "/", "~")) or source.count("/") > 1  # a hub id is "org/name"
    ):
        raise FileNotFoundError(f"model.name_or_path={source!r} does not exist")
    m = cfg.model
    return load_policy(source, m.dtype, device, gguf_file=m.gguf_file, cache_dir=m.cache_dir)


def wide_console() -> Console:
    """A console that does not wrap the per-step lines at 80 columns in a log or a pipe."""
    console = Console()
    if not console.is_terminal:
        console.width = 160
    return console


def check_core_supports(core: CoreFns, cfg: Config) -> None:
    """Options that need more than the seed's signatures from a user's core functions."""
    if cfg.trainer.tis_cap is not None:
        params = inspect.signature(core.grpo_loss).parameters
        if "token_weights" not in params:
            source = core.source.get("grpo_loss", "grpolab")
            raise ValueError(
                f"trainer.tis_cap={cfg.trainer.tis_cap} needs a grpo_loss that takes "
                f"token_weights; the one from {source} does not"
            )


def task_engine(cfg: Config, model: torch.nn.Module, tokenizer):
    """The configured rollout engine, with the task's chat template and system prompt."""
    return build_engine(
        cfg.rollout,
        model,
        tokenizer,
        chat_template=cfg.task.chat_template,
        system_prompt=cfg.task.system_prompt,
    )


def make_run(
    cfg: Config,
    model: torch.nn.Module,
    tokenizer,
    device: torch.device | None = None,
    core: CoreFns | None = None,
    dist: Dist | None = None,
) -> Run:
    """Task, rewards, engine, reference copy, optimizer and LR schedule around `model`;
    under data parallel the model is sharded (fsdp) or made equal on every rank (ddp) first."""
    t = cfg.trainer
    core = core or default_core(t.logprobs, t.shared_prefix)
    check_core_supports(core, cfg)
    d = dist or Dist()
    if d.on:
        validate_world(cfg, d.world)
    ref_model = None
    if t.lora_r > 0:  # the reference is this model with its adapters disabled: no copy
        model = wrap_lora(model, cfg)
    elif t.beta > 0:  # a frozen copy of the starting weights
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    if t.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if t.torch_compile:  # before sharding: fully_shard wraps the compiled layers
        compile_decoder_layers(model)
    if d.on and d.mode == "fsdp":
        model = dist_module.shard(model)
        if ref_model is not None:
            ref_model = dist_module.shard(ref_model)
    elif d.on:
        dist_module.broadcast_parameters(model)
    steps_per_batch = t.num_iterations * (cfg.batch_size // (t.mini_batch_size or cfg.batch_size))
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    optimizer = torch.optim.AdamW(
        trained,
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        weight_decay=t.weight_decay,
        fused=fused_adamw_ok(trained) or None,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(t.lr_scheduler, t.warmup_steps, cfg.max_steps * steps_per_batch)
    )
    engine = task_engine(cfg, model, tokenizer)
    return Run(
        cfg=cfg,
        model=model,
        tokenizer=tokenizer,
        ref_model=ref_model,
        engine=engine,
        task=load_task(cfg.task),
        rewards=load_rewards(
            cfg.rewards, task=cfg.task, max_completion_length=cfg.rollout.max_completion_length
        ),
        accuracy=accuracy_rewards(cfg.rewards, cfg.task),
        optimizer=optimizer,
        scheduler=scheduler,
        data_gen=torch.Generator().manual_seed(cfg.seed),
        core=core,
        device=device or next(model.parameters()).device,
        dist=d,
        reducer=(
            dist_module.GradientReducer(trained, t.ddp_bucket_mb)
            if d.on and d.mode == "ddp"
            else None
        ),
    )


def train(
    cfg: Config,
    resume: str | bool | None = None,
    overwrite: bool = False,
    core: CoreFns | None = None,
    console: Console | None = None,
    skip_preflight: bool = False,
) -> dict[str, Any]:
    """Run GRPO as configured; returns the summary (also written to summary.json).

    The preflight checks run first, on this model and a real batch, and training refuses to
    start if one fails (PreflightFailed) unless `skip_preflight`."""
    console = console or wide_console()
    t = cfg.trainer
    wall_start = time.time()
    transformers.utils.logging.disable_progress_bar()
    limit_heap_retention()
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    device = dist_module.local_device(resolve_device(cfg.model.device))
    # Under torchrun: one process per rank; only rank 0 writes the run directory (the others
    # write their logs to a scratch directory), and every rank runs the same loop.
    d = dist_module.init(t.distributed, device)
    if not d.main:
        console = Console(quiet=True)
    cfg.output_dir = cfg.output_dir.replace("{time}", time.strftime("%Y%m%d-%H%M%S"))
    if d.on:  # every rank names rank 0's directory ({time} may differ between processes)
        cfg.output_dir = dist_module.all_gather_objects(cfg.output_dir, d)[0]
    output_dir = run_dir = Path(cfg.output_dir)
    if d.main:
        prepare_output_dir(output_dir, bool(resume), overwrite)
    dist_module.barrier(d)

    resume_dir: Path | None = None
    if resume:
        resume_dir = latest_checkpoint(output_dir) if resume is True else Path(resume)
        if resume_dir is None:
            raise FileNotFoundError(f"--resume: no checkpoint in output_dir={str(output_dir)!r}")
        if not resume_dir.is_dir():
            raise FileNotFoundError(f"--resume {str(resume_dir)!r}: no such checkpoint directory")

    torch.manual_seed(cfg.seed)
    model, tokenizer = load_start_model(cfg, device)
    run = make_run(cfg, model, tokenizer, device, core, d)
    model = run.model  # sharded or LoRA-wrapped
    start_step, state = 0, {}
    if resume_dir is not None:
        check_same_model(model, resume_dir)
        saved, _, extra, state = load_checkpoint(resume_dir, cfg.model.dtype, str(device))
        if is_lora(model):  # the base weights are the start model's; saved holds them merged
            load_lora_adapter(model, resume_dir)
        elif (resume_dir / ADAPTER_DIR).is_dir():
            raise ValueError(
                f"--resume {str(resume_dir)!r}: a LoRA checkpoint; resume it with the "
                "trainer.lora_* settings it was trained with"
            )
        elif dist_module.is_sharded(model):
            dist_module.load_full_model_state(model, saved.state_dict())
        else:
            model.load_state_dict(saved.state_dict())
        del saved
        if dist_module.is_named_optimizer_state(extra["optimizer"]):  # saved by a multi-rank run
            dist_module.load_full_optimizer_state(model, run.optimizer, extra["optimizer"])
        elif dist_module.is_sharded(model):
            raise ValueError(
                f"--resume {str(resume_dir)!r}: a single-process checkpoint resumes under "
                "trainer.distributed=ddp, not fsdp"
            )
        else:
            run.optimizer.load_state_dict(extra["optimizer"])
        run.scheduler.load_state_dict(extra["scheduler"])
        run.data_gen.set_state(extra["data_generator"])
        set_rng_state(extra["rng"])
        start_step = state["step"]
        run.skipped_steps = state.get("skipped_steps", 0)
        run.consecutive_nonfinite = state.get("consecutive_nonfinite", 0)
        run.engine.sync_weights(model)
        console.print(f"resuming from {resume_dir} at step {start_step}")
    optimizer, scheduler, data_gen, task = run.optimizer, run.scheduler, run.data_gen, run.task
    engine, accuracy = run.engine, run.accuracy
    if not d.main:
        output_dir = Path(tempfile.mkdtemp(prefix=f"grpolab-rank{d.rank}-"))

    card = core_module.objective_card(objective_fields(cfg))
    if is_on_policy(cfg):
        card += (
            "\n  (one optimizer step per batch: logp_old is the loss forward's own detached"
            " log-probs, exact, no extra pass)"
        )
    (output_dir / "config.yaml").write_text(to_yaml(cfg))
    (output_dir / "objective.txt").write_text(card + "\n")
    console.print("[bold]Resolved config[/bold]\n" + to_yaml(cfg))
    console.print(card)
    sharded = dist_module.is_sharded(model)
    if sharded and not skip_preflight:  # its probes deep-copy the model, which FSDP2 refuses
        console.print(
            "preflight: not run under trainer.distributed=fsdp; `grpolab preflight` with this "
            "config checks the same quantities on one process"
        )
    preflight_gate(run, output_dir, console, skip=skip_preflight or sharded)
    release_freed_memory()  # the preflight's copies and full-vocabulary logits
    tracker = Tracker(output_dir, t.report_to, to_dict(cfg), console, resume_step=start_step)

    def evaluate(label: str) -> float | None:
        if t.eval_examples == 0 or not task.eval:
            return None
        tic = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)  # the last step's gradients: not held meanwhile
        acc = evaluate_accuracy(
            engine,
            task.eval[: t.eval_examples],
            accuracy,
            t.eval_max_completion_length or cfg.rollout.max_completion_length,
            batch_size=cfg.batch_size,  # no larger a KV cache than a training rollout's
        )
        console.print(
            f"held-out accuracy {label}: [bold]{acc:.1f}%[/bold] "
            f"({min(t.eval_examples, len(task.eval))} problems, greedy, "
            f"{time.perf_counter() - tic:.1f} s)"
        )
        return acc

    prior_wall = state.get("wall_seconds", 0.0)
    accuracy_before = state.get("accuracy_before") if resume_dir else evaluate("before GRPO")
    history = state.get("eval_history", [])

    def save(step: int) -> Path:
        # Multi-rank: whole tensors keyed by name (collectives on every rank), so the
        # checkpoint loads at any world size; rank 0 writes it.
        weights = dist_module.full_state_dict(model) if dist_module.is_sharded(model) else None
        extra = {
            "optimizer": (
                dist_module.full_optimizer_state(model, optimizer)
                if d.on
                else optimizer.state_dict()
            ),
            "scheduler": scheduler.state_dict(),
            "data_generator": data_gen.get_state(),
            "rng": rng_state(),
        }
        info = {
            "skipped_steps": run.skipped_steps,
            "consecutive_nonfinite": run.consecutive_nonfinite,
            "accuracy_before": accuracy_before,
            "eval_history": history,
            "wall_seconds": prior_wall + time.time() - wall_start,
        }
        path = run_dir / f"checkpoint-{step}"
        if d.main:
            plain = model if weights is None else unsharded_copy(model, weights)
            path = save_checkpoint(run_dir, step, plain, tokenizer, extra, info, t.save_total_limit)
        dist_module.barrier(d)
        return path

    limits = limits_for(t, cfg.model.dtype)
    scheme_a = t.logprob_source == "trainer"
    step = start_step
    with progress_bar(console, t.progress) as bar:
        task_id = bar.add_task("grpo", total=cfg.max_steps, completed=start_step, info="")
        for step in range(start_step + 1, cfg.max_steps + 1):
            metrics, batch = grpo_step(run, step)
            if metrics["skipped"]:
                run.skipped_steps += 1
                run.consecutive_nonfinite += 1
            else:
                run.consecutive_nonfinite = 0
            metrics["skipped_steps"] = run.skipped_steps
            warnings = (
                []
                if t.monitor == "off"
                else check_step(step, metrics | {"nonfinite": batch["what"]}, limits, scheme_a)
            )
            if warnings:
                metrics["warnings"] = warnings
                for w in warnings:
                    bar.console.print(f"[yellow]monitor:[/yellow] {escape(w)}")
            if t.eval_steps and step % t.eval_steps == 0 and step < cfg.max_steps:
                metrics["eval_accuracy"] = evaluate(f"at step {step}")
                history.append([step, metrics["eval_accuracy"]])
            tracker.log(step, metrics)
            if t.log_completions_steps and (step == 1 or step % t.log_completions_steps == 0):
                n = t.log_completions_count
                tracker.log_completions(step, sample_rows(batch, n))
            line = tracker.console_line(step, cfg.max_steps, metrics)
            bar.update(task_id, completed=step, info=f"reward {metrics['reward/mean']:.3f}")
            if step == start_step + 1 or step % 10 == 0 or metrics["skipped"]:
                bar.console.print(line)
            if warnings and t.monitor == "stop":
                path = save(step)
                tracker.close()
                raise MonitorStop(
                    f"stopped at step {step} (trainer.monitor=stop): {warnings[0]}; "
                    f"checkpoint {path}"
                )
            if run.consecutive_nonfinite >= t.max_consecutive_nonfinite:
                path = save(step)
                capsule = output_dir / "nonfinite-capsule.pt"
                if batch["logp_old"] is None:  # on-policy: the weights are still the sampler's
                    batch["logp_old"] = batched_logprobs(
                        run.core,
                        model,
                        batch["input_ids"].to(device),
                        batch["attention_mask"].to(device),
                        batch["completion_mask"].to(device),
                        cfg.batch_size // t.gradient_accumulation_steps,
                        cfg.rollout.temperature,
                    ).cpu()
                torch.save(
                    {**batch, "rng": rng_state(), "data_generator": data_gen.get_state()}, capsule
                )
                tracker.close()
                raise NonFiniteError(
                    f"stopped at step {step}: {run.consecutive_nonfinite} consecutive steps with "
                    f"a non-finite value, first {batch['what']}; weights unchanged since the "
                    f"last good step, saved to {path}; replay capsule {capsule}"
                )
            if t.save_steps and step % t.save_steps == 0 and step < cfg.max_steps:
                save(step)

    checkpoint = (
        save(cfg.max_steps) if cfg.max_steps > start_step or resume_dir is None else resume_dir
    )
    accuracy_after = evaluate("after GRPO")
    tracker.close()
    summary = {
        "accuracy_before": accuracy_before,
        "accuracy_after": accuracy_after,
        "accuracy_gain": (
            None
            if accuracy_before is None or accuracy_after is None
            else accuracy_after - accuracy_before
        ),
        "steps": step,
        "skipped_steps": run.skipped_steps,
        "eval_history": history,
        "wall_seconds": prior_wall + time.time() - wall_start,
        "checkpoint": str(checkpoint),
        "eval_examples": min(t.eval_examples, len(task.eval)),
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    close_engine = getattr(run.engine, "close", None)
    if callable(close_engine):  # vLLM tears its process groups down: before the trainer's
        close_engine()
    if d.on:
        dist_module.shutdown()
    if accuracy_before is not None and accuracy_after is not None:
        console.print(
            f"[bold]held-out accuracy: {accuracy_before:.1f}% before GRPO -> "
            f"{accuracy_after:.1f}% after {step} steps "
            f"({accuracy_after - accuracy_before:+.1f} points)[/bold] in "
            f"{summary['wall_seconds']:.0f} s; run directory {output_dir}"
        )
    return summary


def unsharded_copy(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain transformers model holding `weights` (a sharded model's full state dict)."""
    plain = transformers.AutoModelForCausalLM.from_config(model.config, dtype=model.dtype)
    plain.load_state_dict(weights)
    plain.generation_config = model.generation_config
    return plain


def sample_rows(batch: dict[str, Any], n: int) -> list[dict[str, Any]]:
    rows = []
    G = max(1, len(batch["prompts"]) // max(1, n))  # spread over groups
    for i in range(0, min(n * G, len(batch["prompts"])), G):
        rows.append(
            {
                "prompt": batch["prompts"][i],
                "completion": batch["completions"][i],
                "answer": batch["answers"][i],
                "reward": float(batch["rewards"][i]),
                "advantage": float(batch["advantages"][i]),
            }
        )
    return rows


def run_eval(
    cfg: Config,
    examples: int | None = None,
    pass_at_k: int | None = None,
    samples: int | None = None,
    temperature: float = 1.0,
    console: Console | None = None,
) -> dict[str, float]:
    """`grpolab eval`: greedy accuracy (and pass@k) of cfg.model on cfg.task's held-out set."""
    console = console or wide_console()
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    device = resolve_device(cfg.model.device)
    model, tokenizer = load_start_model(cfg, device)
    task = load_task(cfg.task)
    held_out = task.eval[:examples] if examples else task.eval
    if not held_out:
        raise ValueError(f"task {cfg.task.name!r} has no held-out examples (task.num_eval)")
    engine = task_engine(cfg, model, tokenizer)
    accuracy = accuracy_rewards(cfg.rewards, cfg.task)
    length = cfg.trainer.eval_max_completion_length or cfg.rollout.max_completion_length
    result = {"accuracy": evaluate_accuracy(engine, held_out, accuracy, length)}
    console.print(f"accuracy (greedy): {result['accuracy']:.1f}% on {len(held_out)} problems")
    if pass_at_k:
        key = f"pass@{pass_at_k}"
        result[key] = evaluate_pass_at_k(
            engine, held_out, accuracy, length, pass_at_k, samples, temperature, cfg.seed
        )
        n = samples or pass_at_k
        console.print(f"{key}: {result[key]:.1f}% ({n} samples per problem, T={temperature:g})")
    return result
