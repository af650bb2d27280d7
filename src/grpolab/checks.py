"""The preflight: every intermediate quantity of GRPO measured before training may start.

Seven goals (`GOALS`, one per piece of the algorithm) plus the checks users of GRPO trainers
lose days to. Each check measures a number on the user's real model and batch, compares it
with what a correct implementation gives, and on failure names the likely bug. The functions
under test come from a `CoreFunctions` table: grpolab's, or a user's file (`--impl`, the
drill) with any of them.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from grpolab import core
from grpolab.core import CoreFunctions, Objective
from grpolab.functions import impl_error_line
from grpolab.models import eval_mode
from grpolab.precision import FP32, Precision
from grpolab.rewards import probes
from grpolab.rewards.probes import ProbeReport

GOALS = {
    1: "log-probs: shifted by one, float32 before log-softmax, temperature applied",
    2: "advantages: the declared std, zero where std ~ 0, contiguous groups, group sums ~ 0",
    3: "ratio: logp_old from an extra forward, exactly 1 before the first update",
    4: "clip: min acts in both directions, eps_low / eps_high on the right sides",
    5: "KL: k3 = exp(d) - d - 1, never negative, tracks the true KL",
    6: "normalisation: the declared aggregation; prompt and padding carry no gradient",
    7: "the assembled loss: finite, honest metrics, a step moves the policy the right way",
}


# --- What is checked ----------------------------------------------------------------------------


@dataclass
class PreflightBatch:
    """A real rollout batch: rows are left-padded prompt + completion + right padding."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T]
    rewards: torch.Tensor  # [B]
    group_size: int
    engine_logprobs: torch.Tensor | None = None  # [B, T-1], aligned like sequence_logprobs


@dataclass(frozen=True)
class PreflightSettings:
    """What the checks hold the implementation to: the declared objective, and how closely
    the engine must agree with the trainer."""

    objective: Objective = field(default_factory=Objective)
    engine_gap_max: float = 1e-3  # fp32 engines agree to ~1e-5; bf16 engines need more
    # What the engine samples in: under bf16 the engine's gap is held to the plain bf16
    # forward's own distance from the float32 log-probs instead of engine_gap_max.
    precision: Precision = FP32
    seed: int = 0
    shared_prefix: bool = True  # the trainer's fused log-probs run a group's prompt once
    # Rows that a check runs through the model with gradients (the first ones of the batch):
    # the trainer's micro-batch, so that the checks fit where training fits. None: all.
    grad_rows: int | None = None
    # loss.masked_nan: the loss survives NaN in masked slots. Off for a user's loss (the
    # drill teaches masking by multiplication, which grpolab's inputs, finite under the
    # mask, allow).
    masked_nan: bool = True
    # norm.minibatch_invariance: the trainer's micro-batch scaling with this loss. Off in the
    # drill, whose learner writes the loss but not the scaling (split.gradient_invariance
    # covers the learner's normaliser there).
    accumulation: bool = True


def grad_rows(batch: PreflightBatch, s: PreflightSettings) -> PreflightBatch:
    """The first s.grad_rows rows of the batch (all when None), for checks with gradients."""
    n = s.grad_rows
    if n is None or n >= batch.input_ids.shape[0]:
        return batch
    return PreflightBatch(
        batch.input_ids[:n],
        batch.attention_mask[:n],
        batch.completion_mask[:n],
        batch.rewards[:n],
        batch.group_size,
        None if batch.engine_logprobs is None else batch.engine_logprobs[:n],
    )


@dataclass
class CheckResult:
    id: str  # stable, e.g. "advantages.zero_std_groups"
    goal: int  # 1..7 for the seven goals, 0 for the checks beyond them
    what: str  # what was measured
    measured: Any  # the number (or a short string)
    expected: str
    passed: bool
    hint: str = ""  # the likely bug, shown on failure
    error: str | None = None  # the exception the implementation raised, if any
    error_line: int | None = None  # its line in the --impl file

    def to_json(self) -> dict:
        measured = self.measured
        if isinstance(measured, float) and not math.isfinite(measured):
            measured = str(measured)
        return {
            "id": self.id,
            "goal": self.goal,
            "what": self.what,
            "measured": measured,
            "expected": self.expected,
            "passed": self.passed,
            "hint": "" if self.passed else self.hint,
            "error": self.error,
            "error_line": self.error_line,
        }


# --- The checks ----------------------------------------------------------------------------------

HINTS = {
    "logprobs.shift": "logits at position t predict token t+1: use logits[:, :-1] with "
    "input_ids[:, 1:] and completion_mask[:, 1:]",
    "logprobs.float32": "cast the logits to float32 before log_softmax (logits.float()); "
    "bf16 log-softmax loses ~1e-2 per token",
    "logprobs.temperature": "divide the logits by the sampling temperature before "
    "log_softmax: the policy that sampled is softmax(logits / T)",
    "advantages.group_sums": "subtract each group's own mean: r.view(-1, G).mean(dim=1)",
    "advantages.population_std": "the declared convention is the population std, "
    "std(unbiased=False) (divide by G), and (std + eps); the sample std (divide by G - 1, TRL's "
    "and verl's) is another convention: declare it with trainer.profile or trainer.advantage_std",
    "advantages.sample_std": "the declared convention is the sample std, std(unbiased=True) "
    "(divide by G - 1, as TRL, verl and OpenRLHF do), and (std + eps); the population std is "
    "the seed's: declare it with trainer.advantage_std=population",
    "advantages.estimator": "rloo: r_i minus the mean of the OTHER G - 1 rewards of its group "
    "(G / (G - 1) * (r - mean)); reinforce_pp: r - group mean, then (x - mean) / sqrt(var + 1e-8) "
    "over the batch, each sequence weighted by its completion tokens",
    "advantages.zero_std_groups": "with the zero-std guard (the seed's), set the advantage to "
    "exactly 0 where the group's std <= eps: torch.where(std > eps, adv, 0); without it (TRL, "
    "verl, OpenRLHF) every group is (r - mean) / (std + eps)",
    "advantages.excluded_rows": "a row no reward function could score (every one returned "
    "None) or one out of the loss must not vote: compute each group's mean and std over its "
    "valid rows only (valid [B] bool) and give the others advantage exactly 0, not reward 0 "
    "in the baseline (TRL PR #5902, NeMo-RL PR #4160)",
    "norm.minibatch_invariance": "under gradient accumulation each micro-batch's loss is "
    "scaled by its share of the minibatch's normaliser, counted over the rows in the loss: "
    "tokens_micro / tokens_minibatch for token-mean, b_micro / (rows of the minibatch in the "
    "loss) for sequence-mean and constant; rows out of the loss (truncation masking, dynamic "
    "sampling's fill) count in neither (TRL PR #6024, TRL #6369)",
    "loss.masked_nan": "a NaN in a masked slot (padding of logp_old, logp_ref or logp_new) "
    "reaches the loss or its gradient: NaN * 0 is NaN, so select with torch.where(mask, x, 0) "
    "before any arithmetic instead of multiplying by the mask (OpenRLHF PR #1240)",
    "kl.bias_correction_gradient": "KL bias correction multiplies each token's KL by that "
    "token's own ratio exp(logp_new - logp_old), even under GSPO: the sequence ratio [B, 1] "
    "adds every token's KL to every other token's gradient while the loss looks normal "
    "(TRL #6586)",
    "advantages.contiguous": "the G samples of a prompt are contiguous: rewards.view(-1, G), "
    "not view(G, -1) or a transpose",
    "ratio.initial": "logp_old must come from the same model, same inputs and same mode "
    "(dropout off or identical) right before the first update; ratio = exp(new - old)",
    "clip.values": "per_token = -torch.min(ratio * A, clamp(ratio, 1 - eps_low, 1 + eps_high) "
    "* A): min (not max), and the minus sign because we minimise",
    "clip.gradient": "the clipped term must be the active one (and get no gradient) only "
    "where it is smaller: check torch.min and the clamp bounds",
    "clip.asymmetric": "eps_low bounds the ratio from below (1 - eps_low), eps_high from "
    "above (1 + eps_high): are they swapped?",
    "clip.clip_frac": "clip_frac = masked mean of ((ratio * A) > (clipped * A)) over "
    "completion tokens",
    "kl.nonnegative": "use k3 = exp(d) - d - 1 with d = logp_ref - logp_new, not the naive "
    "logp_new - logp_ref (which can be negative)",
    "kl.identical": "k3 must be exactly 0 when the two policies are equal",
    "kl.tracks_exact": "d = logp_ref - logp_new (not logp_new - logp_ref): only that sign "
    "makes the k3 mean over samples of the new policy equal KL(new || ref)",
    "norm.aggregation": "sequence-mean is ((x * m).sum(1) / m.sum(1).clamp(min=1)).mean(); "
    "token-mean is (x * m).sum() / m.sum(); constant is (x * m).sum() / (B * L)",
    "norm.masked_gradient": "mask = completion_mask[:, 1:] (not attention_mask): prompt and "
    "padding tokens must carry no gradient",
    "loss.finite": "the loss must be a finite scalar on a real batch",
    "loss.metrics": "metrics are means over completion tokens only (mask them), and loss is "
    "the value returned",
    "loss.sgd_direction": "minimising the loss must raise the log-probs of positive-advantage "
    "completions: check the sign of per_token",
    "engine.agreement": "the engine and the trainer must compute log-probs the same way: "
    "same temperature, same weights (sync after each update), same dtype",
    "rewards.variance": "no group has reward variance: every advantage is 0 and nothing is "
    "learned; make the task easier/harder or the reward denser",
    "gspo.ratio": "GSPO's ratio is exp of the MEAN of a sequence's token log-ratios (masked), "
    "one per sequence, clipped per sequence: exp of the sum shrinks long sequences to 0",
    "gspo.length_weighting": "a sequence-level loss is one value per sequence: with the "
    "sequence aggregation each sequence weighs the same; averaging the broadcast value over "
    "all tokens weighs long sequences more",
    "cispo.gradient": "CISPO: -sg(min(ratio, eps_high)) * A * logp_new: the capped ratio is "
    "detached, so d loss / d logp_new = -min(ratio, eps_high) * A on every token",
    "clip.delta": "two-sided clip: only the unclipped term's ratio is capped at delta: "
    "-min(min(ratio, delta) * A, clip(ratio) * A)",
    "clip.dual_clip": "dual-clip bounds only negative advantages: where A < 0, loss = "
    "min(ppo_loss, -A * dual_clip); positive advantages are untouched",
    "kl.convention": "the declared KL: estimator (k1 = -d, k2 = d^2/2, k3 = exp(d) - d - 1 with "
    "d = ref - new), clamp, and for use_bias_correction_kl the KL times the importance ratio",
    "engine.is_weights": "importance weights pi_trainer / pi_engine = exp(logp_trainer - "
    "logp_engine); per sequence: exp of the summed log-ratio; truncate caps, mask zeroes above "
    "the cap",
    "dynamic_sampling.normaliser": "drop (do not just zero) the groups whose rewards do not vary: "
    "kept, their tokens still count in the loss's normaliser and dilute every gradient",
    "truncation.mask": "mask_truncated_completions: zero the loss mask of the rows that hit "
    "max_completion_length (truncated), and only those",
    "entropy.bonus": "the entropy bonus is SUBTRACTED from the loss (loss - coef * entropy), "
    "aggregated like the rest: minimising the loss then raises the entropy",
    "entropy.values": "entropy = -sum_v p_v log p_v of softmax(logits / T) at each completion "
    "position, in float32",
    "memory.worst_case": "the longest possible batch does not fit: lower "
    "max_completion_length or the minibatch size",
    "rewards.reference": "a reward gives a probe more than the right answer: it must compare the "
    "completion's final answer with the row's reference (the 'answer' column)",
    "rewards.wrong_answer": "a reward accepts a wrong final answer: compare the final answer "
    "as written (the last number, \\boxed{} or ####) with the reference, not any number the "
    "completion contains",
    "rewards.echo": "a reward accepts the prompt echoed or the question restated: never "
    "evaluate an expression found in the completion (math-verify parses '88 + 22 =' as 110); "
    "compare the final answer as written",
    "rewards.no_answer": "a reward pays inaction: an empty or 'I don't know' completion gets "
    "more than a wrong answer (a default of 0 beside a penalty for wrong ones), so GRPO teaches "
    "the model to stop answering; give no answer at most what a wrong answer gets",
    "tokenizer.coverage": "the tokenizer cannot write these characters: the model reads <unk> "
    "(or nothing) where they stand and can never write an answer that has them, so every "
    "reward is flat; use a model whose tokenizer covers the task's text, or write the task in "
    "the symbols it has",
}


