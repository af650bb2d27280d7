"""`grpolab preflight`: the checks of grpolab.checks on the configured model, task and engine.

A real rollout batch from the configured task is sampled (a few groups), scored by the
configured rewards, and every check runs on it, plus the checks that need the trainer:
gradient invariance to the minibatch split and a worst-case-length dry run.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from grpolab import checks
from grpolab.checks import CheckResult, CoreImpl, PreflightBatch, PreflightSettings
from grpolab.config import Config
from grpolab.jsonout import print_json
from grpolab.memory import (
    MB,
    MemoryBreakdown,
    adamw_state_mb,
    kv_cache_mb,
    peak_memory,
    release_freed_memory,
    rss_mb,
    tensor_mb,
    total_memory_mb,
)
from grpolab.models import base_model
from grpolab.monitors import limits_for

PREFLIGHT_ROWS = 32  # sequences in the preflight batch (whole groups, at least two)


def settings_from_config(cfg: Config) -> PreflightSettings:
    t = cfg.trainer
    return PreflightSettings(
        temperature=cfg.rollout.temperature or 1.0,
        loss_agg=t.loss_type,
        eps_low=t.epsilon,
        eps_high=t.epsilon_high,
        beta=t.beta,
        scale_rewards=t.scale_rewards,
        advantage_eps=t.advantage_eps,
        max_completion_length=cfg.rollout.max_completion_length,
        engine_gap_max=limits_for(t, cfg.model.dtype).engine_gap,
        seed=cfg.seed,
        shared_prefix=t.shared_prefix,
        grad_rows=micro_batch_rows(cfg),
    )


def micro_batch_rows(cfg: Config) -> int:
    """Rows of one forward + backward of the trainer (a micro-batch)."""
    t = cfg.trainer
    return (t.mini_batch_size or cfg.batch_size) // t.gradient_accumulation_steps


def sample_batch(run, cfg: Config) -> tuple[PreflightBatch, list[str]]:
    """A few real groups from the configured task, sampled and scored as the trainer does.
    Uses its own generator, so the training run's data order is untouched."""
    from grpolab.rewards import score

    G = cfg.trainer.num_generations
    n_prompts = max(2, PREFLIGHT_ROWS // G)
    examples = run.task.sample(n_prompts, torch.Generator().manual_seed(cfg.seed + 12_345))
    params = cfg.rollout.sampling(seed=cfg.seed + 54_321)
    rollout = run.engine.generate([e.prompt for e in examples], G, params)
    rewards = score(rollout, examples, run.rewards).total
    device = next(run.model.parameters()).device
    batch = PreflightBatch(
        rollout.input_ids.to(device),
        rollout.attention_mask.to(device),
        rollout.completion_mask.to(device),
        rewards.float(),
        G,
        None if rollout.engine_logprobs is None else rollout.engine_logprobs.to(device),
    )
    return batch, rollout.completions


def check_split_invariance(impl: CoreImpl, model, batch: PreflightBatch, s: PreflightSettings):
    """The gradient of the batch in one pass equals the gradient accumulated over micro-batches
    with the trainer's loss scaling (the wrong normaliser under accumulation shows here)."""
    from grpolab.trainer import loss_scale

    batch = checks.grad_rows(batch, s)
    B = batch.input_ids.shape[0]
    advantages = torch.tensor([1.0, -0.5] * (B // 2) + [1.0] * (B % 2))
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask, s.temperature)
    L = s.max_completion_length or batch.input_ids.shape[1]

    def loss_of(rows: torch.Tensor) -> torch.Tensor:
        logp, mask = impl.sequence_logprobs(model, *(a[rows] for a in args[:3]), s.temperature)
        loss, _ = impl.grpo_loss(
            logp, logp.detach() + 0.05, None, advantages[rows], mask, eps_low=s.eps_low,
            eps_high=s.eps_high, beta=0.0, loss_agg=s.loss_agg, max_completion_length=L,
        )  # fmt: skip
        return loss

    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    loss_of(torch.arange(B)).backward()
    whole = [p.grad.detach().clone() for p in params]
    model.zero_grad(set_to_none=True)
    unit_mask = batch.completion_mask[:, 1:]
    lengths = unit_mask.sum(1)
    # Uneven micro-batches: the longest sequences alone, then the rest in two parts.
    order = torch.argsort(lengths, descending=True)
    parts = [order[: max(1, B // 4)], order[max(1, B // 4) : B // 2], order[B // 2 :]]
    for rows in parts:
        if len(rows):
            micro_mask = unit_mask[rows]
            (loss_of(rows) * loss_scale(s.loss_agg, micro_mask, unit_mask)).backward()
    split = [p.grad for p in params]
    scale = max(float(g.abs().max()) for g in whole) or 1.0
    gap = max(float((a - b).abs().max()) for a, b in zip(whole, split, strict=True)) / scale
    del split
    model.zero_grad(set_to_none=True)
    yield CheckResult(
        "split.gradient_invariance",
        0,
        "max |grad(one pass) - grad(3 uneven micro-batches)| / max |grad|",
        gap,
        "<= 1e-4",
        gap <= 1e-4,
        "the loss of each micro-batch must be scaled by its share of the whole batch's "
        "normaliser (tokens for token-mean, sequences for sequence-mean)",
    )


def check_fused_logprobs(model, batch: PreflightBatch, s: PreflightSettings):
    """The trainer's memory-efficient log-probs against the seed's code on this model:
    values and the gradient reaching the model's parameters."""
    from grpolab import core
    from grpolab.logprobs import shared_prefix_status, split_model, token_logprobs

    batch = checks.grad_rows(batch, s)
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask, s.temperature)
    valid = batch.completion_mask[:, 1:].bool()
    params = [p for p in model.parameters() if p.requires_grad]

    def values_and_grads(fn):
        model.zero_grad(set_to_none=True)
        logp, mask = fn(model, *args)
        (logp * mask).sum().backward()
        grads = [p.grad.detach().clone() for p in params if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return logp.detach(), grads

    def trainers(model, *args):
        return token_logprobs(model, *args, shared_prefix=s.shared_prefix)

    fused, fused_grads = values_and_grads(trainers)
    naive, naive_grads = values_and_grads(core.sequence_logprobs)
    gap = _max_gap(fused[valid], naive[valid])
    scale = max((float(g.abs().max()) for g in naive_grads), default=1.0) or 1.0
    grad_gap = max(
        (_max_gap(a, b) for a, b in zip(fused_grads, naive_grads, strict=True)), default=0.0
    )
    grad_gap /= scale
    reason = split_model(model).reason
    path = "fused" if reason is None else f"naive fallback ({reason})"
    if reason is None and s.shared_prefix:
        why_not = shared_prefix_status(model, *args[:3])
        path += ", one forward per prompt" if why_not is None else f", one per row ({why_not})"
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 2e-2
    yield CheckResult(
        "logprobs.fused_vs_naive",
        0,
        f"{path}: max |logp gap| (relative grad gap {grad_gap:.1e})",
        gap,
        f"<= {tol:g}",
        gap <= tol and grad_gap <= tol,
        "the chunked lm-head path disagrees with the seed's log-softmax on this model: set "
        "trainer.logprobs=naive and report the model",
    )


def _max_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def check_worst_case_memory(impl: CoreImpl, run, cfg: Config, prompt_tokens: int):
    """Forward + backward of one micro-batch at the longest prompt + max_completion_length
    (each group's G rows sharing their prompt, as a rollout's do), measured; then the peak of
    a training step predicted from it and from what the run holds (`MemoryBreakdown`)."""
    t = cfg.trainer
    model = run.model
    G = t.num_generations
    rows = micro_batch_rows(cfg)
    L = cfg.rollout.max_completion_length
    T = prompt_tokens + L
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (-(-rows // G), prompt_tokens), generator=gen)
    completions = torch.randint(0, vocab, (rows, L), generator=gen)
    input_ids = torch.cat([prompts.repeat_interleave(G, dim=0)[:rows], completions], dim=1)
    input_ids = input_ids.to(device)  # [rows, T]
    attention_mask = torch.ones_like(input_ids)
    completion_mask = torch.zeros_like(input_ids)
    completion_mask[:, prompt_tokens:] = 1
    model.zero_grad(set_to_none=True)
    model.train()  # as the trainer runs it: gradient checkpointing and dropout on
    tic = time.perf_counter()
    with peak_memory(device) as probe:
        logp, mask = impl.sequence_logprobs(
            model, input_ids, attention_mask, completion_mask, cfg.rollout.temperature or 1.0
        )
        loss, _ = impl.grpo_loss(
            logp, logp.detach(), None, torch.ones(rows, device=device), mask,
            loss_agg=t.loss_type, max_completion_length=L,
        )  # fmt: skip
        loss.backward()
        del logp, mask, loss
    seconds = time.perf_counter() - tic
    model.zero_grad(set_to_none=True)
    breakdown = memory_breakdown(run, cfg, T, probe["growth"])
    cuda = device.type == "cuda"
    limit = torch.cuda.get_device_properties(device).total_memory / MB if cuda else None
    limit = limit or total_memory_mb()
    peak_so_far = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    where = "GPU memory" if cuda else "process RSS"
    yield CheckResult(
        "memory.worst_case",
        0,
        f"predicted peak {where} of a step (MB) = {breakdown.describe()}; measured on "
        f"{rows} x {T} tokens fwd+bwd ({seconds:.1f} s)"
        + ("" if cuda else f"; process peak so far {peak_so_far:.0f}"),
        round(breakdown.peak, 1),
        "fits" if limit is None else f"<= {limit:.0f} MB (this machine)",
        limit is None or breakdown.peak <= limit,
        checks.HINTS["memory.worst_case"],
    )


def memory_breakdown(run, cfg: Config, tokens: int, probe_growth: float) -> MemoryBreakdown:
    """What a training step of `run` holds at its peak, with the worst-case micro-batch's
    forward + backward measured (`probe_growth` MB above the memory in use before it, which
    includes the gradients it allocated)."""
    model = run.model
    device = next(model.parameters()).device
    weights = tensor_mb([*model.parameters(), *model.buffers()])
    trained = [p for p in model.parameters() if p.requires_grad]
    gradients = tensor_mb(trained)
    reference = 0.0
    if run.ref_model is not None:
        reference = tensor_mb([*run.ref_model.parameters(), *run.ref_model.buffers()])
    if device.type == "cuda":
        runtime = torch.cuda.memory_allocated(device) / MB - weights - reference
    else:
        release_freed_memory()
        runtime = (rss_mb() or 0.0) - weights - reference
    dtype = next(model.parameters()).dtype
    rows = cfg.batch_size
    config = base_model(model).config
    if cfg.rollout.engine == "vllm":
        # Its own copy of the weights and, on CPU, VLLM_CPU_KVCACHE_SPACE GiB of KV cache.
        space = 0.0 if device.type == "cuda" else float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", 1))
        rollout = weights + space * 1024
    else:
        eval_length = cfg.trainer.eval_max_completion_length or cfg.rollout.max_completion_length
        longest = tokens + max(0, eval_length - cfg.rollout.max_completion_length)
        rollout = kv_cache_mb(config, rows, longest, dtype)
    return MemoryBreakdown(
        runtime=max(0.0, runtime),
        weights=weights,
        gradients=gradients,
        optimizer=adamw_state_mb(trained),
        reference=reference,
        activations=max(0.0, probe_growth - gradients),
        rollout=rollout,
    )


def longest_prompt_tokens(run, limit: int = 10_000) -> int:
    from grpolab.rollout.common import encode_prompts

    prompts = [e.prompt for e in run.task.train[:limit]]
    encoded = encode_prompts(
        run.tokenizer,
        prompts,
        run.cfg.rollout.max_completion_length,
        getattr(run.model.config, "max_position_embeddings", None),
        run.cfg.task.chat_template,
        run.cfg.task.system_prompt,
    )
    return max(len(ids) for ids in encoded)


def run_preflight(cfg: Config, impl: CoreImpl | None = None, run=None) -> list[CheckResult]:
    """Every check on the configured model and a real batch. `run`: a trainer Run to reuse."""
    from grpolab.trainer import load_start_model, make_run, resolve_device

    impl = impl or CoreImpl()
    transformers.utils.logging.disable_progress_bar()
    if run is None:
        model, tokenizer = load_start_model(cfg, resolve_device(cfg.model.device))
        run = make_run(cfg, model, tokenizer)
    model = run.model
    s = settings_from_config(cfg)
    batch, _ = sample_batch(run, cfg)
    results = checks.run_checks(model, batch, s, impl)
    was_training = model.training
    model.eval()
    try:
        if cfg.trainer.logprobs == "fused":
            results += checks.guarded(
                impl, ("logprobs.fused_vs_naive",), 0, check_fused_logprobs, model, batch, s
            )
        results += checks.guarded(
            impl, ("split.gradient_invariance",), 0, check_split_invariance, impl, model, batch, s
        )
        if impl.path is None:  # memory of grpolab's own path; a learner's code is not sized
            prompt_tokens = longest_prompt_tokens(run)
            results += checks.guarded(
                impl, ("memory.worst_case",), 0, check_worst_case_memory, impl, run, cfg,
                prompt_tokens,
            )  # fmt: skip
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return results


# --- Showing the results ------------------------------------------------------------------------


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return "0" if value == 0 else f"{value:.3g}"
    return str(value)


def results_table(results: list[CheckResult], title: str = "grpolab preflight") -> Table:
    table = Table(title=title, show_lines=False)
    for col in ("check", "goal", "measured", "value", "expected", "result"):
        table.add_column(col, overflow="fold")
    for r in results:
        verdict = "[green]pass" if r.passed else "[bold red]FAIL"
        table.add_row(r.id, str(r.goal or "-"), r.what, _shown(r.measured), r.expected, verdict)
    return table


def print_results(results: list[CheckResult], console: Console, impl: CoreImpl) -> None:
    replaced = [f for f, src in impl.source.items() if src != "grpolab"]
    title = "grpolab preflight" + (f" of {impl.path} ({', '.join(replaced)})" if impl.path else "")
    console.print(results_table(results, title))
    for r in results:
        if not r.passed:
            detail = escape(f"{r.id}: {r.error or r.what} = {_shown(r.measured)}")
            console.print(f"[red]FAIL[/red] {detail}")
            if r.hint:
                console.print(f"     likely bug: {escape(r.hint)}")
    n_failed = sum(not r.passed for r in results)
    verdict = "[green]all checks pass" if not n_failed else f"[red]{n_failed} check(s) failed"
    console.print(f"{verdict} ({len(results)} checks)")


def results_json(results: list[CheckResult], impl: CoreImpl) -> str:
    return json.dumps(
        {
            "passed": all(r.passed for r in results),
            "impl": impl.path,
            "replaced": [f for f, src in impl.source.items() if src != "grpolab"],
            "checks": [r.to_json() for r in results],
        },
        indent=2,
    )


class PreflightFailed(RuntimeError):
    """A preflight check failed: training does not start."""


SKIP_WARNING = (
    "preflight skipped (--skip-preflight): the intermediate quantities of this run were not "
    "checked before training"
)


def preflight_gate(run, output_dir: Path, console: Console, skip: bool = False) -> None:
    """Run every check on the run's model, core functions and a real batch before step 1;
    write preflight.json; raise PreflightFailed if one fails. The global RNG state is left as
    found, so a resumed run stays bit-exact."""
    if skip:
        console.print(f"[bold yellow]warning:[/bold yellow] {SKIP_WARNING}")
        record = {"skipped": True, "warning": SKIP_WARNING}
        (output_dir / "preflight.json").write_text(json.dumps(record, indent=2) + "\n")
        return
    tic = time.perf_counter()
    device = next(run.model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        results = run_preflight(run.cfg, run.core, run)
    write_results(results, output_dir / "preflight.json", run.core)
    failed = [r for r in results if not r.passed]
    if failed:
        print_results(results, console, run.core)
        ids = ", ".join(r.id for r in failed)
        raise PreflightFailed(
            f"preflight: {len(failed)} of {len(results)} checks failed ({ids}); training did not "
            f"start. Details in {output_dir / 'preflight.json'}; --skip-preflight overrides"
        )
    console.print(
        f"preflight: all {len(results)} checks pass ({time.perf_counter() - tic:.1f} s, "
        f"{output_dir / 'preflight.json'})"
    )


def cmd_preflight(args) -> int:
    """Exit 0 when every check passes, 1 when any fails, 2 on a usage or config error."""
    from grpolab.config import ConfigError, load_config

    console = Console(stderr=args.json)
    if not console.is_terminal:
        console.width = 160  # a log file or a pipe: no reason to wrap at 80
    try:
        cfg = load_config(args.config, args.overrides)
        impl = checks.load_impl(args.impl) if args.impl else CoreImpl()
    except (ConfigError, checks.ImplLoadError, FileNotFoundError, ValueError) as e:
        print(f"grpolab preflight: error: {e}", file=sys.stderr)
        return 2
    try:
        results = run_preflight(cfg, impl)
    except (FileNotFoundError, ValueError) as e:
        print(f"grpolab preflight: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print_json(results_json(results, impl))
    else:
        print_results(results, console, impl)
    return 0 if all(r.passed for r in results) else 1


def add_preflight_parser(sub) -> None:
    p = sub.add_parser(
        "preflight", help="check every intermediate GRPO quantity on the configured model"
    )
    p.add_argument("--config", help="YAML config file (default: the built-in CPU demo)")
    p.add_argument(
        "--impl", help="a Python file defining any of the core functions to check instead"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.set_defaults(func=cmd_preflight)


def write_results(results: list[CheckResult], path: Path, impl: CoreImpl) -> None:
    path.write_text(results_json(results, impl) + "\n")
