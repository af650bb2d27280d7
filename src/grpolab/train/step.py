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

import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from grpolab import core, seeds
from grpolab.model import dist as dist_module
from grpolab.model.packed import token_budget_parts
from grpolab.model.precision import autocast
from grpolab.objective import active_units
from grpolab.objective.base import MicroTokens, StepTokens
from grpolab.rewards import RewardResult, flat_verdicts, gather_scores, score
from grpolab.rollout.base import Rollout
from grpolab.tasks.base import Example
from grpolab.train.evaluate import correct_answers, task_strict_correct
from grpolab.train.setup import Run


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
    # None where the task has no reference answers:
    correct: torch.Tensor | None  # [B] bool: the accuracy reward is 1
    strict: torch.Tensor | None  # [B] bool: the final answer as written is the reference
    advantages: torch.Tensor  # [B]: this rank's rows of the global batch's advantages
    adv_group_sum: float  # max |sum of a group's advantages| over the global batch: ~0
    engine_logprobs: torch.Tensor | None  # [B, T-1], the engine's own, when it reports them
    # [B] 1 for rows in the loss, 0 for rows out of it (truncated completions under
    # mask_truncated_completions, dynamic sampling's fill); None: every row.
    loss_rows: torch.Tensor | None = None
    # [B] True for rows the update skips (config.skips_zero_advantage); None: none skipped.
    skip_rows: torch.Tensor | None = None
    # [B, T] the tokens a token-mode normaliser counts (episodes: the model's own, from the
    # engine's episode functions); None: completion_mask (single-turn).
    normaliser_mask: torch.Tensor | None = None
    logp_old: torch.Tensor | None = None  # [B, T-1]; None: the loss forward's own (on-policy)
    logp_ref: torch.Tensor | None = None  # [B, T-1] when beta > 0
    # [B, T-1] each: what the declared units fixed before the update (their before_update).
    before: dict[str, torch.Tensor] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    sampling: dict[str, float] = field(default_factory=dict)  # dynamic sampling's counts
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
                **({} if self.rollout.turns is None else {"turns": turn_records(self, i)}),
            }
            for i in range(0, min(n * stride, len(prompts)), stride)
        ]


def turn_records(batch: StepBatch, i: int) -> list[dict[str, Any]]:
    """Sample i's turns for completions.jsonl: role, text, trained, tokens (and the tool)."""
    return [
        {"role": t.role, "text": t.text, "trained": t.trained, "tokens": t.end - t.start}
        | ({"name": t.name, "error": t.error} if t.role == "tool" else {})
        for t in batch.rollout.turns[i]
    ]


@dataclass
class UpdateStats:
    """What the update loop measured, for the metrics and the monitors."""

    token_sums: dict[str, float] = field(default_factory=dict)  # grpo_loss metric x tokens
    tokens: float = 0.0
    grad_norms: list[float] = field(default_factory=list)  # one per applied optimizer step
    minibatch_losses: list[float] = field(default_factory=list)  # one per optimizer step
    skipped: int = 0  # optimizer steps a non-finite value stopped
    rows_skipped: int = 0  # rows of micro-batches not run: no gradient (StepBatch.skip_rows)
    rows_run: int = 0
    nonfinite: str | None = None  # what went non-finite first
    ratio_dev: float = 0.0  # max |ratio - 1| before the step's first update
    engine_gap: float | None = None  # max |engine logp - trainer logp| before it
    engine_gap_sum: float = 0.0  # sum of |engine logp - trainer logp| over those tokens
    engine_gap_tokens: float = 0.0
    # unit name -> its token_weights' sums over the step (importance weights, kept tokens)
    unit_sums: dict[str, dict[str, float]] = field(default_factory=dict)