def _result(id: str, goal: int, what: str, measured, expected: str, passed: bool) -> CheckResult:
    return CheckResult(id, goal, what, measured, expected, bool(passed), HINTS.get(id, ""))


def _loss(
    impl: CoreFunctions,
    logp_new,
    logp_old,
    logp_ref,
    advantages,
    mask,
    s,
    beta=0.0,
    L=None,
    **extra,
):
    """The implementation's grpo_loss under the declared objective (its conventions passed
    where the function takes them), with `beta` and `L` for this check."""
    L = L or s.objective.max_completion_length or logp_new.shape[1]
    kwargs = s.objective.loss_kwargs() | {"beta": beta, "max_completion_length": L} | extra
    kwargs = core.accepted_kwargs(impl.grpo_loss, kwargs)
    return impl.grpo_loss(logp_new, logp_old, logp_ref, advantages, mask, **kwargs)


def _policy_kwargs(o: Objective) -> dict:
    """policy_loss's options the declared objective sets (beyond eps_low / eps_high)."""
    options = {
        "importance_sampling_level": o.importance_sampling_level,
        "loss": o.surrogate,
        "delta": o.delta,
        "dual_clip": o.dual_clip,
        "log_ratio_clamp": o.log_ratio_clamp,
    }
    defaults = core.LOSS_OPTION_DEFAULTS | {"loss": "clip"}
    return {k: v for k, v in options.items() if v != defaults[k]}


def _advantage_kwargs(o: Objective, lengths: torch.Tensor | None = None) -> dict:
    """group_advantages's keywords for the declared objective: eps, the conventions and the
    estimator (scale left at its default, the group's: the checks measure per-group
    statistics)."""
    kwargs = o.advantage_kwargs()
    del kwargs["scale"]  # the function's default: group
    if kwargs["eps"] == 1e-4:  # the seed's default: a function without eps is checked as before
        del kwargs["eps"]
    if o.advantage_estimator == "reinforce_pp" and lengths is not None:
        kwargs["lengths"] = lengths
    return kwargs


