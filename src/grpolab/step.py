"""One GRPO step, in phases over typed records:

    collect      prompts -> rollout -> rewards -> group advantages          -> StepBatch
    old / ref    logp_old (an extra forward, or the engine's) and logp_ref, before any update
    update       inner epochs x minibatches x micro-batches: loss, backward, clip, AdamW
                 (the only phase where gradients exist)                      -> UpdateStats
    sync         the engine samples the next step from the new weights
    metrics      one flat dict for metrics.jsonl, the console and the monitors

`grpo_step(run, step)` runs them in that order.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from grpolab import core, seeds
from grpolab import dist as dist_module
from grpolab.evaluate import correct_answers, strict_correct
from grpolab.rewards import RewardResult, score
from grpolab.rollout.base import Rollout
from grpolab.setup import Run, old_logprobs_from_loss_forward
from grpolab.tasks.base import Example


@dataclass
class StepBatch:
    """One step's data on this rank, from the rollout to the loss. Tensors [B, T] / [B]
    / [B, T-1] live on the run's device; groups are contiguous (row i answers prompt i // G)."""

    step: int
    examples: list[Example]  # this rank's prompts, one per group
    rollout: Rollout
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T]
    scores: RewardResult  # rewards per function, totals and their metrics
    correct: torch.Tensor  # [B] bool: the accuracy reward is 1
    strict: torch.Tensor  # [B] bool: the final answer as written is the reference (grpolab.strict)
    advantages: torch.Tensor  # [B]: this rank's rows of the global batch's advantages
    adv_group_sum: float  # max |sum of a group's advantages| over the global batch: ~0
    engine_logprobs: torch.Tensor | None  # [B, T-1], the engine's own, when it reports them
    logp_old: torch.Tensor | None = None  # [B, T-1]; None: the loss forward's own (on-policy)
    logp_ref: torch.Tensor | None = None  # [B, T-1] when beta > 0
    timings: dict[str, float] = field(default_factory=dict)
    nonfinite: str | None = None  # what went non-finite first in the update, if anything

    @property
    def rewards(self) -> torch.Tensor:  # [B]
        return self.scores.total

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def answers(self) -> list[str]:  # [B]
        G = self.rows // len(self.examples)
        return [e.answer for e in self.examples for _ in range(G)]

    def samples(self, n: int) -> list[dict[str, Any]]:
        """n rows spread over the groups, for completions.jsonl."""
        prompts, answers = self.rollout.prompts, self.answers()
        stride = max(1, len(prompts) // max(1, n))
        return [
            {
                "prompt": prompts[i],
                "completion": self.rollout.completions[i],
                "answer": answers[i],
                "reward": float(self.rewards[i]),
                "advantage": float(self.advantages[i]),
            }
            for i in range(0, min(n * stride, len(prompts)), stride)
        ]


@dataclass
class UpdateStats:
    """What the update loop measured, for the metrics and the monitors."""

    token_sums: dict[str, float] = field(default_factory=dict)  # grpo_loss metric x tokens
    tokens: float = 0.0
    grad_norms: list[float] = field(default_factory=list)  # one per applied optimizer step
    minibatch_losses: list[float] = field(default_factory=list)  # one per optimizer step
    skipped: int = 0  # optimizer steps a non-finite value stopped
    nonfinite: str | None = None  # what went non-finite first
    ratio_dev: float = 0.0  # max |ratio - 1| before the step's first update
    engine_gap: float | None = None  # max |engine logp - trainer logp| before it
    tis_capped: float = 0.0  # tokens whose importance weight hit the cap
    tis_weight: float = 0.0  # sum of the importance weights
    tis_tokens: float = 0.0


def grpo_step(run: Run, step: int) -> tuple[dict[str, Any], StepBatch]:
    """One GRPO step; returns (metrics, the step's batch)."""
    batch = collect(run, step)
    tic = time.perf_counter()
    batch.logp_old, batch.logp_ref = logprobs_before_update(run, batch)
    batch.timings["time/logprobs"] = time.perf_counter() - tic
    tic = time.perf_counter()
    stats = update(run, batch)
    batch.nonfinite = stats.nonfinite
    run.engine.sync_weights(run.model)  # a separate engine (vLLM) samples the next step
    batch.timings["time/update"] = time.perf_counter() - tic
    return step_metrics(run, batch, stats), batch


# --- Collect -----------------------------------------------------------------------------------


def collect(run: Run, step: int) -> StepBatch:
    """Prompts -> G samples each (eval mode, no grad, a per-step seed: a resumed run samples
    the same) -> rewards -> advantages over the global batch."""
    cfg, d = run.cfg, run.dist
    G = cfg.trainer.num_generations
    timings = {}
    tic = time.perf_counter()
    run.optimizer.zero_grad(set_to_none=True)  # the last step's gradients: not held meanwhile
    # Every rank draws the same global prompts and keeps its slice of whole groups.
    drawn = run.task.sample(cfg.trainer.prompts_per_step, run.prompt_generator)
    examples = drawn[dist_module.rank_slice(len(drawn), d)]
    if d.on and cfg.trainer.rollout_split == "replicated":
        params = cfg.rollout.sampling(seeds.rollout_seed(cfg.seed, step))
        rollout = run.engine.generate([e.prompt for e in drawn], G, params)
        rollout = rollout.rows(dist_module.rank_slice(rollout.batch_size, d))
    else:
        params = cfg.rollout.sampling(seeds.rollout_seed(cfg.seed, step, d.rank))
        rollout = run.engine.generate([e.prompt for e in examples], G, params)
    if cfg.trainer.tis_cap is not None and rollout.engine_logprobs is None:
        raise ValueError(
            "trainer.tis_cap needs the engine's log-probs; this engine returned none (vLLM "
            "with top_k / top_p)"
        )
    timings["time/rollout"] = time.perf_counter() - tic

    tic = time.perf_counter()
    scores = score(rollout, examples, run.rewards)
    correct = correct_answers(scores, rollout.completions, examples, run.rewards, run.accuracy)
    answers = [e.answer for e in examples for _ in range(G)]
    strict = strict_correct(rollout.completions, answers)  # independent of the rewards
    # Advantages over the global batch ("batch" scaling needs every rank's rewards).
    all_rewards = dist_module.all_gather_cat(scores.total, d)  # [B_global]
    advantages = run.functions.group_advantages(all_rewards, G, **cfg.objective.advantage_kwargs())
    adv_group_sum = float(advantages.view(-1, G).sum(dim=1).abs().max())
    advantages = advantages[dist_module.rank_slice(len(advantages), d)]  # [B]
    timings["time/score"] = time.perf_counter() - tic

    dev = run.device
    return StepBatch(
        step=step,
        examples=examples,
        rollout=rollout,
        input_ids=rollout.input_ids.to(dev),
        attention_mask=rollout.attention_mask.to(dev),
        completion_mask=rollout.completion_mask.to(dev),
        scores=scores,
        correct=correct,
        strict=strict,
        advantages=advantages.to(dev),
        adv_group_sum=adv_group_sum,
        engine_logprobs=(
            None if rollout.engine_logprobs is None else rollout.engine_logprobs.to(dev)
        ),
        timings=timings,
    )


# --- Old and reference log-probs -----------------------------------------------------------------


def logprobs_before_update(
    run: Run, batch: StepBatch
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logp_old, logp_ref), each [B, T-1] or None. logp_old: the engine's, or an extra
    forward of the training model before any update, or None when the loss forward's own
    detached log-probs are it (one optimizer step per batch). logp_ref: when beta > 0."""
    cfg = run.cfg
    logp_old = None
    if cfg.trainer.logprob_source == "engine":
        if batch.engine_logprobs is None:
            raise ValueError("trainer.logprob_source=engine but the engine returned no log-probs")
        logp_old = batch.engine_logprobs
    elif not old_logprobs_from_loss_forward(cfg, run.plan):
        with autocast(cfg.trainer.autocast, run.device):  # the loss forward's precision
            logp_old = logprobs_in_chunks(run, run.model, batch)
    logp_ref = None
    if cfg.trainer.beta > 0:
        with autocast(cfg.trainer.autocast, run.device):
            logp_ref = reference_logprobs(run, batch)
    return logp_old, logp_ref


@torch.no_grad()
def logprobs_in_chunks(run: Run, model: torch.nn.Module, batch: StepBatch) -> torch.Tensor:
    """Log-probs of the whole batch under `model`, micro-batch by micro-batch, no grad:
    [B, T-1]."""
    chunk, out = run.plan.micro, []
    for s in range(0, batch.rows, chunk):
        rows = slice(s, s + chunk)
        logp, _ = run.functions.sequence_logprobs(
            model,
            batch.input_ids[rows],
            batch.attention_mask[rows],
            batch.completion_mask[rows],
            run.cfg.rollout.temperature,
        )
        out.append(logp)
    return torch.cat(out)


def reference_logprobs(run: Run, batch: StepBatch) -> torch.Tensor:
    """Log-probs under the reference policy: the frozen copy, or under LoRA the same model with
    its adapters disabled (the base weights never change): [B, T-1]."""
    if run.ref_model is not None:
        return logprobs_in_chunks(run, run.ref_model, batch)
    with run.model.disable_adapter():
        return logprobs_in_chunks(run, run.model, batch)


def autocast(mode: str, device: torch.device):
    """bf16 matmuls for the model's forwards (weights and optimizer stay in the model dtype),
    or nothing."""
    if mode == "off":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


# --- Update ------------------------------------------------------------------------------------


def update(run: Run, batch: StepBatch) -> UpdateStats:
    """num_iterations inner epochs; each a shuffled pass over the minibatches (one optimizer
    step each). The shuffle's seed depends on the step, so a resumed run shuffles the same."""
    cfg, plan, stats = run.cfg, run.plan, UpdateStats()
    run.model.train()
    order_generator = seeds.minibatch_order(cfg.seed, batch.step, run.dist.rank)
    for epoch in range(cfg.trainer.num_iterations):
        if plan.minibatch < batch.rows:
            order = torch.randperm(batch.rows, generator=order_generator)
        else:
            order = torch.arange(batch.rows)
        for start in range(0, batch.rows, plan.minibatch):
            first = epoch == 0 and start == 0  # before this step's first update
            optimizer_step(run, batch, order[start : start + plan.minibatch], first, stats)
    return stats


def optimizer_step(
    run: Run, batch: StepBatch, rows: torch.Tensor, first: bool, stats: UpdateStats
) -> None:
    """Accumulate the gradient of the minibatch `rows` over micro-batches, then clip and apply
    it, unless a loss, log-prob or gradient value is non-finite (then nothing reaches the
    weights or the optimizer moments, and the step counts as skipped)."""
    cfg, d, plan = run.cfg, run.dist, run.plan
    params = [p for p in run.model.parameters() if p.requires_grad]
    minibatch_mask = batch.completion_mask[rows, 1:]  # [mini, T-1]
    # The normaliser is global: the same count on every rank, so the ranks' summed gradients
    # are the single-process gradient of the global minibatch.
    count = dist_module.all_sum(core.normaliser_count(cfg.trainer.loss_type, minibatch_mask), d)
    run.optimizer.zero_grad(set_to_none=True)
    loss_total, nonfinite = 0.0, None
    for m_start in range(0, plan.minibatch, plan.micro):
        # Ascending rows keep a group's samples adjacent (one prompt forward each).
        micro_rows = rows[m_start : m_start + plan.micro].sort().values
        last = m_start + plan.micro >= plan.minibatch
        share, problem = micro_step(run, batch, micro_rows, minibatch_mask, count, first, stats)
        nonfinite = nonfinite or problem
        if run.reducer is not None and last:  # ddp: the sums start as backward finishes them
            run.reducer.arm()
        (share * dist_module.loss_multiplier(d)).backward()
        loss_total += float(share.detach())
    if run.reducer is not None:
        run.reducer.wait()
    norm = dist_module.grad_norm(params, d)
    nonfinite = nonfinite or first_nonfinite({"gradient": norm})
    if dist_module.any_rank(nonfinite is not None, d):
        nonfinite = nonfinite or "a non-finite value on another rank"
    if nonfinite is None and cfg.trainer.max_grad_norm > 0:
        dist_module.clip_gradients(params, norm, cfg.trainer.max_grad_norm, d)
    if nonfinite is not None:
        run.optimizer.zero_grad(set_to_none=True)
        stats.skipped += 1
        stats.nonfinite = stats.nonfinite or nonfinite
    else:
        run.optimizer.step()
        run.scheduler.step()  # the schedule counts applied updates
        stats.grad_norms.append(float(norm))
    stats.minibatch_losses.append(dist_module.all_sum(loss_total, d))


def micro_step(
    run: Run,
    batch: StepBatch,
    rows: torch.Tensor,
    minibatch_mask: torch.Tensor,
    minibatch_count: float,
    first: bool,
    stats: UpdateStats,
) -> tuple[torch.Tensor, str | None]:
    """The loss of micro-batch `rows` scaled to its share of the minibatch's loss, and the
    first non-finite input or loss value (None when all are finite). Records its metrics."""
    cfg, fns = run.cfg, run.functions
    with autocast(cfg.trainer.autocast, run.device):  # the forward only; backward outside
        logp, mask = fns.sequence_logprobs(
            run.model,
            batch.input_ids[rows],
            batch.attention_mask[rows],
            batch.completion_mask[rows],
            cfg.rollout.temperature,
        )  # [b, T-1], float32 whatever the matmul precision
    old = logp.detach() if batch.logp_old is None else batch.logp_old[rows]
    ref = None if batch.logp_ref is None else batch.logp_ref[rows]
    engine = None if batch.engine_logprobs is None else batch.engine_logprobs[rows]
    weights = None  # [b, T-1] truncated importance weights, engine -> trainer
    if cfg.trainer.tis_cap is not None:
        weights = core.tis_weights(old, engine, mask, cfg.trainer.tis_cap)
        stats.tis_capped += float(((weights >= cfg.trainer.tis_cap) * mask).sum())
        stats.tis_weight += float((weights * mask).sum())
        stats.tis_tokens += float(mask.sum())
    if first:  # the policy that sampled, not yet updated: the ratio must be 1
        deviation = masked_max_abs(torch.exp(logp.detach() - old) - 1, mask)
        stats.ratio_dev = max(stats.ratio_dev, deviation)
        if engine is not None:
            gap = masked_max_abs(engine - logp.detach(), mask)
            stats.engine_gap = max(stats.engine_gap or 0.0, gap)
    loss, loss_metrics = fns.grpo_loss(
        logp,
        old,
        ref,
        batch.advantages[rows],
        mask,
        **cfg.objective.loss_kwargs(),
        **({} if weights is None else {"token_weights": weights}),
    )
    given_old = None if batch.logp_old is None else old  # on-policy: old is logp itself
    problem = first_nonfinite(
        {"logp_old": given_old, "logp_ref": ref, "logp_new": logp.detach()}, mask
    ) or first_nonfinite({"loss": loss.detach()})
    scale = core.micro_batch_scale(cfg.trainer.loss_type, mask, minibatch_mask, minibatch_count)
    tokens = float(mask.sum())
    stats.tokens += tokens
    for key, value in loss_metrics.items():
        stats.token_sums[key] = stats.token_sums.get(key, 0.0) + float(value) * tokens
    return loss * scale, problem


def first_nonfinite(
    named: dict[str, torch.Tensor | None], mask: torch.Tensor | None = None
) -> str | None:
    """The first of the named tensors (in order) with a non-finite value where `mask` is set
    (everywhere without a mask), with a count."""
    for name, values in named.items():
        if values is None:
            continue
        nonfinite = ~torch.isfinite(values)
        if mask is not None:
            nonfinite = nonfinite & mask.bool()
        if nonfinite.any():
            return f"{name} ({int(nonfinite.sum())} non-finite values)"
    return None


def masked_max_abs(values: torch.Tensor, mask: torch.Tensor) -> float:
    """max |values| over the positions where mask is set (0 when none is)."""
    picked = values[mask.bool()]
    return float(picked.abs().max()) if picked.numel() else 0.0


# --- Metrics -----------------------------------------------------------------------------------


def step_metrics(run: Run, batch: StepBatch, stats: UpdateStats) -> dict[str, Any]:
    """The step's metrics, over all ranks: token-weighted sums added, worst cases (monitor/*)
    maxed, the rest averaged."""
    d = run.dist
    tokens = dist_module.all_sum(stats.tokens, d)
    token_sums = {k: dist_module.all_sum(v, d) for k, v in stats.token_sums.items()}
    losses, norms = stats.minibatch_losses, stats.grad_norms
    metrics: dict[str, Any] = {
        **batch.scores.metrics,  # reward/mean|std, rewards/<fn>/mean, zero-std groups, lengths
        "accuracy": float(batch.correct.float().mean()),
        "strict_accuracy": float(batch.strict.float().mean()),
        **{k: v / max(tokens, 1.0) for k, v in token_sums.items()},  # token-weighted means
        "loss": sum(losses) / len(losses),  # the loss each optimizer step saw
        "grad_norm": sum(norms) / len(norms) if norms else float("nan"),
        "lr": run.scheduler.get_last_lr()[0],
        "skipped": stats.skipped,
        "monitor/ratio_dev": stats.ratio_dev,
        "monitor/adv_group_sum": batch.adv_group_sum,
    }
    if stats.engine_gap is not None:
        metrics["monitor/engine_gap"] = stats.engine_gap
    if run.cfg.trainer.tis_cap is not None:
        metrics["tis/weight_mean"] = stats.tis_weight / max(stats.tis_tokens, 1.0)
        metrics["tis/capped_frac"] = stats.tis_capped / max(stats.tis_tokens, 1.0)
    metrics |= batch.timings
    metrics["time/step"] = sum(batch.timings.values())
    sync_gap = getattr(run.engine, "last_sync_gap", None)  # vLLM: the verified sync's canary
    if sync_gap is not None:
        metrics["engine/sync_gap"] = sync_gap
    metrics["tokens_per_s"] = float(batch.attention_mask.sum()) / max(metrics["time/step"], 1e-9)
    worst = {k: v for k, v in metrics.items() if k.startswith("monitor/")}  # max, not mean
    metrics = dist_module.mean_metrics(metrics, d) | dist_module.max_metrics(worst, d)
    metrics["tokens_per_s"] *= d.world
    return metrics
