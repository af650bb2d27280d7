"""memory.worst_case: one micro-batch at the longest prompt + the completion budget, forward
and backward on the configured model, measured; the peak of a training step predicted from it
and from what the run holds (`memory.MemoryBreakdown`), against this machine's memory."""

from __future__ import annotations

import resource
import time

import torch

from grpolab.check import Check
from grpolab.model.memory import (
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
from grpolab.model.policy import base_model
from grpolab.model.precision import autocast
from grpolab.rollout.common import encode_prompts


def worst_case(ctx):
    """Forward + backward of one micro-batch at the longest prompt + max_completion_length
    (each group's G rows sharing their prompt, as a rollout's do; under a token budget as many
    such rows as one packed micro-batch holds, packed), measured; then the peak of a training
    step predicted from it and from what the run holds (`MemoryBreakdown`)."""
    run, impl = ctx.run, ctx.impl
    ctx.release("float64 copy")  # the preflight's, not a training step's
    ctx.release("float64 forward")
    cfg, model = run.cfg, run.model
    prompt_tokens = longest_prompt_tokens(run)
    rows, L = run.plan.micro, cfg.rollout.episode_budget()  # an episode: every token after it
    budget = cfg.batch.max_tokens_per_microbatch
    packed = {"packed": True} if budget and ctx.takes("sequence_logprobs", "packed") else {}
    if budget is not None:  # as many worst-case rows as one packed micro-batch holds
        rows = budget_rows(budget, prompt_tokens, L, cfg.batch.num_generations, rows)
    ctx.say(f"the worst-case memory: {rows} rows of {prompt_tokens} + {L} tokens, forward and "
            "backward")  # fmt: skip
    device = next(model.parameters()).device
    input_ids, attention_mask, completion_mask = _worst_batch(ctx, prompt_tokens, rows, L, device)
    model.zero_grad(set_to_none=True)
    model.train()  # as the trainer runs it: gradient checkpointing, dropout, its precision
    tic = time.perf_counter()
    with peak_memory(device) as probe:
        with autocast(ctx.settings.precision, device):  # the forward only, as the trainer's
            logp, mask = impl.sequence_logprobs(
                model, input_ids, attention_mask, completion_mask, cfg.rollout.temperature or 1.0,
                **packed,
            )  # fmt: skip
        loss, _ = impl.grpo_loss(
            logp, logp.detach(), None, torch.ones(rows, device=device), mask,
            loss_agg=cfg.objective.loss_type, max_completion_length=L,
        )  # fmt: skip
        loss.backward()
        del logp, mask, loss
    seconds = time.perf_counter() - tic
    model.zero_grad(set_to_none=True)
    breakdown = memory_breakdown(run, prompt_tokens + L, probe["growth"])
    cuda = device.type == "cuda"
    limit = torch.cuda.get_device_properties(device).total_memory / MB if cuda else None
    limit = limit or total_memory_mb()
    peak_so_far = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    where = "GPU memory" if cuda else "process RSS"
    return ctx.result(
        f"predicted peak {where} of a step (MB) = {breakdown.describe()}; measured on "
        f"{rows} x {prompt_tokens + L} tokens fwd+bwd ({seconds:.1f} s)"
        + ("" if cuda else f"; process peak so far {peak_so_far:.0f}"),
        round(breakdown.peak, 1),
        "fits" if limit is None else f"<= {limit:.0f} MB (this machine)",
        limit is None or breakdown.peak <= limit,
    )


def budget_rows(budget: int, prompt_tokens: int, L: int, G: int, most: int) -> int:
    """The most rows of prompt_tokens + L tokens (each group of G sharing its prompt) that
    pack into `budget` positions, at least 1 (a row over the budget runs alone), at most
    `most`."""
    rows = 1
    while rows < most and -(-(rows + 1) // G) * prompt_tokens + (rows + 1) * L <= budget:
        rows += 1
    return rows


def _worst_batch(ctx, prompt_tokens: int, rows: int, L: int, device):
    """[rows, prompt_tokens + L] random tokens, each group's G rows sharing their prompt."""
    model, G = ctx.run.model, ctx.run.cfg.batch.num_generations
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (-(-rows // G), prompt_tokens), generator=gen)
    completions = torch.randint(0, vocab, (rows, L), generator=gen)
    input_ids = torch.cat([prompts.repeat_interleave(G, dim=0)[:rows], completions], dim=1)
    input_ids = input_ids.to(device)  # [rows, T]
    completion_mask = torch.zeros_like(input_ids)
    completion_mask[:, prompt_tokens:] = 1
    return input_ids, torch.ones_like(input_ids), completion_mask


def memory_breakdown(run, tokens: int, probe_growth: float) -> MemoryBreakdown:
    """What a training step of `run` holds at its peak, with the worst-case micro-batch's
    forward + backward measured (`probe_growth` MB above the memory in use before it, which
    includes the gradients it allocated)."""
    cfg, model = run.cfg, run.model
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
    eval_length = cfg.eval.eval_max_completion_length or cfg.rollout.max_completion_length
    longest = tokens + max(0, eval_length - cfg.rollout.max_completion_length)
    kv_cache = kv_cache_mb(base_model(model).config, cfg.batch_size, longest, dtype)
    # What the configured engine holds while it samples: its own section's memory model.
    rollout = cfg.rollout.engine_section.memory_mb(weights, kv_cache, device)
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


CHECKS = (
    Check(
        "memory.worst_case",
        0,
        "the longest possible batch does not fit: lower max_completion_length or the minibatch "
        "size (where it raised an error other than running out of memory, the step itself "
        "fails on this config: the error says where)",
        worst_case,
        # grpolab's own path is sized; a learner's is not
        when=lambda ctx: ctx.impl.path is None,
        stage="run",
    ),
)