def _signed_advantages(B: int) -> torch.Tensor:
    """+1, -1, +1, ...: both signs in every group, independent of the advantage code."""
    return torch.tensor([1.0, -1.0] * (B // 2) + [1.0] * (B % 2))


def _distinct_signed_advantages(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """[B] +1, -1, +1, ... over the batch's DISTINCT sequences, copies of a sequence sharing
    its sign: a confident model samples one completion G times, and +1 and -1 on two copies
    of it cancel in the gradient exactly, leaving nothing for an SGD step to show. None when
    the batch holds one sequence only (no direction to measure)."""
    keys = [tuple((row * m).tolist()) for row, m in zip(input_ids, attention_mask, strict=True)]
    order = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    if len(order) < 2:
        return None
    return torch.tensor([1.0 if order[k] % 2 == 0 else -1.0 for k in keys])


def _max_abs(x: torch.Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


def _logits(model, input_ids, attention_mask) -> torch.Tensor:
    """The model's own logits at the positions that predict a token: [B, T-1, V]."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=core.position_ids(attention_mask),
    )
    return out.logits[:, :-1]


def _logprobs_of(logits, input_ids, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """log_softmax(logits / T) computed in `dtype`, at the sampled tokens: [B, T-1]."""
    logp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def float64_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    """(logp [B, T-1] float64, mask [B, T-1]) with the log-softmax in float64, zeros where
    masked; differentiable. The logits are the model's own, in its dtype: on a float64 copy
    of the model this is the float64 reference of the whole computation (the seed's code is
    not, even there: it casts the logits to float32 before its log-softmax)."""
    logits = _logits(model, input_ids, attention_mask)
    logp = _logprobs_of(logits, input_ids, temperature, torch.float64)
    mask = completion_mask[:, 1:].double()
    return logp * mask, mask


def _reference_logprobs(model, batch: PreflightBatch, temperature: float):
    """The log-softmax of the model's own logits in float64 (the reference) and in float32
    (the seed's plain path, what a correct implementation is held to): two [B, T-1]."""
    with torch.no_grad():
        logits = _logits(model, batch.input_ids, batch.attention_mask)
        return tuple(
            _logprobs_of(logits, batch.input_ids, temperature, dtype)
            for dtype in (torch.float64, torch.float32)
        )


# --- Agreement with float64 ----------------------------------------------------------------------
#
# An agreement check measures the path it checks, and a plain path of the same precision,
# against a float64 reference of the same model and batch, and fails when the checked path is
# materially further from float64 than the plain one. No fixed tolerance can do that: the
# rounding of a float32 computation grows with the model's depth, the batch's length and the
# size of the values, so a deeper model or a longer batch crosses any fixed bound, while a
# bound loose enough for every model misses a real loss of precision on a small one.

# Two correct computations in the same precision are about as far from float64 as each other:
# their largest errors over a batch differ by a factor of order 1 (measured: the chunked
# lm-head's log-probs 0.7-1.8x the seed's and its gradients 0.04-1x, on SmolLM2-135M and on
# the demo model; one pass vs micro-batches 1.1x). A lost precision costs the bits that a
# cancellation or a narrower type removes: 10x and far more (a log-sum-exp rounded to one
# float32 number, 10-20x on confident tokens; a bf16 log-softmax 1e4x; a missing shift or
# temperature is wrong in the first digit). 4 lies between the two with margin both ways.
PRECISION_FACTOR = 4.0
# Errors within a few units in the last place of the largest value compared are no evidence
# of anything (the plain path can be exact by luck, and no result is better than its own
# rounding).
FLOOR_ULPS = 4


def precision_tolerance(plain_err: float, largest: float, dtype: torch.dtype) -> float:
    """How far from float64 a checked path may be: PRECISION_FACTOR x the plain path's
    distance, plus FLOOR_ULPS units in the last place of `largest` in `dtype`."""
    return PRECISION_FACTOR * plain_err + FLOOR_ULPS * torch.finfo(dtype).eps * largest


def tolerance_text(tol: float, plain_err: float, plain: str, extra: str = "") -> str:
    what = f"{PRECISION_FACTOR:g} x {plain}'s {plain_err:.1e} + {FLOOR_ULPS} ulp{extra}"
    return f"<= {tol:.2g} ({what})"


def _unpadded_rows(batch: PreflightBatch) -> PreflightBatch:
    """The rows with no left padding (the longest prompts): there, any way of computing
    positions agrees, so a low-precision model cannot blur the comparison."""
    rows = batch.attention_mask[:, 0].bool().nonzero().flatten()[:8]
    return PreflightBatch(
        batch.input_ids[rows],
        batch.attention_mask[rows],
        batch.completion_mask[rows],
        batch.rewards[rows],
        batch.group_size,
    )


def _row_by_row(impl: CoreFunctions, model, batch: PreflightBatch, temperature: float):
    """The implementation's log-probs [B, T-1], one row per call. A batch lets it share a
    group's prompt forward, which rounds differently from the model's own forward (in bf16
    by whole units of the last place of the logits); alone, a row's logits are the model's,
    and what the log-prob checks compare is the log-softmax and its alignment alone."""
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask)
    rows = [impl.sequence_logprobs(model, *(a[i : i + 1] for a in args), temperature)[0]
            for i in range(batch.input_ids.shape[0])]  # fmt: skip
    return torch.cat(rows)


def check_logprobs(impl: CoreFunctions, model, batch: PreflightBatch, s: PreflightSettings):
    """Each against float64 and against the seed's float32 log-softmax of the same logits
    (the agreement criterion above); the values compared are float32 log-probs."""
    batch = _unpadded_rows(batch)
    comp = batch.completion_mask[:, 1:].bool()  # the true completion tokens, [B, T-1]
    reference, plain = _reference_logprobs(model, batch, 1.0)
    largest = _max_abs(reference[comp])
    with torch.no_grad():
        logp = _row_by_row(impl, model, batch, 1.0)
        # The model's own labels loss (it shifts internally), one row at a time: the mean
        # completion log-prob of a row is minus that loss. The loss is a float32 computation
        # too, with its own distance from float64: a correct implementation may be as far from
        # it as that distance plus its own allowance.
        gaps, plain_gaps, loss_gaps = [], [], []
        for i in range(batch.input_ids.shape[0]):
            keep = batch.attention_mask[i].bool()
            labels = batch.input_ids[i][keep].masked_fill(batch.completion_mask[i][keep] == 0, -100)
            ce = model(input_ids=batch.input_ids[i][keep][None], labels=labels[None]).loss.item()
            exact = reference[i][comp[i]].mean().item()
            gaps.append(abs(logp[i][comp[i]].double().mean().item() + ce))
            plain_gaps.append(abs(plain[i][comp[i]].double().mean().item() - exact))
            loss_gaps.append(abs(ce + exact))
    shift_gap, plain_gap, loss_gap = max(gaps), max(plain_gaps), max(loss_gaps)
    # Its own distance from float64 at T = 1: what its logits path (the fused lm-head's
    # chunks round differently from the model's head) costs before any temperature.
    own_gap = _max_abs((logp.double() - reference)[comp])
    tol = precision_tolerance(plain_gap, largest, torch.float32) + loss_gap
    yield _result(
        "logprobs.shift",
        1,
        "max |mean completion logp + model's labels CE| per row",
        shift_gap,
        tolerance_text(tol, plain_gap, "float32 log-softmax", f" + the loss's {loss_gap:.1e}"),
        shift_gap <= tol,
    )

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        logp_bf16 = _row_by_row(impl, bf16, batch, 1.0)
    reference, _ = _reference_logprobs(bf16, batch, 1.0)
    del bf16
    gap = _max_abs((logp_bf16.double() - reference)[comp])
    # Not the gap: another forward of a bf16 model (a batch instead of one row, another CPU's
    # kernels) rounds its logits differently, by up to ~1e-3, hiding the bug's ~1e-2. What
    # shows the bug on any path: a bf16 log-softmax returns values on bf16's grid (8
    # significant bits), where float32 arithmetic lands only by chance (a few percent of the
    # values with |logp| > 1e-2).
    values = logp_bf16[comp & (logp_bf16.abs() > 1e-2)].float()
    on_grid = (values == values.bfloat16().float()).double().mean().item() if len(values) else 0.0
    ok = logp_bf16.dtype == torch.float32 and on_grid < 0.5
    yield _result(
        "logprobs.float32",
        1,
        f"bf16 model: dtype {str(logp_bf16.dtype).removeprefix('torch.')}, share of log-probs "
        f"on the bf16 grid (max gap to float64 {gap:.1e})",
        on_grid,
        "float32, < 0.5",
        ok,
    )

    temperature = s.objective.temperature if s.objective.temperature != 1.0 else 0.7
    with torch.no_grad():
        logp_t = _row_by_row(impl, model, batch, temperature)
    reference, plain = _reference_logprobs(model, batch, temperature)
    gap = _max_abs((logp_t.double() - reference)[comp])
    plain_gap = _max_abs((plain.double() - reference)[comp])
    # The logits' rounding is divided by T with them: at T its share of the gap is the gap at
    # T = 1 over T. A missing or misapplied temperature is wrong in the first digit.
    baseline = max(plain_gap, own_gap / temperature)
    tol = precision_tolerance(baseline, _max_abs(reference[comp]), torch.float32)
    yield _result(
        "logprobs.temperature",
        1,
        f"max gap to softmax(logits / {temperature:g}) in float64 (at T = 1: {own_gap:.1e})",
        gap,
        tolerance_text(tol, baseline, "max(float32 log-softmax, its own gap at T = 1 / T)"),
        gap <= tol,
    )


def _reference_advantages(
    rewards: torch.Tensor, G: int, o: Objective, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 advantages of the declared convention and estimator (scale: group)."""
    r = rewards.double().view(-1, G)
    centred = r - r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=o.advantage_std == "sample", keepdim=True)
    if o.advantage_estimator == "rloo":
        others = (r.sum(dim=1, keepdim=True) - r) / (G - 1)  # the group without the sample
        adv = r - others
    elif o.advantage_estimator == "reinforce_pp":
        w = torch.ones_like(centred) if lengths is None else lengths.double().view_as(r)
        mean = (w * centred).sum() / w.sum()
        var = (w * (centred - mean) ** 2).sum() / w.sum()
        if o.advantage_std == "sample":
            var = var * w.sum() / (w.sum() - 1)
        adv = (centred - mean) / torch.sqrt(var + core.WHITEN_EPS)
    else:  # a flat group with eps = 0 is 0 / 0: 0, as group_advantages defines it
        scale = std + o.advantage_eps
        adv = torch.where(scale > 0, centred / scale.clamp(min=1e-300), torch.zeros_like(centred))
    if o.zero_std_guard:
        adv = torch.where(std > o.advantage_eps, adv, torch.zeros_like(adv))
    return adv.view(-1)


# The designed rewards: small G (so population and sample std differ by sqrt(G/(G-1))),
# an all-equal group, a float-noise group, and groups that an interleaved reading would mix.
DESIGNED_REWARDS = (
    1.0,
    0.0,
    0.0,
    0.0,
    1,
    1,
    1,
    1,
    0.5,
    0.5 + 1e-9,
    0.5,
    0.5 + 1e-9,
    0,
    0.25,
    0.5,
    2,
)
DESIGNED_LENGTHS = (3.0, 1, 5, 2, 4, 4, 1, 6, 2, 2, 3, 3, 1, 5, 2, 4)  # completion tokens


def _group_preserving_permutation(B: int, G: int) -> torch.Tensor:
    """[B] indices: the groups of G contiguous samples in another order (reversed), and the
    samples inside group k rotated by k + 1, so that no reading of the groups but the
    contiguous one (an interleaved view(G, -1) mixes them) keeps its groups."""
    groups = torch.arange(B).view(-1, G).flip(0)
    return torch.stack([g.roll(k + 1) for k, g in enumerate(groups)]).flatten()


def advantage_ids(o: Objective) -> tuple[str, ...]:
    """The advantage checks for the declared objective, in the order they run."""
    ids = ["advantages.contiguous", "advantages.group_sums"]
    if o.advantage_estimator == "grpo":
        ids.append(f"advantages.{o.advantage_std}_std")
    ids += ["advantages.zero_std_groups"]
    if o.advantage_estimator != "grpo":
        ids.append("advantages.estimator")
    return tuple(ids)


def check_advantages(impl: CoreFunctions, batch: PreflightBatch, s: PreflightSettings):
    o, G = s.objective, batch.group_size
    lengths = batch.completion_mask.sum(dim=1).double()

    def advantages(rewards, group_size, lens):
        kwargs = core.accepted_kwargs(impl.group_advantages, _advantage_kwargs(o, lens))
        return impl.group_advantages(rewards, group_size, **kwargs).double()

    real = advantages(batch.rewards, G, lengths)
    designed = torch.tensor(DESIGNED_REWARDS, dtype=torch.float64)
    designed_lengths = torch.tensor(DESIGNED_LENGTHS, dtype=torch.float64)
    adv = advantages(designed, 4, designed_lengths)
    ref = _reference_advantages(designed, 4, o, designed_lengths)
    ref_real = _reference_advantages(batch.rewards, G, o, lengths)

    # The layout, whatever the convention: the samples of a group contiguous, so that
    # reordering the groups, and the samples inside each group, reorders the advantages alike.
    perm = _group_preserving_permutation(designed.numel(), 4)
    gap = _max_abs(advantages(designed[perm], 4, designed_lengths[perm]) - adv[perm])
    yield _result(
        "advantages.contiguous",
        2,
        "max |adv(reordered) - adv reordered|, groups and the samples inside each reordered "
        "(group i = samples [i*G, (i+1)*G))",
        gap,
        "<= 1e-6",
        gap <= 1e-6,
    )

    sums = max(
        _max_abs(real.view(-1, G).sum(1) - ref_real.view(-1, G).sum(1)),
        _max_abs(adv.view(-1, 4).sum(1) - ref.view(-1, 4).sum(1)),
    )
    yield _result(
        "advantages.group_sums",
        2,
        "max |sum of a group's advantages|"
        + ("" if o.advantage_estimator != "reinforce_pp" else " - the whitened reference's"),
        sums,
        "<= 1e-4",
        sums <= 1e-4,
    )

    if o.advantage_estimator == "grpo":
        live = torch.tensor([0, 3])  # groups with real spread in the designed batch
        unbiased = o.advantage_std == "sample"
        stds = adv.view(-1, 4)[live].std(dim=1, unbiased=unbiased)
        # 1 when eps is far below the group's std: std / (std + eps) in general
        expected_stds = ref.view(-1, 4)[live].std(dim=1, unbiased=unbiased)
        dev = _max_abs(stds - expected_stds)
        yield _result(
            f"advantages.{o.advantage_std}_std",
            2,
            f"max |{o.advantage_std} std of a group's advantages - 1| (G = 4; declared "
            f"{o.advantage_std} std, profile {o.profile})",
            dev,
            "<= 1e-2",
            dev <= 1e-2,
        )

    yield _zero_std_groups(adv, ref, o)

    if o.advantage_estimator != "grpo":
        gap = _max_abs(adv - ref)
        yield _result(
            "advantages.estimator",
            2,
            f"max |adv - the {o.advantage_estimator} reference| (G = 4, unequal lengths)",
            gap,
            "<= 1e-6",
            gap <= 1e-6,
        )


def _zero_std_groups(adv: torch.Tensor, ref: torch.Tensor, o) -> CheckResult:
    """advantages.zero_std_groups on the designed batch (G = 4): its equal-reward group and
    its 1e-9-noise group, against the reference under the objective's guard."""
    flat = adv.view(-1, 4)[1:3]  # the equal-reward group and the 1e-9-noise group
    if o.zero_std_guard and _max_abs(ref.view(-1, 4)[1:3]) == 0.0:
        worst = _max_abs(flat)
        what, expected, ok = "max |adv|", "== 0 exactly", worst == 0.0
    elif o.zero_std_guard:  # eps below the noise's std: the guard keeps that group
        worst = _max_abs(flat - ref.view(-1, 4)[1:3])
        what, expected = f"max |adv - the guarded reference| (eps {o.advantage_eps:g})", "<= 1e-6"
        ok = worst <= 1e-6 and _max_abs(adv.view(-1, 4)[1]) == 0.0
    else:
        worst = _max_abs(flat - ref.view(-1, 4)[1:3])
        what, expected = "max |adv - (r - mean) / (std + eps)| (no zero-std guard)", "<= 1e-6"
        ok = worst <= 1e-6
        if o.advantage_estimator != "reinforce_pp":  # whitening moves every group
            ok = ok and _max_abs(adv.view(-1, 4)[1]) == 0.0
    return _result(
        "advantages.zero_std_groups",
        2,
        f"{what} in an equal-reward group and a 1e-9-noise group",
        worst,
        expected,
        ok,
    )


# Rows out of the vote (no function could score them, or out of the loss) with rewards that
# would move their group's mean and std if they voted; 3 valid rows in every group, so the
# reference is the declared convention on the valid rows with G = 3 (NeMo-RL PR #4160's
# [1, 0, 0] + a masked row: [0.667, -0.333, -0.333] mean-centred).
EXCLUDED_REWARDS = (1.0, 0.0, 0.0, 5.0, -3.0, 0.5, 1.0, 0.0, 0.25, 0.25, 0.25, 1.0)  # binary-exact
EXCLUDED_VALID = (1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0)


def check_excluded_rows(impl: CoreFunctions, s: PreflightSettings):
    """advantages.excluded_rows: rows given valid=False do not vote in their group's
    statistics and get advantage exactly 0 (TRL PR #5902; NeMo-RL PR #4160)."""
    o = s.objective
    rewards = torch.tensor(EXCLUDED_REWARDS, dtype=torch.float64)
    valid = torch.tensor(EXCLUDED_VALID, dtype=torch.bool)
    lengths = torch.tensor(DESIGNED_LENGTHS[:12], dtype=torch.float64)
    kwargs = core.accepted_kwargs(impl.group_advantages, _advantage_kwargs(o, lengths))
    adv = impl.group_advantages(rewards, 4, valid=valid, **kwargs).double()
    ref = torch.zeros_like(rewards)
    ref[valid] = _reference_advantages(rewards[valid], 3, o, lengths[valid])
    gap = _max_abs(adv - ref)
    leaked = _max_abs(adv[~valid])
    yield _result(
        "advantages.excluded_rows",
        2,
        "max |adv - the reference over the valid rows only| (G = 4, 3 valid per group); "
        f"excluded rows' max |adv| {leaked:.3g}",
        gap,
        "<= 1e-6, excluded rows exactly 0",
        gap <= 1e-6 and leaked == 0.0,
    )


def check_ratio(impl: CoreFunctions, model, batch: PreflightBatch, s: PreflightSettings):
    batch = grad_rows(batch, s)
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask, s.objective.temperature)
    # Both forwards in train mode, as the trainer runs them: dropout left on would show here.
    model.train()
    with torch.no_grad():
        logp_old, _ = impl.sequence_logprobs(model, *args)  # an extra forward
    logp_new, mask = impl.sequence_logprobs(model, *args)  # the first inner step, with grad
    model.eval()
    valid = batch.completion_mask[:, 1:].bool()
    dev = _max_abs(torch.exp(logp_new.detach() - logp_old)[valid] - 1)
    advantages = _signed_advantages(batch.input_ids.shape[0])
    _, metrics = _loss(impl, logp_new, logp_old, None, advantages, mask, s)
    dev = max(dev, abs(float(metrics["ratio_mean"]) - 1))
    yield _result(
        "ratio.initial",
        3,
        "max |ratio - 1| on the first inner step (and |ratio_mean - 1|)",
        dev,
        "<= 1e-3",
        dev <= 1e-3,
    )
    if batch.engine_logprobs is not None:
        gaps = (batch.engine_logprobs.double() - logp_old.double())[valid].abs()
        worst = gaps.max().item() if gaps.numel() else 0.0
        tol, bound = s.engine_gap_max, f"<= {s.engine_gap_max:g}"
        if s.precision.bf16:
            plain = _plain_bf16_gap(model, args, logp_old, valid)
            tol = precision_tolerance(plain, _max_abs(logp_old[valid]), torch.bfloat16)
            bound = tolerance_text(tol, plain, "a plain bf16 autocast forward")
        yield _result(
            "engine.agreement",
            0,
            f"engine vs trainer float32 logp: max gap (mean {gaps.mean().item():.2e})",
            worst,
            bound,
            worst <= tol,
        )


@torch.no_grad()
def _plain_bf16_gap(model, args: tuple, logp: torch.Tensor, valid: torch.Tensor) -> float:
    """Max |log-prob| distance of the seed's log-probs under plain bf16 autocast from the
    float32 `logp` [B, T-1]: how far a bf16 engine may be from the trainer's float32."""
    with eval_mode(model), torch.autocast(args[0].device.type, dtype=torch.bfloat16):
        plain, _ = core.sequence_logprobs(model, *args)
    return _max_abs((plain.double() - logp.double())[valid])


# Probe log-ratios keep this far from every bound of the objective: far above the rounding of
# a float32 log-prob difference (~3e-7 at |logp| <= 3), so clipped or not is never a float tie.
PROBE_MARGIN = 1e-4


def log_ratio_bounds(o: Objective) -> list[float]:
    """Every log-ratio at which the configured surrogate changes branch (sorted): the clip's
    1 - eps and 1 + eps_high (CISPO: its cap), delta, dual-clip's c, the log-ratio clamp."""
    if o.surrogate == "cispo":
        ratios = [o.epsilon_high]
    else:
        ratios = [1 - o.epsilon, 1 + o.epsilon_high]
        ratios += [b for b in (o.delta, o.dual_clip) if b is not None]
    bounds = [math.log(r) for r in ratios if r > 0]
    if o.log_ratio_clamp is not None:
        bounds += [-o.log_ratio_clamp, o.log_ratio_clamp]
    return sorted(set(bounds))


def placed_log_ratio(x: float, bounds: list[float], margin: float = PROBE_MARGIN) -> float:
    """x moved off every bound: a probe nearer than margin to one goes to margin beyond it on
    the side it lies on (above it when exactly on it), past any bound that is as near."""
    for _ in range(len(bounds) + 1):
        near = [b for b in bounds if abs(x - b) < margin]
        if not near:
            return x
        b = near[0]
        x = b + margin * 1.5 if x >= b else b - margin * 1.5
    return x


def placed_log_ratios(log_ratios: torch.Tensor, o: Objective) -> torch.Tensor:
    """[B, T] float64 log-ratios, each placed off the objective's bounds."""
    bounds = log_ratio_bounds(o)
    out = [placed_log_ratio(float(x), bounds) for x in log_ratios.flatten()]
    return torch.tensor(out, dtype=torch.float64).view(log_ratios.shape)


def _clip_case(s: PreflightSettings):
    """Ratios on both sides of both clip bounds, for both signs of the advantage, [4, 8]:
    placed in log-ratio (never negative, never on a bound)."""
    o = s.objective
    lo, hi = math.log(max(1 - o.epsilon, 1e-6)), math.log1p(o.epsilon_high)
    # between 1 + min(eps) and 1 + max(eps), and between 1 - max(eps) and 1 - min(eps)
    # (CISPO's epsilon_high is a cap > 1: keep that ratio positive)
    mid_hi = math.log1p((o.epsilon + o.epsilon_high) / 2)
    mid_lo = math.log(max(1 - (o.epsilon + o.epsilon_high) / 2, 0.05))
    l9, l95, l105, l11 = (math.log(r) for r in (0.9, 0.95, 1.05, 1.1))
    rows = [
        [0.0, l105, hi + 0.1, hi + 0.4, lo - 0.1, l95, mid_hi, mid_lo],
        [0.0, l105, hi + 0.1, hi + 0.4, lo - 0.1, l95, mid_hi, mid_lo],
        [l9, l11, hi + 0.2, lo - 0.05, lo - 0.3, 0.0, mid_hi, mid_lo],
        [l9, l11, hi + 0.2, lo - 0.05, lo - 0.3, 0.0, mid_hi, mid_lo],
    ]
    log_ratios = placed_log_ratios(torch.tensor(rows, dtype=torch.float64), o)
    logp_old = -torch.linspace(0.5, 3.0, 32, dtype=torch.float64).view(4, 8)
    logp_new = logp_old + log_ratios
    advantages = torch.tensor([1.0, -1.0, 0.7, -1.3], dtype=torch.float64)
    mask = torch.ones(4, 8, dtype=torch.float64)
    mask[2, 6:] = 0  # padding at the end of one row
    return logp_new.float(), logp_old.float(), advantages.float(), mask.float()


def _reference_policy(logp_new, logp_old, adv, mask, o: Objective):
    """float64 per-token loss [B, T] of the declared surrogate (differentiable w.r.t.
    logp_new), and the tokens where its clip (CISPO: its cap with A > 0) is active."""
    new, valid = logp_new.double(), mask.bool()
    ratio = _reference_ratio(new, logp_old, mask, o)
    A = adv.double().unsqueeze(1)
    if o.surrogate == "cispo":
        weight = ratio.clamp(max=o.epsilon_high).detach()
        per_token = -weight * A * torch.where(valid, new, torch.zeros_like(new))
        active = (ratio > o.epsilon_high) & (A > 0)
    else:
        clipped = ratio.clamp(1 - o.epsilon, 1 + o.epsilon_high)
        unclipped = ratio if o.delta is None else ratio.clamp(max=o.delta)
        per_token = -torch.min(unclipped * A, clipped * A)
        if o.dual_clip is not None:
            per_token = torch.where(A < 0, torch.min(per_token, -A * o.dual_clip), per_token)
        active = (ratio * A) > (clipped * A)
    return per_token.expand_as(new), active.expand_as(new) & valid


def _policy(impl: CoreFunctions, logp_new, logp_old, adv, mask, o: Objective):
    kwargs = core.accepted_kwargs(impl.policy_loss, _policy_kwargs(o))
    return impl.policy_loss(logp_new, logp_old, adv, mask, o.epsilon, o.epsilon_high, **kwargs)


def _values_and_grads(impl, o: Objective, logp_new, logp_old, adv, mask):
    """(per_token, clip_frac, grad) of the implementation and (per_token, active, grad) of
    the float64 reference, grads of the masked per-token sum w.r.t. logp_new."""
    new = logp_new.clone().requires_grad_(True)
    per_token, clip_frac = _policy(impl, new, logp_old, adv, mask, o)
    (per_token * mask).sum().backward()
    ref_new = logp_new.double().clone().requires_grad_(True)
    ref, active = _reference_policy(ref_new, logp_old, adv, mask, o)
    (ref * mask.double()).sum().backward()
    return (per_token.detach(), clip_frac, new.grad), (ref.detach(), active, ref_new.grad)


def check_clip(impl: CoreFunctions, s: PreflightSettings):
    o = s.objective
    logp_new, logp_old, adv, mask = _clip_case(s)
    (per_token, clip_frac, grad), (ref, clipped, ref_grad) = _values_and_grads(
        impl, o, logp_new, logp_old, adv, mask
    )
    valid = mask.bool()
    # Tokens whose ratio lies between the two bounds: clipped or not depends on which eps is
    # applied on which side. clip.asymmetric judges them; the other checks judge the rest,
    # whose treatment no assignment of the two eps changes (so each measures its own thing).
    r = torch.exp(logp_new.double() - logp_old.double())  # [4, 8]
    small, large = sorted((o.epsilon, o.epsilon_high))
    between = valid & (
        ((r >= 1 - large) & (r <= 1 - small)) | ((r >= 1 + small) & (r <= 1 + large))
    )
    outside = valid & ~between
    gap = _max_abs((per_token.double() - ref)[outside])
    yield _result(
        "clip.values",
        4,
        "max |per_token - (-min(r*A, clip(r)*A))| on a perturbed policy, both signs of A "
        "(ratios off the band between the two bounds)",
        gap,
        "<= 1e-5",
        gap <= 1e-5,
    )
    zero = outside & (ref_grad == 0)  # where the declared loss is flat: the clip is active
    clipped_grad = _max_abs(grad[zero])
    live = outside & ~zero
    min_live = grad[live].abs().min().item() if live.any() else 1.0
    yield _result(
        "clip.gradient",
        4,
        f"max |grad| on clipped tokens (min |grad| elsewhere {min_live:.2g})",
        clipped_grad,
        "== 0 on clipped, != 0 elsewhere",
        clipped_grad == 0.0 and min_live > 0,
    )
    mismatch = int(((per_token.double() - ref).abs() > 1e-5)[between].sum())
    yield _result(
        "clip.asymmetric",
        4,
        f"tokens between 1+-eps_low and 1+-eps_high treated wrongly (eps {o.epsilon:g}/"
        f"{o.epsilon_high:g})",
        mismatch,
        "0",
        mismatch == 0,
    )
    direct = clipped.double().sum().item() / valid.sum().item()
    gap = abs(float(clip_frac) - direct)
    yield _result(
        "clip.clip_frac",
        4,
        f"|clip_frac - direct count| (direct {direct:.3f})",
        gap,
        "<= 1e-6",
        gap <= 1e-6,
    )
    yield from _option_checks(impl, s)


def clip_ids(o: Objective) -> tuple[str, ...]:
    ids = ["clip.values", "clip.gradient", "clip.asymmetric", "clip.clip_frac"]
    if o.importance_sampling_level == "sequence":
        ids += ["gspo.ratio", "gspo.length_weighting"]
    if o.surrogate == "cispo":
        ids.append("cispo.gradient")
    if o.delta is not None:
        ids.append("clip.delta")
    if o.dual_clip is not None:
        ids.append("clip.dual_clip")
    return tuple(ids)


def _ratio_case(
    ratios: list[list[float]], advantages: list[float], lengths: list[int], o: Objective
):
    """logp_new, logp_old, advantages, mask for the given per-token ratios [B, T], each placed
    off the objective's bounds (under GSPO: each row's mean log-ratio); row i has lengths[i]
    completion tokens (the rest padding)."""
    log_r = placed_log_ratios(torch.log(torch.tensor(ratios, dtype=torch.float64)), o)
    B, T = log_r.shape
    logp_old = -torch.linspace(0.4, 2.5, B * T, dtype=torch.float64).view(B, T)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).double()
    if o.importance_sampling_level == "sequence":
        mean = (log_r * mask).sum(1) / mask.sum(1)
        bounds = log_ratio_bounds(o)
        shift = torch.tensor([placed_log_ratio(float(m), bounds) - float(m) for m in mean])
        log_r = log_r + shift.double()[:, None]
    logp_new = logp_old + log_r
    A = torch.tensor(advantages, dtype=torch.float64)
    return logp_new.float(), logp_old.float(), A.float(), mask.float()


def _option_checks(impl: CoreFunctions, s: PreflightSettings):
    """The menu's options on the clipped surrogate, each on a case where it acts."""
    o = s.objective
    if o.importance_sampling_level == "sequence":
        yield from _gspo_checks(impl, s)
    if o.surrogate == "cispo":
        # Ratios below and above the cap, both signs of A.
        hi = o.epsilon_high
        case = _ratio_case(
            [[0.5, 1.0, hi * 0.9, hi * 1.5], [0.7, 1.3, hi * 1.2, 2.0]], [0.8, -1.1], [4, 3], o
        )
        (_, _, grad), (_, _, ref_grad) = _values_and_grads(impl, o, *case)
        gap = _max_abs((grad.double() - ref_grad)[case[3].bool()])
        yield _result(
            "cispo.gradient",
            4,
            "max |d loss / d logp_new - (-min(ratio, eps_high) * A)| per token",
            gap,
            "<= 1e-5",
            gap <= 1e-5,
        )
    for name, bound in (("delta", o.delta), ("dual_clip", o.dual_clip)):
        if bound is None:
            continue
        # Ratios around the bound with A < 0 (where both act) and A > 0 (where neither may).
        case = _ratio_case(
            [[bound - 0.3, bound + 0.5, 1.0, 0.5], [bound - 0.3, bound + 0.5, 1.1, 0.9]],
            [-1.0, 0.7],
            [4, 4],
            o,
        )
        (values, _, grad), (ref, _, ref_grad) = _values_and_grads(impl, o, *case)
        gap = max(_max_abs(values.double() - ref), _max_abs(grad.double() - ref_grad))
        yield _result(
            f"clip.{name}",
            4,
            f"max |per_token or its grad - reference| around {name} = {bound:g}, both signs of A",
            gap,
            "<= 1e-5",
            gap <= 1e-5,
        )


def _gspo_checks(impl: CoreFunctions, s: PreflightSettings):
    o = s.objective
    # Unequal lengths; ratios whose per-sequence geometric mean is inside the clip range for
    # one row and outside for the other.
    case = _ratio_case(
        [
            [1.1, 0.95, 1.05, 1.0, 1.02, 0.98],
            [1.6, 1.4, 1.5, 1.0, 1.0, 1.0],
            [0.9, 1.1, 1, 1, 1, 1],
        ],
        [1.0, 1.0, -0.5],
        [6, 3, 2],
        o,
    )
    (values, _, _), (ref, _, _) = _values_and_grads(impl, o, *case)
    gap = _max_abs((values.double() - ref)[case[3].bool()])
    yield _result(
        "gspo.ratio",
        4,
        "max |per_token - sequence-level clipped surrogate (exp of the mean log-ratio)|",
        gap,
        "<= 1e-5",
        gap <= 1e-5,
    )
    logp_new, logp_old, adv, mask = case
    new = logp_new.clone().requires_grad_(True)
    loss, _ = _loss(impl, new, logp_old, None, adv, mask, s, L=mask.shape[1])
    torch.as_tensor(loss).backward()
    ref_new = logp_new.double().clone().requires_grad_(True)
    per_token, _ = _reference_policy(ref_new, logp_old, adv, mask, o)
    L = o.max_completion_length or mask.shape[1]
    core.aggregate(per_token, mask.double(), o.aggregation, L).backward()
    gap = max(
        abs(
            float(loss) - float(core.aggregate(per_token.detach(), mask.double(), o.aggregation, L))
        ),
        _max_abs(new.grad.double() - ref_new.grad),
    )
    yield _result(
        "gspo.length_weighting",
        4,
        f"max |loss or its grad - sequence-level loss under {o.aggregation} aggregation| "
        "(lengths 6, 3, 2)",
        gap,
        "<= 1e-5",
        gap <= 1e-5,
    )


def check_kl(impl: CoreFunctions, model, batch: PreflightBatch, s: PreflightSettings):
    g = torch.Generator().manual_seed(s.seed)
    # Real next-token distributions of the user's model at a few completion positions (the
    # new policy), and a perturbed copy (the reference policy): [4, V] each.
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids[:4],
            attention_mask=batch.attention_mask[:4],
            position_ids=core.position_ids(batch.attention_mask[:4]),
        ).logits[:, :-1]
        rows = logits[batch.completion_mask[:4, 1:].bool()][:4].double()  # [4, V]
    noise = torch.randn(rows.shape, generator=g, dtype=torch.float64)
    logp_new = torch.log_softmax(rows, -1)
    logp_ref = torch.log_softmax(rows + noise, -1)

    kl = impl.kl_k3(logp_new, logp_ref)  # every token of the vocabulary, [4, V]
    lowest = kl.min().item()
    yield _result(
        "kl.nonnegative", 5, "min KL estimate over the vocabulary", lowest, ">= 0", lowest >= -1e-9
    )
    same = _max_abs(impl.kl_k3(logp_new, logp_new))
    yield _result("kl.identical", 5, "max |KL| for identical policies", same, "== 0", same <= 1e-9)

    # The estimator's mean over samples of the new policy, in the limit of infinitely many
    # samples: sum_v p_new(v) * estimate(v). Only k3 with d = ref - new gives KL(new || ref).
    exact = (logp_new.exp() * (logp_new - logp_ref)).sum(-1)  # [4]
    expected_estimate = (logp_new.exp() * kl.double()).sum(-1)  # [4]
    rel = ((expected_estimate - exact).abs() / exact.clamp(min=1e-12)).max().item()
    idx = torch.multinomial(logp_new.exp(), 4096, replacement=True, generator=g)  # [4, n]
    mc = impl.kl_k3(logp_new.gather(1, idx), logp_ref.gather(1, idx)).double().mean().item()
    yield _result(
        "kl.tracks_exact",
        5,
        f"max relative gap of E_p[estimate] to the exact KL (KL {exact.mean().item():.3f}, "
        f"4096-sample mean {mc:.3f})",
        rel,
        "<= 1e-3",
        rel <= 1e-3,
    )


UNEQUAL_LENGTHS = (6, 1, 3, 4)


def unequal_lengths_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random per-token values [4, 6] and a mask of UNEQUAL_LENGTHS completion tokens: the
    case where sequence-, token- and constant-normalised losses all differ."""
    per_token = torch.randn(4, 6, generator=g)
    mask = torch.zeros(4, 6)
    for i, n in enumerate(UNEQUAL_LENGTHS):
        mask[i, :n] = 1
    return per_token, mask


def check_normalisation(impl: CoreFunctions, model, batch: PreflightBatch, s: PreflightSettings):
    g = torch.Generator().manual_seed(s.seed)
    per_token, mask = unequal_lengths_batch(g)
    L = s.objective.max_completion_length or 8
    values = {}
    for mode in core.AGGREGATIONS:
        values[mode] = float(core.aggregate(per_token, mask, mode, L))
    declared = s.objective.aggregation
    got = float(impl.aggregate(per_token, mask, s.objective.loss_type, L))
    # The assembled loss must use the same normaliser: at ratio 1 with A_i = -(i + 1) the
    # per-token values of row i are all i + 1, so only the normaliser decides the value.
    logp = torch.log(torch.rand(4, 6, generator=g) * 0.5 + 0.25)
    advantages = -torch.arange(1.0, 5.0)
    loss, _ = _loss(impl, logp, logp, None, advantages, mask, s, L=L)
    per_token, _ = _reference_policy(logp, logp, advantages, mask, s.objective)
    expected_loss = float(core.aggregate(per_token.detach(), mask.double(), declared, L))
    gap = max(abs(got - values[declared]), abs(float(loss) - expected_loss))
    others = ", ".join(f"{m} {v:.3f}" for m, v in values.items() if m != declared)
    yield _result(
        "norm.aggregation",
        6,
        f"|loss - {declared}-mean| on unequal lengths ({others})",
        gap,
        "<= 1e-5",
        gap <= 1e-5,
    )

    # The loss's gradient with respect to the log-probs: the model's backward adds nothing
    # to it, so the log-probs are a leaf here.
    with torch.no_grad():
        logp, mask = impl.sequence_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.completion_mask,
            s.objective.temperature,
        )
    logp_new = logp.detach().requires_grad_()
    advantages = _signed_advantages(batch.input_ids.shape[0])
    loss, _ = _loss(impl, logp_new, logp_new.detach(), None, advantages, mask, s)
    loss.backward()
    outside = ~batch.completion_mask[:, 1:].bool()
    leak = _max_abs(logp_new.grad[outside])
    yield _result(
        "norm.masked_gradient",
        6,
        "max |d loss / d logp| on prompt and padding positions",
        leak,
        "== 0",
        leak == 0.0,
    )


def _loss_and_grad(impl, logp_new, logp_old, logp_ref, adv, mask, s):
    """(loss, d loss / d logp_new) of the implementation with KL on, float64 inputs."""
    new = logp_new.detach().clone().requires_grad_(True)
    loss, _ = _loss(impl, new, logp_old, logp_ref, adv, mask, s, beta=0.04, L=8)
    loss = torch.as_tensor(loss)
    (grad,) = torch.autograd.grad(loss, new, allow_unused=True)
    return loss.detach().double(), torch.zeros_like(new) if grad is None else grad.double()


def check_masked_nan(impl: CoreFunctions, s: PreflightSettings):
    """loss.masked_nan: NaN planted in the masked slots of logp_old, logp_ref and logp_new
    (padding a gather or an engine can fill with anything) leaves the loss and its gradient
    what they are without it (OpenRLHF PR #1240: NaN * 0 = NaN)."""
    logp_new, logp_old, adv, mask = _clip_case(s)
    mask = mask.clone()
    mask[0, 5:], mask[3, 2:4] = 0, 0  # padding at the end, and a hole (a tool's tokens)
    g = torch.Generator().manual_seed(s.seed + 2)
    logp_ref = logp_old + 0.3 * torch.randn(logp_old.shape, generator=g, dtype=torch.float64)
    clean = _loss_and_grad(impl, logp_new, logp_old, logp_ref, adv, mask, s)
    hole = ~mask.bool()
    poisoned = [torch.where(hole, torch.nan, t) for t in (logp_new, logp_old, logp_ref)]
    loss, grad = _loss_and_grad(impl, *poisoned, adv, mask, s)
    gap = max(_max_abs(loss - clean[0]), _max_abs(grad - clean[1]))
    if not (torch.isfinite(loss).all() and torch.isfinite(grad).all()):
        gap = math.inf
    # Both sides compute the same float64 values; only the order of masked zeros may differ.
    tol = 1e-12 * (1 + _max_abs(clean[0]) + _max_abs(clean[1]))
    yield _result(
        "loss.masked_nan",
        0,
        f"max |loss, grad with NaN in {int(hole.sum())} masked slots - without| (KL on)",
        gap,
        f"<= {tol:.1e}",
        gap <= tol,
    )


# Unequal lengths (tokens per row), two rows out of the loss when rows can leave it.
MINIBATCH_LENGTHS = (5, 1, 7, 3, 6, 2, 4, 7, 1)
MINIBATCH_SPLITS = ((9, 1), (9, 2), (9, 4), (3, 1), (3, 2), (5, 3))  # (mini_batch_size, micro)


def check_minibatch_invariance(impl: CoreFunctions, s: PreflightSettings):
    """norm.minibatch_invariance: each optimizer step's gradient accumulated over micro-batches
    with the trainer's scaling (micro_batch_scale) equals the gradient of that minibatch's loss
    in one pass over the rows in the loss, for several mini_batch_size / micro-batch splits
    (TRL PR #6024, ms-swift #10117, verl #5625: token-mean scaled by rows under accumulation;
    TRL #6369: rows out of the loss still counted). Ratio 1, float64: no clip bound is near."""
    o = s.objective
    T = max(MINIBATCH_LENGTHS)
    lengths = torch.tensor(MINIBATCH_LENGTHS)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()  # [9, T]
    if o.mask_truncated_completions or o.dynamic_sampling:
        mask[[2, 6]] = 0.0  # a truncated row and a filler: out of the loss
    g = torch.Generator().manual_seed(s.seed + 3)
    logp = -torch.rand(mask.shape, generator=g, dtype=torch.float64) - 0.1  # [9, T]
    adv = torch.randn(mask.shape[0], generator=g, dtype=torch.float64)  # [9]
    L = T + 1

    def loss_of(rows, leaf):  # the implementation's loss of `rows`, its gradient into `leaf`
        loss, _ = _loss(impl, leaf[rows], logp[rows].detach(), None, adv[rows], mask[rows], s, L=L)
        return torch.as_tensor(loss)

    worst = 0.0
    for mini, micro in MINIBATCH_SPLITS:
        for start in range(0, mask.shape[0], mini):
            rows = torch.arange(start, min(start + mini, mask.shape[0]))
            kept = rows[mask[rows].sum(1) > 0]
            leaf = logp.clone().requires_grad_(True)
            reference = torch.zeros_like(logp)
            if len(kept):
                (reference,) = torch.autograd.grad(loss_of(kept, leaf), leaf, allow_unused=True)
                reference = torch.zeros_like(logp) if reference is None else reference
            accumulated = torch.zeros_like(logp)
            for m in range(0, len(rows), micro):
                part = rows[m : m + micro]
                share = impl.micro_batch_scale(o.loss_type, mask[part], mask[rows])
                leaf = logp.clone().requires_grad_(True)
                (grad,) = torch.autograd.grad(loss_of(part, leaf) * share, leaf, allow_unused=True)
                accumulated += 0.0 if grad is None else grad
            scale = max(_max_abs(reference), 1e-30)
            worst = max(worst, _max_abs(accumulated - reference) / scale)
    # float64 sums of at most 9 x 7 terms, each of the size of the largest: far below 1e-10.
    yield _result(
        "norm.minibatch_invariance",
        6,
        f"max relative |grad(micro-batches, trainer's scaling) - grad(one pass over the rows "
        f"in the loss)| over {len(MINIBATCH_SPLITS)} (mini_batch_size, micro) splits",
        worst,
        "<= 1e-10",
        worst <= 1e-10,
    )


def check_loss(impl: CoreFunctions, model, batch: PreflightBatch, s: PreflightSettings):
    g = torch.Generator().manual_seed(s.seed + 1)
    # Metrics on a perturbed policy with a reference, against a direct computation.
    logp_new, logp_old, adv, mask = _clip_case(s)
    logp_ref = logp_old + 0.3 * torch.randn(logp_old.shape, generator=g)
    beta = s.objective.beta if s.objective.beta > 0 else 0.04
    loss, metrics = _loss(impl, logp_new, logp_old, logp_ref, adv, mask, s, beta=beta, L=8)
    finite = (
        bool(torch.isfinite(torch.as_tensor(loss)).all()) and torch.as_tensor(loss).numel() == 1
    )
    yield _result(
        "loss.finite", 7, "loss on a perturbed policy with KL", float(loss), "finite scalar", finite
    )

    valid = mask.bool()
    o = s.objective
    ratio = torch.exp(logp_new.double() - logp_old.double())
    _, clipped = _reference_policy(logp_new, logp_old, adv, mask, o)
    kl = _reference_kl(logp_new, logp_ref, o)
    direct = {
        "loss": float(loss),
        "clip_frac": clipped.double().sum().item() / valid.sum().item(),
        "kl": kl[valid].mean().item(),
        "ratio_mean": ratio[valid].mean().item(),
    }
    if "entropy" in metrics or _takes(impl.grpo_loss, "entropy"):
        # The policy's entropy, handed to the loss: its metric is the masked mean.
        entropy = torch.rand(mask.shape, generator=g) * 2
        _, metrics_e = _loss(
            impl, logp_new, logp_old, logp_ref, adv, mask, s, beta, 8, entropy=entropy
        )
        metrics = metrics | {"entropy": metrics_e.get("entropy", float("nan"))}
        direct["entropy"] = entropy.double()[valid].mean().item()
    gaps = {k: abs(float(metrics.get(k, float("nan"))) - v) for k, v in direct.items()}
    worst_key = max(gaps, key=lambda k: gaps[k] if math.isfinite(gaps[k]) else math.inf)
    worst = gaps[worst_key]
    yield _result(
        "loss.metrics",
        7,
        f"max |metric - direct masked computation| (worst: {worst_key})",
        worst,
        "<= 1e-4",
        math.isfinite(worst) and worst <= 1e-4,
    )

    yield _sgd_direction(impl, model, batch, s)


def _reference_kl(logp_new, logp_ref, o: Objective) -> torch.Tensor:
    """float64 per-token KL estimate of the declared estimator and clamp."""
    d = logp_ref.double() - logp_new.double()
    if o.kl_estimator == "k1":
        value = -d
    elif o.kl_estimator == "k2":
        value = d * d / 2
    else:
        if o.kl_clamp is not None:
            d = d.clamp(-2 * o.kl_clamp, 2 * o.kl_clamp)
        value = torch.exp(d) - d - 1
    return value if o.kl_clamp is None else value.clamp(-o.kl_clamp, o.kl_clamp)


def _takes(fn, name: str) -> bool:
    """Whether `fn` takes the keyword `name` (a user's function may not)."""
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_kl_convention(impl: CoreFunctions, s: PreflightSettings):
    """The declared KL term in the assembled loss: at A = 0 the loss is the aggregated
    beta * KL (times the importance ratio under use_bias_correction_kl)."""
    o = s.objective
    g = torch.Generator().manual_seed(s.seed + 2)
    logp_new, logp_old, _, mask = _clip_case(s)
    logp_ref = logp_new + torch.randn(logp_new.shape, generator=g)
    if o.kl_clamp is not None:  # gaps where the clamps act
        logp_ref[0, :3] = logp_new[0, :3] + torch.tensor([12.0, -15.0, 25.0])
    beta = o.beta if o.beta > 0 else 0.04
    new = logp_new.clone().requires_grad_(True)
    loss, _ = _loss(impl, new, logp_old, logp_ref, torch.zeros(4), mask, s, beta=beta, L=8)
    torch.as_tensor(loss).backward()
    ref_new = logp_new.double().clone().requires_grad_(True)
    per_token = beta * _reference_kl(ref_new, logp_ref, o)
    if o.use_bias_correction_kl:
        per_token = per_token * _reference_ratio(ref_new, logp_old, mask, o, "token")
    expected = core.aggregate(per_token, mask.double(), o.aggregation, 8)
    expected.backward()
    # float32 against float64: relative to the size of the values
    gap = max(
        abs(float(loss) - float(expected)) / max(1.0, abs(float(expected))),
        _max_abs(new.grad.double() - ref_new.grad) / max(1.0, _max_abs(ref_new.grad)),
    )
    what = f"{o.kl_estimator}" + (f", clamp {o.kl_clamp:g}" if o.kl_clamp else "")
    what += ", x importance ratio" if o.use_bias_correction_kl else ""
    yield _result(
        "kl.convention",
        5,
        f"max |loss or its grad - beta * KL ({what})| at A = 0",
        gap,
        "<= 1e-5",
        gap <= 1e-5,
    )


def _reference_ratio(logp_new, logp_old, mask, o: Objective, level=None) -> torch.Tensor:
    """float64 importance ratio at `level` (None: the declared one)."""
    new, old = logp_new.double(), logp_old.double()
    log_ratio = torch.where(mask.bool(), new - old, torch.zeros_like(new))
    if o.log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-o.log_ratio_clamp, o.log_ratio_clamp)
    if (level or o.importance_sampling_level) == "sequence":
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    return torch.exp(log_ratio)


def bias_correction_declared(impl: CoreFunctions, o: Objective) -> bool:
    """kl.bias_correction_gradient runs where the KL is bias-corrected with the clipped
    surrogate and the loss takes a sequence-level ratio (GSPO)."""
    return (
        o.use_bias_correction_kl
        and o.surrogate == "clip"
        and _takes(impl.grpo_loss, "importance_sampling_level")
    )


def check_bias_correction_gradient(impl: CoreFunctions, s: PreflightSettings):
    """kl.bias_correction_gradient: under GSPO (sequence-level ratio) with KL bias
    correction, d loss / d logp_new of the KL term equals a float64 reference whose KL is
    multiplied by the per-token ratio. A [B, 1] sequence ratio gives nearly the same loss
    and another gradient (TRL #6586): measured with the policy term's share removed."""
    o = dataclasses.replace(s.objective, importance_sampling_level="sequence")
    gspo = dataclasses.replace(s, objective=o)
    g = torch.Generator().manual_seed(s.seed + 3)
    logp_new, logp_old, adv, mask = (t.double() for t in _clip_case(gspo))
    logp_ref = logp_new + 0.5 * torch.randn(logp_new.shape, generator=g, dtype=torch.float64)
    beta = o.beta if o.beta > 0 else 0.04

    def grad_of(b: float) -> torch.Tensor:
        new = logp_new.clone().requires_grad_(True)
        loss, _ = _loss(impl, new, logp_old, logp_ref, adv, mask, gspo, beta=b, L=8)
        (grad,) = torch.autograd.grad(torch.as_tensor(loss), new)
        return grad.double()

    kl_grad = grad_of(beta) - grad_of(0.0)  # the KL term's share of the gradient [4, 8]
    ref_new = logp_new.double().clone().requires_grad_(True)
    ratio = _reference_ratio(ref_new, logp_old, mask, o, "token")
    per_token = beta * _reference_kl(ref_new, logp_ref, o) * ratio
    (expected,) = torch.autograd.grad(
        core.aggregate(per_token, mask.double(), o.aggregation, 8), ref_new
    )
    gap = _max_abs(kl_grad - expected) / max(_max_abs(expected), 1e-12)
    # float64 inputs: grpolab's is ~1e-13 off; a loss computed in float32 inside ~1e-6 (the
    # policy term's gradient cancels in the difference); a sequence ratio is ~0.5 off.
    yield _result(
        "kl.bias_correction_gradient",
        5,
        "max |grad of the KL term - float64 reference (KL x per-token ratio)| / max |grad| "
        "(GSPO, bias correction)",
        gap,
        "<= 1e-4",
        gap <= 1e-4,
    )


def _sgd_direction(impl: CoreFunctions, model, batch: PreflightBatch, s: PreflightSettings):
    """One small SGD step with the implementation's loss, taken on float32 weights: a copy of
    a low-precision model (its rounding would swallow the step), else the model's own weights
    swapped for stepped ones during one forward (no copy; the originals are put back)."""
    batch = grad_rows(batch, s)
    fp32 = all(p.dtype == torch.float32 for p in model.parameters())
    policy = model if fp32 else copy.deepcopy(model).float()
    policy.eval()
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask, s.objective.temperature)
    advantages = _distinct_signed_advantages(batch.input_ids, batch.attention_mask)
    if advantages is None:
        return _result(
            "loss.sgd_direction", 7, "the batch holds one distinct sequence", 0, "-", True
        )
    with torch.no_grad():
        before, mask = core.sequence_logprobs(policy, *args)
    policy.zero_grad(set_to_none=True)
    logp_new, impl_mask = impl.sequence_logprobs(policy, *args)
    loss, _ = _loss(impl, logp_new, before, None, advantages, impl_mask, s)
    torch.as_tensor(loss).backward()
    del logp_new, impl_mask, loss
    trained = [p for p in policy.parameters() if p.grad is not None]
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in trained)).item() if trained else 0
    with torch.no_grad():
        originals = [p.data for p in trained]
        for p in trained:
            p.data = p.data - 1e-3 / max(norm, 1e-12) * p.grad  # a step of length 1e-3
            p.grad = None
        try:
            after, _ = core.sequence_logprobs(policy, *args)
        finally:
            for p, original in zip(trained, originals, strict=True):
                p.data = original
    change = ((after - before) * mask).sum(1) / mask.sum(1).clamp(min=1)  # [B]
    up = change[advantages > 0].mean().item()
    down = change[advantages < 0].mean().item()
    # To first order the gap up - down grows by c * |grad(A>0) - grad(A<0)|^2 >= 0 whatever
    # the overlap of the two gradients, so the gap is the robust measure.
    return _result(
        "loss.sgd_direction",
        7,
        f"mean logp change after one SGD step: A>0 {up:+.2e}, A<0 {down:+.2e}",
        up - down,
        "> 0 (A>0 rises relative to A<0)",
        up - down > 0,
    )


