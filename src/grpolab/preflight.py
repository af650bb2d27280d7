"""`grpolab preflight`: the checks of grpolab.checks on the configured model, task and engine.

A real rollout batch from the configured task is sampled (a few groups), scored by the
configured rewards, and every check runs on it, plus the checks that need the trainer:
gradient invariance to the minibatch split and a worst-case-length dry run; and the reward
probes: hand-written completions for real task rows scored by the configured rewards.
`preflight_gate` runs them before training starts and refuses to start when one fails.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from grpolab import checks, core, seeds
from grpolab.checks import CheckResult, PreflightBatch, PreflightSettings
from grpolab.config import Config, skips_zero_advantage
from grpolab.core import CoreFunctions
from grpolab.coverage import check_tokenizer_coverage
from grpolab.episode_checks import probe_episodes, run_episode_checks
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
from grpolab.models import base_model, eval_mode
from grpolab.monitors import limits_for
from grpolab.precision import Precision, autocast
from grpolab.rewards import score
from grpolab.rewards.probes import probe_task
from grpolab.rollout.common import encode_prompts
from grpolab.setup import (
    BatchPlan,
    Run,
    build_run,
    load_start_model,
    resolve_device,
    run_precision,
)

PREFLIGHT_ROWS = 32  # sequences in the preflight batch (whole groups, at least two)


def settings_from_config(cfg: Config) -> PreflightSettings:
    return PreflightSettings(
        objective=cfg.objective,
        engine_gap_max=limits_for(cfg.trainer, cfg.model.dtype, run_precision(cfg)).engine_gap,
        precision=run_precision(cfg),
        seed=cfg.seed,
        shared_prefix=cfg.trainer.shared_prefix,
        grad_rows=BatchPlan.of(cfg).micro,  # the trainer's forward + backward rows
    )


def sample_batch(run: Run) -> tuple[PreflightBatch, list[str]]:
    """A few real groups from the configured task, sampled and scored as the trainer does.
    Uses its own generators, so the training run's prompt draw is untouched."""
    cfg = run.cfg
    G = cfg.trainer.num_generations
    n_prompts = max(2, PREFLIGHT_ROWS // G)
    examples = run.task.sample(n_prompts, seeds.preflight_prompts(cfg.seed))
    params = cfg.rollout.sampling(seed=seeds.preflight_sampling_seed(cfg.seed))
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


def reward_variance_over_a_step(run: Run, batch: PreflightBatch) -> CheckResult | None:
    """rewards.variance on a training step's worth of groups, or None when the preflight's own
    groups already are one. A sparse reward (a base model right 3% of the time) often leaves
    the preflight's few groups all flat while a step's prompts_per_step groups still teach:
    the check fails only when a whole step would have no group that varies."""
    cfg = run.cfg
    G = cfg.trainer.num_generations
    have = batch.rewards.numel() // G
    more = cfg.trainer.prompts_per_step - have
    if more <= 0:
        return None
    draw = seeds.preflight_prompts(cfg.seed)
    run.task.sample(have, draw)  # the preflight's own prompts, then new ones
    examples = run.task.sample(more, draw)
    params = cfg.rollout.sampling(seed=seeds.preflight_sampling_seed(cfg.seed) + 1)
    rollout = run.engine.generate([e.prompt for e in examples], G, params)
    rewards = torch.cat([batch.rewards, score(rollout, examples, run.rewards).total.float()])
    return next(checks.check_rewards(dataclasses.replace(batch, rewards=rewards)))


def episode_results(run: Run, s: PreflightSettings) -> list[CheckResult]:
    """The episode checks on probe episodes of the configured engine and tool turns."""
    cfg = run.cfg
    G = cfg.trainer.num_generations
    examples = run.task.sample(max(2, PREFLIGHT_ROWS // G), seeds.preflight_prompts(cfg.seed))
    params = cfg.rollout.sampling(seed=seeds.preflight_sampling_seed(cfg.seed))
    params.max_turns = max(params.max_turns or 1, 2)  # room for a tool turn
    batch = probe_episodes(run.engine, [e.prompt for e in examples], G, params)
    return run_episode_checks(run.model, batch, s, run.functions, run.engine.episodes.functions)


# --- Against a float64 copy of the model -------------------------------------------------------
#
# The gradient checks hold each path to checks.precision_tolerance: no materially further from
# a float64 copy of the model, on the same batch, than the plain path is.

# Rows per float64 forward with grad: its activations and [rows, T, V] logits stay small.
REFERENCE_ROWS = 4
# The float64 checks run on the batch's first two groups, at least 16 rows: on SmolLM2-135M
# their float64 forwards and backwards over all 32 rows were 84 s of a 125 s preflight, and
# what they look for (a normaliser wrong under accumulation or skipping, a log-prob path off
# the plain one) is in every row, so two groups show it as well as four.
FLOAT64_MIN_ROWS = 16


def float64_rows(batch: PreflightBatch, s: PreflightSettings) -> PreflightBatch:
    """The rows the float64 checks run on: the trainer's micro-batch (checks.grad_rows), at
    most two groups or FLOAT64_MIN_ROWS, whichever is more."""
    rows = max(2 * batch.group_size, FLOAT64_MIN_ROWS)
    if s.grad_rows is not None:
        rows = min(rows, s.grad_rows)
    return checks.grad_rows(batch, dataclasses.replace(s, grad_rows=rows))


def float64_copy(model) -> torch.nn.Module:
    """The model in float64 for the references: 8 bytes a parameter, 16 with gradients."""
    return copy.deepcopy(model).double().eval()


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


@dataclass(frozen=True)
class Distance:
    """How far a gradient (and log-probs) are from a reference's."""

    grad: float  # max |grad - reference| over every parameter, / max |reference|
    worst: str  # the parameter where that is reached
    worst_abs: float  # its |grad - reference|
    logp: float = 0.0  # max |logp - reference| over completion tokens
    logp_scale: float = 0.0  # max |reference logp| over completion tokens


def _grad_distance(model, reference: list[torch.Tensor | None]) -> Distance:
    """The model's current .grad against reference gradients (None: the parameter has none)."""
    scale = max((float(r.abs().max()) for r in reference if r is not None), default=0.0) or 1.0
    worst, worst_abs = "-", 0.0
    for (name, p), ref in zip(_trainable(model), reference, strict=True):
        if ref is not None:
            gap = _max_gap(torch.zeros_like(ref) if p.grad is None else p.grad, ref)
            if gap > worst_abs:
                worst, worst_abs = name, gap
    return Distance(worst_abs / scale, worst, worst_abs)


def reference_gradient(model64, logprobs_fn, args, loss_of) -> tuple[torch.Tensor, list]:
    """(logp [B, T-1], the parameters' gradients) of loss_of(logp, mask) for logp, mask =
    logprobs_fn(model64, *args) on the whole batch (args: input_ids, attention_mask,
    completion_mask, temperature), REFERENCE_ROWS rows per forward: d loss / d logp from the
    whole batch's log-probs, then each slice of rows backpropagated with its share of it
    (the chain rule: exact for any loss, whatever its normaliser)."""
    B = args[0].shape[0]
    slices = [slice(r0, r0 + REFERENCE_ROWS) for r0 in range(0, B, REFERENCE_ROWS)]

    def rows_of(rows: slice):
        return logprobs_fn(model64, *(a[rows] for a in args[:3]), args[3])

    with torch.no_grad():
        parts = [rows_of(rows) for rows in slices]
    logp = torch.cat([p[0] for p in parts]).requires_grad_()
    loss_of(logp, torch.cat([p[1] for p in parts])).backward()
    upstream = logp.grad
    model64.zero_grad(set_to_none=True)
    for rows in slices:
        (rows_of(rows)[0] * upstream[rows]).sum().backward()
    grads = _grads(model64)
    model64.zero_grad(set_to_none=True)
    return logp.detach(), grads


def _masked_sum(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (logp * mask).sum()


def logprob_distances(
    model, model64, args, paths: dict, reference=checks.float64_logprobs
) -> dict[str, Distance]:
    """Each of `paths` (name -> a sequence_logprobs-like function) on `model`, against
    `reference` on `model64`: log-probs and the gradient of sum(logp * mask) reaching the
    parameters. args: (input_ids, attention_mask, completion_mask, temperature)."""
    valid = args[2][:, 1:].bool()
    ref_logp, ref_grads = reference_gradient(model64, reference, args, _masked_sum)
    scale = _max_gap(ref_logp[valid], torch.zeros_like(ref_logp[valid]))
    out = {}
    for name, fn in paths.items():
        model.zero_grad(set_to_none=True)
        logp, mask = fn(model, *args)
        _masked_sum(logp, mask).backward()
        grad = _grad_distance(model, ref_grads)
        model.zero_grad(set_to_none=True)
        gap = _max_gap(logp.detach()[valid], ref_logp[valid])
        out[name] = dataclasses.replace(grad, logp=gap, logp_scale=scale)
    return out


def accumulated_gradients(
    impl: CoreFunctions, model, batch: PreflightBatch, s: PreflightSettings, advantages,
    parts, scale_fn, model64=None,
) -> tuple[float, float]:  # fmt: skip
    """(one pass, accumulated): the distances from the float64 copy's one-pass gradient of
    the loss of every row (`advantages` [B]) of the gradient of one pass over all rows, and of
    the gradient accumulated over `parts` (row indices), each part's loss scaled by
    scale_fn(loss_type, its mask, the whole batch's mask), relative to max |grad|."""
    o = s.objective
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask, o.temperature)
    L = o.max_completion_length or batch.input_ids.shape[1]

    def loss_of(logp, mask, rows=slice(None)) -> torch.Tensor:
        kwargs = o.loss_kwargs() | {"beta": 0.0, "max_completion_length": L}
        loss, _ = impl.grpo_loss(
            logp, logp.detach() + 0.05, None, advantages[rows], mask,
            **core.accepted_kwargs(impl.grpo_loss, kwargs),
        )  # fmt: skip
        return loss

    logprobs = in_precision(impl.sequence_logprobs, s.precision)

    def loss_of_rows(rows) -> torch.Tensor:
        logp, mask = logprobs(model, *(a[rows] for a in args[:3]), o.temperature)
        return loss_of(logp, mask, rows)

    model64 = float64_copy(model) if model64 is None else model64
    _, reference = reference_gradient(model64, impl.sequence_logprobs, args, loss_of)
    model.zero_grad(set_to_none=True)
    loss_of_rows(torch.arange(len(advantages))).backward()
    whole = _grad_distance(model, reference).grad
    model.zero_grad(set_to_none=True)
    unit_mask = batch.completion_mask[:, 1:]
    for rows in parts:
        if len(rows):
            (loss_of_rows(rows) * scale_fn(o.loss_type, unit_mask[rows], unit_mask)).backward()
    accumulated = _grad_distance(model, reference).grad
    model.zero_grad(set_to_none=True)
    return whole, accumulated


def check_split_invariance(
    impl: CoreFunctions, model, batch: PreflightBatch, s: PreflightSettings, model64=None
):
    """The gradient of the batch accumulated over micro-batches with the trainer's loss
    scaling equals the gradient in one pass (the wrong normaliser under accumulation shows
    here): both against the one-pass gradient of the same functions on a float64 copy."""
    batch = float64_rows(batch, s)
    B = batch.input_ids.shape[0]
    advantages = torch.tensor([1.0, -0.5] * (B // 2) + [1.0] * (B % 2))
    # Uneven micro-batches: the longest sequences alone, then the rest in two parts.
    order = torch.argsort(batch.completion_mask[:, 1:].sum(1), descending=True)
    parts = [order[: max(1, B // 4)], order[max(1, B // 4) : B // 2], order[B // 2 :]]
    whole, split = accumulated_gradients(
        impl, model, batch, s, advantages, parts, core.micro_batch_scale, model64
    )
    tol = checks.precision_tolerance(whole, 1.0, rounding_dtype(model, s.precision))
    yield CheckResult(
        "split.gradient_invariance",
        0,
        "max |grad(3 uneven micro-batches) - grad(one pass, float64 copy)| / max |grad|"
        + (" (bf16 autocast)" if s.precision.bf16 else ""),
        split,
        checks.tolerance_text(tol, whole, "one pass"),
        split <= tol,
        "the loss of each micro-batch must be scaled by its share of the whole batch's "
        "normaliser (tokens for token-mean, sequences for sequence-mean)",
    )


def check_skip_invariance(
    impl: CoreFunctions, model, batch: PreflightBatch, s: PreflightSettings, model64=None
):
    """The update that skips the rows without gradient (core.rows_without_gradient: a third
    of the rows given advantage 0 here) equals the full update: the gradient accumulated over
    micro-batches of the other rows, each scaled by its share of the whole batch's normaliser
    as the trainer does, against the one-pass gradient of every row on a float64 copy."""
    batch = float64_rows(batch, s)
    B = batch.input_ids.shape[0]
    advantages = torch.tensor([1.0, -0.5] * (B // 2) + [1.0] * (B % 2))
    advantages[:: 3 if B > 2 else 2] = 0.0
    kept = torch.nonzero(~core.rows_without_gradient(advantages)).view(-1)
    parts = [kept[: len(kept) // 2], kept[len(kept) // 2 :]]
    whole, skipped = accumulated_gradients(
        impl, model, batch, s, advantages, parts, impl.micro_batch_scale, model64
    )
    tol = checks.precision_tolerance(whole, 1.0, rounding_dtype(model, s.precision))
    yield CheckResult(
        "update.skip_invariance",
        0,
        f"max |grad(the {len(kept)} of {B} rows with an advantage, in 2 micro-batches) - "
        "grad(every row, one pass, float64 copy)| / max |grad|"
        + (" (bf16 autocast)" if s.precision.bf16 else ""),
        skipped,
        checks.tolerance_text(tol, whole, "one pass"),
        skipped <= tol,
        "a row whose advantage is 0 must add exactly 0 to the loss (every term A x a function "
        "of the ratio) and the skipped rows must stay in the normaliser; a loss with a term "
        "that reads every row needs trainer.skip_zero_advantage=false",
    )


def check_fused_logprobs(model, batch: PreflightBatch, s: PreflightSettings, model64=None):
    """The trainer's memory-efficient log-probs and the seed's code, each against a float64
    copy of the model: values and the gradient reaching the model's parameters."""
    from grpolab.logprobs import shared_prefix_status, split_model, token_logprobs

    batch = float64_rows(batch, s)
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask, s.objective.temperature)

    def trainers(model, *args):
        return token_logprobs(model, *args, shared_prefix=s.shared_prefix)

    model64 = float64_copy(model) if model64 is None else model64
    paths = {"fused": trainers, "naive": core.sequence_logprobs}
    paths = {name: in_precision(fn, s.precision) for name, fn in paths.items()}
    fused, naive = logprob_distances(model, model64, args, paths).values()
    dtype = rounding_dtype(model, s.precision)
    tol = checks.precision_tolerance(naive.logp, naive.logp_scale, dtype)
    grad_tol = checks.precision_tolerance(naive.grad, 1.0, dtype)
    reason = split_model(model).reason
    path = "fused" if reason is None else f"naive fallback ({reason})"
    if reason is None and s.shared_prefix:
        why_not = shared_prefix_status(model, *args[:3])
        path += ", one forward per prompt" if why_not is None else f", one per row ({why_not})"
    path += ", bf16 autocast" if s.precision.bf16 else ""
    yield CheckResult(
        "logprobs.fused_vs_naive",
        0,
        f"{path}: max |logp - float64 copy's| (relative gradient gap {fused.grad:.1e}, "
        f"naive {naive.grad:.1e})",
        fused.logp,
        f"{checks.tolerance_text(tol, naive.logp, 'naive')}; gradient <= {grad_tol:.2g}",
        fused.logp <= tol and fused.grad <= grad_tol,
        "the chunked lm-head path is further from float64 than the seed's log-softmax on "
        "this model: set trainer.logprobs=naive and report the model",
    )


def _max_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def check_worst_case_memory(impl: CoreFunctions, run: Run, cfg: Config, prompt_tokens: int):
    """Forward + backward of one micro-batch at the longest prompt + max_completion_length
    (each group's G rows sharing their prompt, as a rollout's do), measured; then the peak of
    a training step predicted from it and from what the run holds (`MemoryBreakdown`)."""
    t = cfg.trainer
    model = run.model
    G = t.num_generations
    rows = run.plan.micro
    L = cfg.rollout.episode_budget()  # an episode: every token after the prompt
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


def memory_breakdown(run: Run, cfg: Config, tokens: int, probe_growth: float) -> MemoryBreakdown:
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


def longest_prompt_tokens(run: Run, limit: int = 10_000) -> int:
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


def run_preflight(run: Run, progress=None) -> list[CheckResult]:
    """Every check on the run's model, its core functions and a real batch. progress(text):
    told what each group of checks does as it starts (PreflightProgress)."""
    cfg, model, functions = run.cfg, run.model, run.functions
    say = progress or (lambda doing: None)
    transformers.utils.logging.disable_progress_bar()
    # loss.masked_nan holds grpolab's own loss to NaN in masked slots; a user's loss gets
    # grpolab's inputs, finite under the mask, so masking by multiplication is right there.
    own_loss = functions.source.get("grpo_loss", "grpolab") == "grpolab"
    s = dataclasses.replace(settings_from_config(cfg), masked_nan=own_loss)
    system_prompt = cfg.task.system_prompt if cfg.task.chat_template else None
    say("tokenizer.coverage: the task's prompts and answers through the tokenizer")
    coverage = check_tokenizer_coverage(run.task, run.tokenizer, system_prompt)
    G = cfg.trainer.num_generations
    say(f"sampling {max(2, PREFLIGHT_ROWS // G)} prompts x {G} from the task "
        f"(up to {cfg.rollout.episode_budget()} tokens each) and scoring them")  # fmt: skip
    batch, _ = sample_batch(run)
    say(f"the checks of goals 1-7 on the {batch.input_ids.shape[0]} sampled rows")
    results = [coverage, *checks.run_checks(model, batch, s, functions)]
    flat = [i for i, r in enumerate(results) if r.id == "rewards.variance" and not r.passed]
    if flat:
        say("rewards.variance on a whole step's prompts (the sampled groups were all flat)")
    if flat and (over_a_step := reward_variance_over_a_step(run, batch)) is not None:
        results[flat[0]] = over_a_step
    if run.engine.episodes is not None:
        say("the episode checks on probe episodes")
        results += episode_results(run, s)
    if run.task.has_references:
        say(f"the reward probes on real task rows ({', '.join(fn.name for fn in run.rewards)})")
        report = probe_task(run.task, run.rewards, run.tokenizer)
        results += list(checks.check_reward_probes(report))
    else:  # right and wrong completions are written from the reference answers
        say("the reward probes: not run (the task has no reference answers to write right "
            "and wrong completions from)")  # fmt: skip
    with eval_mode(model, zero_grad=True):
        say("log-probs and gradients against a float64 copy of the model")
        model64 = float64_copy(model)  # both gradient checks' reference
        if cfg.trainer.logprobs == "fused":
            results += checks.guarded(
                functions, ("logprobs.fused_vs_naive",), 0, check_fused_logprobs, model, batch,
                s, model64,
            )  # fmt: skip
        results += checks.guarded(
            functions, ("split.gradient_invariance",), 0, check_split_invariance, functions,
            model, batch, s, model64,
        )  # fmt: skip
        if skips_zero_advantage(cfg, run.dist.on):
            results += checks.guarded(
                functions, ("update.skip_invariance",), 0, check_skip_invariance, functions,
                model, batch, s, model64,
            )  # fmt: skip
        del model64
        if functions.path is None:  # memory of grpolab's own path; a learner's is not sized
            prompt_tokens = longest_prompt_tokens(run)
            say(f"the worst-case memory: {run.plan.micro} rows of {prompt_tokens} + "
                f"{cfg.rollout.episode_budget()} tokens, forward and backward")  # fmt: skip
            results += checks.guarded(
                functions, ("memory.worst_case",), 0, check_worst_case_memory, functions, run,
                cfg,
                prompt_tokens,
            )  # fmt: skip
    return results


def preflight(
    cfg: Config,
    functions: CoreFunctions | None = None,
    episode_functions=None,
    console: Console | None = None,
) -> list[CheckResult]:
    """`grpolab preflight`: build the configured run (model, engine, task, rewards) and run
    every check on it. `functions`: the table to check (default: the trainer's);
    `episode_functions`: the episode functions to check (a run with tools); `console`: where
    each group of checks is announced as it starts and the task's answer kind is said (None:
    silent)."""
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    progress = PreflightProgress(console)
    progress("loading the model")
    model, tokenizer = load_start_model(cfg, resolve_device(cfg.model.device))
    run = build_run(cfg, model, tokenizer, functions=functions)
    if console is not None:
        console.print(run.task.describe_split())
        console.print(run.task.describe_answers())
    if episode_functions is not None and run.engine.episodes is not None:
        run.engine.episodes.functions = episode_functions
    return run_preflight(run, progress)


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


def print_results(results: list[CheckResult], console: Console, impl: CoreFunctions) -> None:
    replaced = [f for f, src in impl.source.items() if src != "grpolab"]
    title = "grpolab preflight" + (f" of {impl.path} ({', '.join(replaced)})" if impl.path else "")
    console.print(results_table(results, title))
    for r in checks.blamed(results):  # the likely cause first
        detail = escape(f"{r.id}: {r.error or r.what} = {_shown(r.measured)}")
        console.print(f"[red]FAIL[/red] {detail}")
        if r.hint:
            console.print(f"     likely bug: {escape(r.hint)}")
    n_failed = sum(not r.passed for r in results)
    verdict = "[green]all checks pass" if not n_failed else f"[red]{n_failed} check(s) failed"
    console.print(f"{verdict} ({len(results)} checks)")


def results_json(results: list[CheckResult], impl: CoreFunctions) -> str:
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


def preflight_gate(run: Run, console: Console, skip: bool = False) -> str:
    """Run every check on the run's model, core functions and a real batch before step 1,
    printing each group as it starts; returns preflight.json's text for the run directory.
    Raises PreflightFailed if a check fails, with the results written to a file of their
    own (the run directory is left as it was). The global RNG state is left as found, so a
    resumed run stays bit-exact."""
    if skip:
        console.print(f"[bold yellow]warning:[/bold yellow] {SKIP_WARNING}")
        return json.dumps({"skipped": True, "warning": SKIP_WARNING}, indent=2) + "\n"
    progress = PreflightProgress(console)
    device = next(run.model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        results = run_preflight(run, progress)
    record = results_json(results, run.functions) + "\n"
    failed = checks.blamed(results)  # the likely cause first
    if failed:
        print_results(results, console, run.functions)
        fd, details = tempfile.mkstemp(prefix="grpolab-preflight-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(record)
        ids = ", ".join(r.id for r in failed)
        raise PreflightFailed(
            f"preflight: {len(failed)} of {len(results)} checks failed ({ids}); training did not "
            f"start and output_dir={run.cfg.output_dir} is as it was. Details in {details}; "
            "--skip-preflight overrides"
        )
    console.print(f"preflight: all {len(results)} checks pass ({progress.elapsed():.1f} s)")
    return record


class PreflightProgress:
    """One line per group of checks as it starts, with the time since the first: a
    preflight on a real model takes minutes."""

    def __init__(self, console: Console | None):
        self.console = console
        self.tic = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.tic

    def __call__(self, doing: str) -> None:
        if self.console is not None:
            self.console.print(f"preflight {self.elapsed():6.1f} s  {escape(doing)}")


def write_results(results: list[CheckResult], path: Path, impl: CoreFunctions) -> None:
    path.write_text(results_json(results, impl) + "\n")