def grpo_step(run: Run, step: int) -> tuple[dict[str, Any], StepBatch]:
    """One GRPO step; returns (metrics, the step's batch)."""
    batch = collect(run, step)
    tic = time.perf_counter()
    batch.logp_old, batch.logp_ref, entropy = logprobs_before_update(run, batch)
    batch.before = units_before_update(run, batch, entropy)
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
    the same) -> rewards -> advantages over the global batch. A unit that keeps only some
    groups (dynamic sampling) samples more rounds of prompts until the batch is full; a unit
    may take rows out of the loss (truncation masking) or add inputs of the advantages."""
    d, o = run.dist, run.objective
    G, units = o.num_generations, active_units(o)
    timings: dict[str, float] = {}
    run.optimizer.zero_grad(set_to_none=True)  # the last step's gradients: not held meanwhile
    examples, rollout, scores = sample_and_score(run, step, 0, timings)
    loss_rows, counts = None, {}
    for unit in units:
        if unit.keep_groups:
            examples, rollout, scores, loss_rows, counts = keep_groups(
                run, step, unit, (examples, rollout, scores), timings
            )
    for unit in units:
        if unit.loss_rows:
            kept = unit.loss_rows(o, run.functions, rollout)  # [B]
            loss_rows = kept if loss_rows is None else loss_rows * kept

    tic = time.perf_counter()
    correct = strict = None  # a task without references: the rewards alone judge
    if run.task.has_references:
        correct = correct_answers(scores, rollout.completions, examples, run.rewards, run.accuracy)
        per_sample = [e for e in examples for _ in range(G)]
        # The task's judge, in code independent of the rewards' (a reasoning-gym suite's:
        # its generator's own score_answer).
        strict = task_strict_correct(run.task, rollout.completions, per_sample)
    # Advantages over the global batch ("batch" scaling needs every rank's rewards).
    all_rewards = dist_module.all_gather_cat(scores.total, d)  # [B_global]
    kwargs = dict(o.advantage_kwargs())  # run.functions drop what a user's does not take
    for unit in units:
        if unit.advantage_inputs:  # per-row inputs (reinforce_pp's token counts)
            for name, values in unit.advantage_inputs(o, rollout).items():
                kwargs[name] = dist_module.all_gather_cat(values, d)  # [B_global]
    # Rows that vote in their group's statistics: scored by some function and in the loss
    # (truncation masking, dynamic sampling's fill); the others get advantage 0.
    valid = scores.scorable.float() if loss_rows is None else scores.scorable * loss_rows
    kwargs["valid"] = dist_module.all_gather_cat(valid.float(), d) > 0
    advantages = run.functions.group_advantages(all_rewards, G, **kwargs)
    adv_group_sum = float(advantages.view(-1, G).sum(dim=1).abs().max())
    advantages = advantages[dist_module.rank_slice(len(advantages), d)]  # [B]
    timings["time/score"] = timings.get("time/score", 0.0) + time.perf_counter() - tic

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
        loss_rows=None if loss_rows is None else loss_rows.to(dev),
        skip_rows=(
            core.rows_without_gradient(advantages, loss_rows).to(dev)
            if run.settings.skip_zero_advantage
            else None
        ),
        normaliser_mask=episode_normaliser_mask(run, rollout),
        timings=timings,
        sampling=counts,
    )


def episode_normaliser_mask(run: Run, rollout: Rollout) -> torch.Tensor | None:
    """[B, T] on the run's device: the tokens the engine's episode functions say a token-mode
    loss is normalised by; None for single-turn rollouts (the loss mask itself)."""
    episodes = run.engine.episodes
    if rollout.turns is None or episodes is None:
        return None
    return episodes.functions.normaliser_mask(rollout).to(run.device)


def sample_and_score(
    run: Run, step: int, round_: int, timings: dict[str, float]
) -> tuple[list[Example], Rollout, RewardResult]:
    """One round of prompts_per_step prompts, sampled and scored (round 0: the step's own
    seed; later rounds of dynamic sampling draw further prompts with seeds of their own)."""
    s, d, G = run.settings, run.dist, run.objective.num_generations
    tic = time.perf_counter()
    # Every rank draws the same global prompts and keeps its slice of whole groups.
    drawn = run.task.sample(s.prompts_per_step, run.prompt_generator)
    examples = drawn[dist_module.rank_slice(len(drawn), d)]
    if s.replicated_rollout:
        params = s.sampling(seeds.rollout_seed(s.seed, step, round_=round_))
        rollout = run.engine.generate([e.prompt for e in drawn], G, params)
        rollout = rollout.rows(dist_module.rank_slice(rollout.batch_size, d))
    else:
        params = s.sampling(seeds.rollout_seed(s.seed, step, d.rank, round_))
        rollout = run.engine.generate([e.prompt for e in examples], G, params)
    if rollout.engine_logprobs is None:
        needing = [u.engine_logprobs(run.objective) for u in active_units(run.objective)]
        for key in filter(None, needing):
            raise ValueError(
                f"{key} needs the engine's log-probs; this engine returned none (vLLM with "
                "top_k / top_p)"
            )
    timings["time/rollout"] = timings.get("time/rollout", 0.0) + time.perf_counter() - tic
    tic = time.perf_counter()
    scores = score(rollout, examples, run.rewards)
    timings["time/score"] = timings.get("time/score", 0.0) + time.perf_counter() - tic
    return examples, rollout, scores


def keep_groups(run: Run, step: int, unit, first, timings: dict[str, float]):
    """Keep the groups `unit` keeps (DAPO's dynamic sampling: those whose rewards vary),
    sampling further rounds until prompts_per_step are kept or its extra rounds run out;
    then the dropped groups fill what is missing, with loss_rows 0 (out of the loss and its
    normaliser). Returns (examples, rollout, scores, loss_rows [B], counts for the metrics,
    named by the unit's metric prefix)."""
    o = run.objective
    G, need = o.num_generations, run.settings.prompts_per_step
    # A group: (its example, its rollout rows, (its round's scores, its rows there)).
    kept: list[tuple[Example, Rollout, tuple[RewardResult, slice]]] = []
    dropped: list[tuple[Example, Rollout, tuple[RewardResult, slice]]] = []
    rounds, scored, generated = [first], [], 0
    while rounds:
        examples, rollout, scores = rounds.pop()
        scored.append(scores)
        keep = unit.keep_groups(o, run.functions, scores.total, G)  # [groups] bool
        for g, example in enumerate(examples):
            rows = slice(g * G, (g + 1) * G)
            group = (example, rollout.rows(rows), (scores, rows))
            (kept if bool(keep[g]) else dropped).append(group)
        generated += len(examples)
        extra_round = generated // need
        if len(kept) < need and extra_round <= unit.extra_rounds(o):
            rounds.append(sample_and_score(run, step, extra_round, timings))
    chosen = kept[:need] + dropped[: max(0, need - len(kept))]
    examples = [e for e, _, _ in chosen]
    rollout = cat_rollouts([r for _, r, _ in chosen])
    n_kept = min(len(kept), need)
    loss_rows = torch.tensor([1.0] * n_kept * G + [0.0] * (need - n_kept) * G)
    prefix = unit.metric_prefix or unit.name
    counts = {
        f"{prefix}/groups_generated": float(generated),
        f"{prefix}/groups_kept": float(n_kept),
        f"{prefix}/groups_filled": float(need - n_kept),
    }
    # Each sample keeps the scores its group was kept for: scored again, a stochastic
    # reward (a judge, a sampled verifier) could make a kept group flat in the loss.
    scores = gather_scores([s for _, _, s in chosen], scored, rollout)
    return examples, rollout, scores, loss_rows, counts


def cat_rollouts(parts: list[Rollout]) -> Rollout:
    """Whole groups of several rollouts as one: prompts left-padded to the longest prompt
    (P), completions right-padded to the widest; [B, T] and [B, T-1] fields are re-padded
    alike, [B] fields and lists concatenated, group ids renumbered."""
    P = max(r.prompt_length for r in parts)
    width = max(r.input_ids.shape[1] - r.prompt_length for r in parts)
    fields = {}
    for f in dataclasses.fields(Rollout):
        values = [getattr(r, f.name) for r in parts]
        first = values[0]
        if f.name == "prompt_length":
            fields[f.name] = P
        elif f.name == "group_ids":
            fields[f.name] = torch.cat([v + i for i, v in enumerate(values)])
        elif isinstance(first, list):
            fields[f.name] = [x for v in values for x in v]
        elif isinstance(first, torch.Tensor) and first.dim() == 2:
            pads = [
                (P - r.prompt_length, width - (r.input_ids.shape[1] - r.prompt_length))
                for r in parts
            ]
            fields[f.name] = torch.cat(
                [torch.nn.functional.pad(v, pad) for v, pad in zip(values, pads, strict=True)]
            )
        elif isinstance(first, torch.Tensor):
            fields[f.name] = torch.cat(values)
        else:
            fields[f.name] = first
    return Rollout(**fields)


# --- Old and reference log-probs -----------------------------------------------------------------


def logprobs_before_update(
    run: Run, batch: StepBatch
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(logp_old, logp_ref, entropy), each [B, T-1] or None. logp_old: the engine's, or an
    extra forward of the training model before any update, or None when the loss forward's
    own detached log-probs are it (one optimizer step per batch). logp_ref: when beta > 0.
    entropy: the policy's, when a declared unit reads it before the update (from logp_old's
    forward, or a forward of its own)."""
    o = run.objective
    wants_entropy = any(u.reads_entropy for u in active_units(o))
    logp_old = entropy = None
    if o.logprob_source == "engine":
        if batch.engine_logprobs is None:
            raise ValueError("objective.logprob_source=engine but the engine returned no log-probs")
        logp_old = batch.engine_logprobs
    needs_old = logp_old is None and not run.settings.old_from_loss_forward
    if needs_old or wants_entropy:  # one forward for both
        with autocast(run.precision, run.device):  # the loss forward's precision
            logp, entropy = logprobs_in_chunks(run, run.model, batch, wants_entropy)
        logp_old = logp if needs_old else logp_old
    logp_ref = None
    if o.beta > 0:
        with autocast(run.precision, run.device):
            logp_ref = reference_logprobs(run, batch)
    return logp_old, logp_ref, entropy


@torch.no_grad()
def logprobs_in_chunks(
    run: Run, model: torch.nn.Module, batch: StepBatch, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the whole batch under `model` (and with `entropy`, its entropy),
    micro-batch by micro-batch, no grad: ([B, T-1], [B, T-1] or None)."""
    packed = run.settings.max_tokens_per_microbatch is not None
    logps, entropies = [], []
    for rows, _ in micro_batches(run, batch, torch.arange(batch.rows)):  # in order
        logp, _, *rest = run.functions.sequence_logprobs(
            model,
            batch.input_ids[rows],
            batch.attention_mask[rows],
            batch.completion_mask[rows],
            run.objective.temperature,
            **({"packed": True} if packed else {}),
            **({"return_entropy": True} if entropy else {}),
        )
        logps.append(logp)
        entropies += rest
    return torch.cat(logps), torch.cat(entropies) if entropy else None


def units_before_update(run: Run, batch: StepBatch, entropy) -> dict[str, torch.Tensor]:
    """The declared units' tensors fixed before the update ([B, T-1] each), over the loss's
    tokens of the global batch."""
    o, d = run.objective, run.dist
    units = [u for u in active_units(o) if u.before_update]
    if not units:
        return {}
    mask = batch.completion_mask[:, 1:].float()  # [B, T-1]: the tokens in the loss
    if batch.loss_rows is not None:
        mask = mask * batch.loss_rows[:, None]
    tokens = StepTokens(mask, entropy, lambda values: dist_module.all_gather_varying(values, d))
    return {k: v for u in units for k, v in u.before_update(o, run.functions, tokens).items()}


def reference_logprobs(run: Run, batch: StepBatch) -> torch.Tensor:
    """Log-probs under the reference policy: the frozen copy, or under LoRA the same model with
    its adapters disabled (the base weights never change): [B, T-1]."""
    if run.ref_model is not None:
        return logprobs_in_chunks(run, run.ref_model, batch)[0]
    with run.model.disable_adapter():
        return logprobs_in_chunks(run, run.model, batch)[0]


# --- Update ------------------------------------------------------------------------------------


def update(run: Run, batch: StepBatch) -> UpdateStats:
    """num_iterations inner epochs; each a shuffled pass over the minibatches (one optimizer
    step each). The shuffle's seed depends on the step, so a resumed run shuffles the same."""
    plan, stats = run.plan, UpdateStats()
    run.model.train()
    order_generator = seeds.minibatch_order(run.settings.seed, batch.step, run.dist.rank)
    for epoch in range(run.objective.num_iterations):
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
    d, max_norm = run.dist, run.settings.max_grad_norm
    params = [p for p in run.model.parameters() if p.requires_grad]
    counted = batch.completion_mask if batch.normaliser_mask is None else batch.normaliser_mask
    minibatch_mask = counted[rows, 1:]  # [mini, T-1]
    if batch.loss_rows is not None:  # rows out of the loss are out of its normaliser
        minibatch_mask = minibatch_mask * batch.loss_rows[rows, None]
    # The normaliser is global: the same count on every rank, so the ranks' summed gradients
    # are the single-process gradient of the global minibatch.
    count = dist_module.all_sum(core.normaliser_count(run.objective.loss_type, minibatch_mask), d)
    run.optimizer.zero_grad(set_to_none=True)
    loss_total, nonfinite, ran = 0.0, None, False
    for micro_rows, last in micro_batches(run, batch, rows, stats):
        stats.rows_run += len(micro_rows)
        ran = True
        # ddp: the last micro-batch's backward sums the accumulated gradients over ranks, bucket
        # by bucket as backward finishes them (rows are never skipped under data parallel, so
        # every rank syncs on the same micro-batch).
        with run.gradient_sync(last):
            share, problem = micro_step(run, batch, micro_rows, minibatch_mask, count, first, stats)
            (share * dist_module.loss_multiplier(d)).backward()
        nonfinite = nonfinite or problem
        loss_total += float(share.detach())
    if not ran:  # every row skipped: the full update's gradient, exact zeros (AdamW still
        for p in params:  # steps its moments and decay, as it would on the full batch)
            p.grad = torch.zeros_like(p)
    norm = dist_module.grad_norm(params, d)
    nonfinite = nonfinite or first_nonfinite({"gradient": norm})
    if dist_module.any_rank(nonfinite is not None, d):
        nonfinite = nonfinite or "a non-finite value on another rank"
    if nonfinite is None and max_norm > 0:
        dist_module.clip_gradients(params, norm, max_norm, d)
    if nonfinite is not None:
        run.optimizer.zero_grad(set_to_none=True)
        stats.skipped += 1
        stats.nonfinite = stats.nonfinite or nonfinite
    else:
        run.optimizer.step()
        run.scheduler.step()  # the schedule counts applied updates
        stats.grad_norms.append(float(norm))
    stats.minibatch_losses.append(dist_module.all_sum(loss_total, d))


def micro_batches(
    run: Run, batch: StepBatch, rows: torch.Tensor, stats: UpdateStats | None = None
) -> list[tuple[torch.Tensor, bool]]:
    """Minibatch `rows` as micro-batches, each (its rows ascending, whether it is the last
    cut): plan.micro rows each, each cut again under batch.max_tokens_per_microbatch into
    consecutive rows packing into at most that many positions. With `stats`, the rows
    without gradient are dropped (their share is exactly 0) and counted; a cut left empty
    is not run."""
    budget, micro = run.settings.max_tokens_per_microbatch, run.plan.micro
    skip = batch.skip_rows if stats is not None else None
    # Ascending rows keep a group's samples adjacent (one prompt forward each).
    cuts = [rows[s : s + micro].sort().values for s in range(0, len(rows), micro)]
    if budget is not None:
        if skip is not None:
            stats.rows_skipped += int(sum(skip[c].sum() for c in cuts))
            cuts, skip = [c[~skip[c]] for c in cuts], None
        fields = (batch.input_ids, batch.attention_mask, batch.completion_mask)
        cuts = [
            c[part] for c in cuts for part in token_budget_parts(*(f[c] for f in fields), budget)
        ]
    out = []
    for i, cut in enumerate(cuts):
        if skip is not None:
            kept = cut[~skip[cut]]
            stats.rows_skipped += len(cut) - len(kept)
            cut = kept
        if len(cut):
            out.append((cut, i == len(cuts) - 1))
    return out


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
    fns, o = run.functions, run.objective
    with autocast(run.precision, run.device):  # the forward only; backward outside
        logp, mask, *entropy = run.train_forward(  # ddp: through DDP's forward
            batch.input_ids[rows],
            batch.attention_mask[rows],
            batch.completion_mask[rows],
            o.temperature,
            return_entropy=True,  # dropped for a user's function without it (as_called)
            packed=run.settings.max_tokens_per_microbatch is not None,  # the same, to rounding
        )  # [b, T-1], float32 whatever the matmul precision
    if batch.loss_rows is not None:
        mask = mask * batch.loss_rows[rows, None]
    old = logp.detach() if batch.logp_old is None else batch.logp_old[rows]
    ref = None if batch.logp_ref is None else batch.logp_ref[rows]
    engine = None if batch.engine_logprobs is None else batch.engine_logprobs[rows]
    if first:  # the policy that sampled, not yet updated: the ratio must be 1
        deviation = masked_max_abs(torch.exp(logp.detach() - old) - 1, mask)
        stats.ratio_dev = max(stats.ratio_dev, deviation)
        if engine is not None:
            gap = (engine - logp.detach()).abs() * mask.bool()  # [b, T-1]
            stats.engine_gap = max(stats.engine_gap or 0.0, masked_max_abs(gap, mask))
            stats.engine_gap_sum += float(gap.sum())
            stats.engine_gap_tokens += float(mask.bool().sum())
    kwargs = dict(o.loss_kwargs())
    weights = unit_token_weights(run, batch, rows, logp, old, engine, mask, stats)
    if weights is not None:
        kwargs["token_weights"] = weights
    if entropy:
        kwargs["entropy"] = entropy[0]
    loss, loss_metrics = fns.grpo_loss(logp, old, ref, batch.advantages[rows], mask, **kwargs)
    given_old = None if batch.logp_old is None else old  # on-policy: old is logp itself
    problem = first_nonfinite(
        {"logp_old": given_old, "logp_ref": ref, "logp_new": logp.detach()}, mask
    ) or first_nonfinite({"loss": loss.detach()})
    scale = fns.micro_batch_scale(o.loss_type, mask, minibatch_mask, minibatch_count)
    tokens = float(mask.sum())
    stats.tokens += tokens
    for key, value in loss_metrics.items():
        stats.token_sums[key] = stats.token_sums.get(key, 0.0) + float(value) * tokens
    return loss * scale, problem


def unit_token_weights(
    run: Run, batch: StepBatch, rows, logp, old, engine, mask, stats: UpdateStats
) -> torch.Tensor | None:
    """The product of the declared units' token weights for micro-batch `rows` ([b, T-1]:
    the importance weights against the engine, the top-entropy tokens), their sums added to
    the step's; None when no declared unit weighs tokens."""
    o, product = run.objective, None
    before = {name: values[rows] for name, values in batch.before.items()}
    micro = MicroTokens(logp.detach(), old, engine, mask, before)
    for unit in active_units(o):
        if unit.token_weights:
            weights, sums = unit.token_weights(o, run.functions, micro)  # [b, T-1]
            product = weights if product is None else product * weights
            unit_sums = stats.unit_sums.setdefault(unit.name, {})
            for name, value in sums.items():
                unit_sums[name] = unit_sums.get(name, 0.0) + value
    return product


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


def skip_metrics(batch: StepBatch, stats: UpdateStats) -> dict[str, float]:
    """update/skipped_groups: groups whose every row the update skipped (no gradient: flat
    rewards, dynamic sampling's filler); update/skipped_rows_frac: the share of the update's
    row passes not run."""
    if batch.skip_rows is None:
        return {}
    G = batch.rows // len(batch.examples)
    skipped_groups = batch.skip_rows.view(-1, G).all(dim=1).sum()
    passes = stats.rows_skipped + stats.rows_run
    return {
        "update/skipped_groups": float(skipped_groups),
        "update/skipped_rows_frac": stats.rows_skipped / max(passes, 1),
    }


def unit_metrics(run: Run, stats: UpdateStats) -> dict[str, float]:
    """The declared units' metrics, from their sums over every rank (each rank's sums summed,
    so a ratio of two of them is the global batch's)."""
    o, metrics = run.objective, {}
    for unit in active_units(o):
        if unit.metrics:
            sums = stats.unit_sums.get(unit.name, {})
            summed = {k: dist_module.all_sum(sums[k], run.dist) for k in sorted(sums)}
            metrics |= unit.metrics(o, defaultdict(float, summed))  # no micro-batch run: 0s
    return metrics


def step_metrics(run: Run, batch: StepBatch, stats: UpdateStats) -> dict[str, Any]:
    """The step's metrics, over all ranks: token-weighted sums added, worst cases (monitor/*)
    maxed, the rest averaged."""
    d = run.dist
    tokens = dist_module.all_sum(stats.tokens, d)
    token_sums = {k: dist_module.all_sum(v, d) for k, v in stats.token_sums.items()}
    losses, norms = stats.minibatch_losses, stats.grad_norms
    metrics: dict[str, Any] = {
        **batch.scores.metrics,  # reward/mean|std, rewards/<fn>/mean, zero-std groups, lengths
        **{k: v / max(tokens, 1.0) for k, v in token_sums.items()},  # token-weighted means
        "loss": sum(losses) / len(losses),  # the loss each optimizer step saw
        "grad_norm": sum(norms) / len(norms) if norms else float("nan"),
        "lr": run.scheduler.get_last_lr()[0],
        "skipped": stats.skipped,
        **skip_metrics(batch, stats),
        "monitor/ratio_dev": stats.ratio_dev,
        "monitor/adv_group_sum": batch.adv_group_sum,
    }
    if batch.correct is not None:
        metrics["accuracy"] = float(batch.correct.float().mean())
        metrics["strict_accuracy"] = float(batch.strict.float().mean())
        G = batch.rows // len(batch.examples)
        metrics |= flat_verdicts(batch.scores.total, batch.correct, G)  # solved or out of reach
    if batch.rollout.turns is not None and batch.correct is not None:  # right through a tool
        used = [any(t.role == "tool" and not t.error for t in ts) for ts in batch.rollout.turns]
        right = batch.correct.cpu() & torch.tensor(used, dtype=torch.bool)
        metrics["episode/correct_tool_use"] = float(right.float().mean())
    if stats.engine_gap is not None:
        metrics["monitor/engine_gap"] = stats.engine_gap
        metrics["monitor/engine_gap_mean"] = stats.engine_gap_sum / max(
            stats.engine_gap_tokens, 1.0
        )
    metrics |= unit_metrics(run, stats)
    metrics |= batch.sampling
    metrics |= batch.timings
    metrics["time/step"] = sum(batch.timings.values())
    sync_gap = run.engine.last_sync_gap  # the verified sync's gap (check_sync)
    if sync_gap is not None:
        metrics["engine/sync_gap"] = sync_gap
    metrics["tokens_per_s"] = float(batch.attention_mask.sum()) / max(metrics["time/step"], 1e-9)
    worst = {k: v for k, v in metrics.items() if k.startswith("monitor/")}  # max, not mean
    metrics = dist_module.mean_metrics(metrics, d) | dist_module.max_metrics(worst, d)
    metrics["tokens_per_s"] *= d.world
    return metrics