def check_menu(impl: CoreFunctions, model, batch: PreflightBatch, s: PreflightSettings):
    """The menu's steps outside the loss, each on a designed case, when its option is on."""
    o = s.objective
    if o.tis_cap is not None:
        yield _check_is_weights(impl, o)
    if o.dynamic_sampling:
        rewards = torch.tensor(DESIGNED_REWARDS)
        lengths = torch.tensor(DESIGNED_LENGTHS)
        keep = impl.informative_groups(rewards, 4, o.advantage_eps).bool()
        flat = torch.tensor([False, True, True, False])  # equal rewards, 1e-9 noise
        leaked = float(lengths.view(-1, 4)[keep & flat].sum())
        lost = float(lengths.view(-1, 4)[~keep & ~flat].sum())
        yield _result(
            "dynamic_sampling.normaliser",
            0,
            f"tokens of zero-variance groups kept in the loss's normaliser (informative "
            f"groups' tokens dropped: {lost:g})",
            leaked + lost,
            "0",
            leaked + lost == 0,
        )
    if o.mask_truncated_completions:
        mask = torch.ones(4, 5)
        mask[1, 3:] = 0
        truncated = torch.tensor([True, False, False, True])
        got = impl.truncation_mask(mask, truncated)
        expected = mask * torch.tensor([0.0, 1, 1, 0])[:, None]
        wrong = float((got != expected).sum())
        yield _result(
            "truncation.mask",
            0,
            "loss-mask entries wrong after masking truncated completions (rows 0 and 3)",
            wrong,
            "0",
            wrong == 0,
        )
    if o.entropy_coef:
        yield from _check_entropy(impl, model, batch, s)


def _check_is_weights(impl: CoreFunctions, o: Objective) -> CheckResult:
    g = torch.Generator().manual_seed(3)
    trainer = -torch.rand(4, 5, generator=g) * 2
    engine = trainer + torch.randn(4, 5, generator=g) * 0.4
    engine[0] = trainer[0] - 0.5  # a sequence the trainer finds far likelier (ratio e^2.5)
    mask = torch.ones(4, 5)
    mask[2, 2:] = 0
    mode = {} if o.tis_mode == "token_truncate" else {"mode": o.tis_mode}
    got = impl.tis_weights(trainer, engine, mask, o.tis_cap, **mode).double()
    log_w = ((trainer - engine).double() * mask).expand(4, 5)
    if o.tis_mode.startswith("sequence"):
        log_w = log_w.sum(1, keepdim=True).expand(4, 5)
    w = torch.exp(log_w)
    w = w.clamp(max=o.tis_cap) if o.tis_mode.endswith("truncate") else w * (w <= o.tis_cap)
    gap = _max_abs((got - w)[mask.bool()])
    return _result(
        "engine.is_weights",
        0,
        f"max |weight - (pi_trainer / pi_engine, {o.tis_mode} at {o.tis_cap:g})|",
        gap,
        "<= 1e-5",
        gap <= 1e-5,
    )


def _check_entropy(impl: CoreFunctions, model, batch: PreflightBatch, s: PreflightSettings):
    o = s.objective
    # The bonus: d loss / d entropy is -entropy_coef times each token's aggregation weight.
    g = torch.Generator().manual_seed(s.seed + 4)
    logp_new, logp_old, adv, mask = _clip_case(s)
    entropy = (torch.rand(mask.shape, generator=g) * 2).requires_grad_(True)
    loss, _ = _loss(impl, logp_new, logp_old, None, adv, mask, s, L=8, entropy=entropy)
    torch.as_tensor(loss).backward()
    weights = torch.ones(mask.shape, dtype=torch.float64, requires_grad=True)
    core.aggregate(weights, mask.double(), o.aggregation, 8).backward()
    expected = -o.entropy_coef * weights.grad
    grad = entropy.grad if entropy.grad is not None else torch.zeros_like(entropy)
    gap = _max_abs((grad.double() - expected)[mask.bool()])
    yield _result(
        "entropy.bonus",
        0,
        f"max |d loss / d entropy - (-{o.entropy_coef:g} x aggregation weight)|",
        gap,
        "<= 1e-6",
        gap <= 1e-6,
    )
    if not _takes(impl.sequence_logprobs, "return_entropy"):
        return
    rows = _unpadded_rows(batch)
    with torch.no_grad():
        _, _, got = impl.sequence_logprobs(
            model, rows.input_ids, rows.attention_mask, rows.completion_mask, o.temperature,
            return_entropy=True,
        )  # fmt: skip
        logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits
        expected = core.token_entropy(logits[:, :-1].double(), o.temperature)
    comp = rows.completion_mask[:, 1:].bool()
    gap = _max_abs((got.double() - expected)[comp])
    yield _result(
        "entropy.values",
        0,
        "max |entropy - float64 entropy of softmax(logits / T)| on completion tokens",
        gap,
        "<= 1e-4",
        gap <= 1e-4,
    )


def menu_ids(o: Objective) -> tuple[str, ...]:
    ids = []
    if o.tis_cap is not None:
        ids.append("engine.is_weights")
    if o.dynamic_sampling:
        ids.append("dynamic_sampling.normaliser")
    if o.mask_truncated_completions:
        ids.append("truncation.mask")
    if o.entropy_coef:
        ids += ["entropy.bonus", "entropy.values"]
    return tuple(ids)


def check_rewards(batch: PreflightBatch):
    r = batch.rewards.double().view(-1, batch.group_size)
    zero = (r.std(dim=1, unbiased=False) <= 1e-4).double().mean().item()
    yield _result(
        "rewards.variance",
        0,
        "frac_reward_zero_std (groups that teach nothing)",
        zero,
        "< 1 (some group varies)",
        zero < 1,
    )


REWARD_PROBES = (
    "rewards.reference",
    "rewards.wrong_answer",
    "rewards.echo",
    "rewards.no_answer",
)


def check_reward_probes(report: ProbeReport):
    """The run's reward functions on hand-written completions for real task rows
    (grpolab.rewards.probes: what each kind of reward can be asked)."""
    rows = len(report.rows)
    checking = report.answer_checking()
    others = [n for n in report.ruled() if n not in checking]
    about = f"{rows} rows; answer-checking: {', '.join(checking) or 'none'}"
    if others:
        about += f"; not answer-checking (probed for the first demand only): {', '.join(others)}"
    for name in report.learned:
        right, compared = report.preferences(name)
        about += (
            f"; learned, reported and held to no demand: {name} prefers the reference to a "
            f"wrong answer on {right} of {compared} rows"
        )
    if report.not_probed:
        about += f"; not probed (need token ids): {', '.join(report.not_probed)}"
    for id, findings, breach in (
        (REWARD_PROBES[0], probes.reference_findings(report), "a probe scores above the "
         "reference answer"),
        (REWARD_PROBES[1], probes.wrong_findings(report), "a wrong answer scores as much as "
         "the reference"),
        (REWARD_PROBES[2], probes.echo_findings(report), "the prompt echoed or restated "
         "scores as much as the reference"),
        (REWARD_PROBES[3], probes.no_answer_findings(report), "no answer scores more than a "
         "wrong one"),
    ):  # fmt: skip
        bad_rows = len({f.row for f in findings})
        what = f"rows where {breach} ({about})"
        failed = {n: e for n, e in report.errors.items() if e} if id == REWARD_PROBES[0] else {}
        if failed:  # a function that fails on the probes cannot be asked anything
            name, n = next(iter(failed.items()))
            bad_rows = rows
            error = report.error_texts.get(name, "its error is in the log")
            what = f"reward {name!r} failed on {n} of {len(report.probes)} probes: {error}"
            yield dataclasses.replace(
                _result(id, 0, what, bad_rows, f"0 of {rows}", False),
                hint=f"the reward function {name!r} fails on real task rows: fix it (the first "
                "failure's traceback is in the log); a failing reward gives every sample the "
                "fallback (rewards.fallback)",
            )
            continue
        elif findings:
            more = f" (and {len(findings) - 1} more)" if len(findings) > 1 else ""
            what = f"rows where {breach}; first: {findings[0].sentence()}{more}"
        yield _result(id, 0, what, bad_rows, f"0 of {rows}", not findings and not failed)


# --- Running them ------------------------------------------------------------------------------


def guarded(impl: CoreFunctions, ids: tuple[str, ...], goal: int, fn: Callable, *args):
    """Run one family of checks (`ids`, in the order `fn` yields them). An exception in the
    implementation becomes a failed result for the check it interrupted; the results
    already measured are kept."""
    results: list[CheckResult] = []
    try:
        for result in fn(*args):
            results.append(result)
    except Exception as err:  # the user's code may raise anything
        id = ids[min(len(results), len(ids) - 1)]
        line = impl_error_line(err, impl.path) if impl.path else None
        where = f"{impl.path}:{line}: " if line else ""
        results.append(
            CheckResult(
                id=id,
                goal=goal,
                what="the implementation raised",
                measured=type(err).__name__,
                expected="no exception",
                passed=False,
                hint=HINTS.get(id, ""),
                error=f"{where}{type(err).__name__}: {err}",
                error_line=line,
            )
        )
    return results


FAMILIES = {
    1: ("logprobs.shift", "logprobs.float32", "logprobs.temperature"),
    2: (
        "advantages.group_sums",
        "advantages.population_std",
        "advantages.zero_std_groups",
        "advantages.contiguous",
    ),
    3: ("ratio.initial", "engine.agreement"),
    4: ("clip.values", "clip.gradient", "clip.asymmetric", "clip.clip_frac"),
    5: ("kl.nonnegative", "kl.identical", "kl.tracks_exact"),
    6: ("norm.aggregation", "norm.masked_gradient"),
    7: ("loss.finite", "loss.metrics", "loss.sgd_direction"),
}  # the seed objective's; `families` gives the declared objective's


# Checks the drill, on the seed's objective, never meets: they run only where the objective
# declares something beyond the seed's (a profile's convention, an option of the menu), or
# hold grpolab's own machinery around the learner's loss (masked NaN, the micro-batch scaling).
DECLARED_ONLY = frozenset(
    {
        "advantages.sample_std",
        "advantages.estimator",
        "advantages.excluded_rows",
        "loss.masked_nan",
        "norm.minibatch_invariance",
        "kl.bias_correction_gradient",
        "gspo.ratio",
        "gspo.length_weighting",
        "cispo.gradient",
        "clip.delta",
        "clip.dual_clip",
        "kl.convention",
        "engine.is_weights",
        "dynamic_sampling.normaliser",
        "truncation.mask",
        "entropy.bonus",
        "entropy.values",
    }
)


def families(o: Objective) -> dict[int, tuple[str, ...]]:
    """Each goal's check ids, in the order they run, for the declared objective."""
    return FAMILIES | {2: advantage_ids(o), 4: clip_ids(o)}


def kl_convention_declared(o: Objective) -> bool:
    return (o.kl_estimator, o.kl_clamp, o.use_bias_correction_kl) != ("k3", None, False)


def run_checks(
    model,
    batch: PreflightBatch,
    settings: PreflightSettings | None = None,
    impl: CoreFunctions | None = None,
) -> list[CheckResult]:
    """All checks, in goal order. The model's train/eval mode and weights are left as found."""
    s = settings or PreflightSettings()
    impl = impl or CoreFunctions()
    torch.manual_seed(s.seed)
    fams = families(s.objective)
    with eval_mode(model, zero_grad=True):
        results = []
        results += guarded(impl, fams[1], 1, check_logprobs, impl, model, batch, s)
        results += guarded(impl, fams[2], 2, check_advantages, impl, batch, s)
        if _takes(impl.group_advantages, "valid"):  # a function without it cannot exclude
            ids = ("advantages.excluded_rows",)
            results += guarded(impl, ids, 2, check_excluded_rows, impl, s)
        results += guarded(impl, fams[3], 3, check_ratio, impl, model, batch, s)
        results += guarded(impl, fams[4], 4, check_clip, impl, s)
        results += guarded(impl, fams[5], 5, check_kl, impl, model, batch, s)
        if kl_convention_declared(s.objective):
            results += guarded(impl, ("kl.convention",), 5, check_kl_convention, impl, s)
        if bias_correction_declared(impl, s.objective):
            ids = ("kl.bias_correction_gradient",)
            results += guarded(impl, ids, 5, check_bias_correction_gradient, impl, s)
        results += guarded(impl, fams[6], 6, check_normalisation, impl, model, batch, s)
        if s.accumulation:
            ids = ("norm.minibatch_invariance",)
            results += guarded(impl, ids, 6, check_minibatch_invariance, impl, s)
        results += guarded(impl, fams[7], 7, check_loss, impl, model, batch, s)
        if s.masked_nan:
            results += guarded(impl, ("loss.masked_nan",), 0, check_masked_nan, impl, s)
        menu = menu_ids(s.objective)
        if menu:
            results += guarded(impl, menu, 0, check_menu, impl, model, batch, s)
        results += list(check_rewards(batch))
    return results


# Blame: when several checks fail together, the one that pins the cause is named first. A
# check here moves just ahead of the broader one that the same bug also fails (a dual clip on
# both signs changes clip.values too; a flipped sign changes norm.aggregation's loss too),
# the more specific first among those moved ahead of the same check.
BLAMED_BEFORE = {
    "gspo.ratio": "clip.values",
    "gspo.length_weighting": "ratio.initial",
    "cispo.gradient": "clip.values",
    "clip.dual_clip": "clip.values",
    "clip.delta": "clip.values",
    "entropy.bonus": "ratio.initial",
    "loss.masked_nan": "loss.metrics",
    "loss.sgd_direction": "norm.aggregation",
    "clip.asymmetric": "clip.values",
}
# ... unless this check fails too: a clip that acts where it should off the band between the
# two bounds (clip.gradient passes) with wrong values has its bounds misplaced (asymmetric);
# one that acts in the wrong places is wrong in its values first (min for max).
UNLESS_FAILING = {"clip.asymmetric": "clip.gradient"}


def blamed(results: list[CheckResult]) -> list[CheckResult]:
    """The failed checks, the likely cause first: run order, with BLAMED_BEFORE's moves."""
    position = {r.id: i for i, r in enumerate(results)}
    failed = {r.id for r in results if not r.passed}
    moved = list(BLAMED_BEFORE)

    def key(r: CheckResult) -> tuple[int, int]:
        ahead_of = BLAMED_BEFORE.get(r.id)
        if ahead_of in position and UNLESS_FAILING.get(r.id) not in failed:
            return position[ahead_of], moved.index(r.id) - len(moved)
        return position[r.id], 0

    return sorted((r for r in results if not r.passed), key=key)


def goal_status(results: list[CheckResult]) -> dict[int, bool]:
    """Per seed goal (1..7): do all its checks pass?"""
    status = {}
    for goal in GOALS:
        mine = [r for r in results if r.goal == goal]
        status[goal] = bool(mine) and all(r.passed for r in mine)
    return status
