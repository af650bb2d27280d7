"""What a check reads: `Context` holds the functions under test, the declared objective and
the settings, the model and the real batch (and, in the preflight, the whole run), and the
cases and helpers the checks share: probe ratios placed off every bound of the declared
objective, the implementation's loss called as the trainer calls it, its values and gradients
next to the float64 reference's."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from grpolab import core
from grpolab.check import Check, CheckResult, result_of
from grpolab.checks import reference
from grpolab.core import CoreFunctions, Objective
from grpolab.model.precision import FP32, Precision
from grpolab.objective.base import max_abs


@dataclass
class PreflightBatch:
    """A real rollout batch: rows are left-padded prompt + completion + right padding."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T]
    rewards: torch.Tensor  # [B]
    group_size: int
    engine_logprobs: torch.Tensor | None = None  # [B, T-1], aligned like sequence_logprobs
    # The reward functions that returned None for every row of the batch (the preflight's
    # scoring says; a designed batch has none).
    unscored: tuple[str, ...] = ()
    # The engine's stop tokens (EOS first); None: the model config's eos_token_id.
    stop_ids: tuple[int, ...] | None = None

    def rows(self, rows) -> PreflightBatch:
        """The rows `rows` (a slice or indices), every field cut alike."""
        engine = None if self.engine_logprobs is None else self.engine_logprobs[rows]
        return PreflightBatch(
            self.input_ids[rows],
            self.attention_mask[rows],
            self.completion_mask[rows],
            self.rewards[rows],
            self.group_size,
            engine,
            self.unscored,
            self.stop_ids,
        )


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
    # Rows per optimizer step on this process (the run's minibatch); None: the whole batch.
    minibatch: int | None = None


def grad_rows(batch: PreflightBatch, s: PreflightSettings) -> PreflightBatch:
    """The first s.grad_rows rows of the batch (all when None), for checks with gradients."""
    n = s.grad_rows
    if n is None or n >= batch.input_ids.shape[0]:
        return batch
    return batch.rows(slice(0, n))


# The checks that backpropagate through the model several times (against its float64 copy,
# or one SGD step) run on a few rows of a few groups: on SmolLM2-135M a float64 forward and
# backward cost ~1 s a row, and what they look for (a normaliser wrong under accumulation or
# skipping, a log-prob path off the plain one, a packed row seeing another, a loss pushing the
# wrong way) is in every row. Two groups at least keep a cut between groups and one inside a
# group; whole groups are cut to their first rows, still consecutive and sharing a prompt.
FEW_ROWS_PER_GROUP = 4
FEW_ROWS = 8


def few_group_rows(batch: PreflightBatch, s: PreflightSettings) -> PreflightBatch:
    """The first FEW_ROWS_PER_GROUP rows of each of the first groups, at least two groups and
    FEW_ROWS rows, within the trainer's micro-batch (grad_rows: the checks fit where training
    fits). A batch not made of whole groups: its first FEW_ROWS rows."""
    B, G = batch.input_ids.shape[0], batch.group_size
    if G < 1 or B % G:
        rows = list(range(min(B, FEW_ROWS)))
    else:
        per_group = min(G, FEW_ROWS_PER_GROUP)
        groups = min(B // G, max(2, math.ceil(FEW_ROWS / per_group)))
        rows = [g * G + i for g in range(groups) for i in range(per_group)]
        batch = dataclasses.replace(batch.rows(torch.tensor(rows)), group_size=per_group)
        rows = list(range(len(rows)))
    if s.grad_rows is not None:
        rows = rows[: s.grad_rows]
    return batch.rows(torch.tensor(rows)) if len(rows) < batch.input_ids.shape[0] else batch


# The log-prob checks run their rows one at a time, three times over (T = 1, another T, a
# bf16 copy): what they look for (the shift, the logits' dtype, the temperature) is in every
# token of every row, and a few rows hold tens of tokens.
UNPADDED_ROWS = 4


def unpadded_rows(batch: PreflightBatch) -> PreflightBatch:
    """The rows with no left padding (the longest prompts), at most UNPADDED_ROWS: there, any
    way of computing positions agrees, so a low-precision model cannot blur the comparison."""
    rows = batch.attention_mask[:, 0].bool().nonzero().flatten()[:UNPADDED_ROWS]
    return dataclasses.replace(batch.rows(rows), engine_logprobs=None)


def takes(fn: Callable, name: str) -> bool:
    """Whether `fn` takes the keyword `name` (a user's function may not)."""
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def signed_advantages(B: int) -> torch.Tensor:
    """+1, -1, +1, ...: both signs in every group, independent of the advantage code."""
    return torch.tensor([1.0, -1.0] * (B // 2) + [1.0] * (B % 2))


# Probe log-ratios keep this far from every bound of the objective: far above the rounding of
# a float32 log-prob difference (~3e-7 at |logp| <= 3), so clipped or not is never a float tie.
PROBE_MARGIN = 1e-4


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
    bounds = reference.log_ratio_bounds(o)
    out = [placed_log_ratio(float(x), bounds) for x in log_ratios.flatten()]
    return torch.tensor(out, dtype=torch.float64).view(log_ratios.shape)


# The designed rewards: small G (so population and sample std differ by sqrt(G/(G-1))),
# an all-equal group, a float-noise group, and groups that an interleaved reading would mix.
DESIGNED_REWARDS = (1.0, 0, 0, 0, 1, 1, 1, 1, 0.5, 0.5 + 1e-9, 0.5, 0.5 + 1e-9, 0, 0.25, 0.5, 2)
DESIGNED_LENGTHS = (3.0, 1, 5, 2, 4, 4, 1, 6, 2, 2, 3, 3, 1, 5, 2, 4)  # completion tokens


class Context:
    """One run of the checks: what they read, and what they share (`memo`)."""

    def __init__(
        self,
        impl: CoreFunctions,
        settings: PreflightSettings,
        model: torch.nn.Module | None = None,
        batch: PreflightBatch | None = None,
        run: Any = None,
        episodes: Any = None,
        say: Callable[[str], None] | None = None,
    ):
        self.impl, self.settings, self.model, self.batch = impl, settings, model, batch
        self.run = run  # the preflight's: the configured run (setup.Run)
        self.episodes = episodes  # the episode checks': the engine's record and its functions
        self.say = say or (lambda text: None)  # announces a long measurement as it starts
        self.check: Check | None = None  # the check running now
        self.shared: dict[str, Any] = {}  # what several checks of one run compute once

    @property
    def objective(self) -> Objective:
        return self.settings.objective

    def result(self, what: str, measured: Any, expected: str, passed: bool) -> CheckResult:
        """The running check's result."""
        return result_of(self.check, what, measured, expected, passed)

    def takes(self, function: str, keyword: str) -> bool:
        """Whether the function under test named `function` takes `keyword`."""
        return takes(getattr(self.impl, function), keyword)

    def memo(self, key: str, compute: Callable[[], Any]) -> Any:
        """compute() once per run of the checks (an exception is raised again each time)."""
        if key not in self.shared:
            try:
                self.shared[key] = compute()
            except Exception as err:
                self.shared[key] = err
        value = self.shared[key]
        if isinstance(value, Exception):
            raise value
        return value

    def release(self, key: str) -> None:
        """Drop what `memo` holds under `key` (a large reference no later check needs)."""
        self.shared.pop(key, None)

    def with_objective(self, o: Objective) -> Context:
        """The same run under another declared objective."""
        settings = dataclasses.replace(self.settings, objective=o)
        other = Context(
            self.impl, settings, self.model, self.batch, self.run, self.episodes, self.say
        )
        other.check = self.check
        return other

    # --- Cases ------------------------------------------------------------------------------

    def designed_rewards(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rewards [16], completion lengths [16]) float64, groups of 4 (DESIGNED_REWARDS)."""
        return (
            torch.tensor(DESIGNED_REWARDS, dtype=torch.float64),
            torch.tensor(DESIGNED_LENGTHS, dtype=torch.float64),
        )

    def unpadded_rows(self) -> PreflightBatch:
        return unpadded_rows(self.batch)

    def clip_case(self):
        """Ratios on both sides of both clip bounds, for both signs of the advantage, [4, 8]:
        placed in log-ratio (never negative, never on a bound)."""
        o = self.objective
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

    def ratio_case(self, ratios: list[list[float]], advantages: list[float], lengths: list[int]):
        """logp_new, logp_old, advantages, mask for the given per-token ratios [B, T], each
        placed off the objective's bounds (under GSPO: each row's mean log-ratio); row i has
        lengths[i] completion tokens (the rest padding)."""
        o = self.objective
        log_r = placed_log_ratios(torch.log(torch.tensor(ratios, dtype=torch.float64)), o)
        B, T = log_r.shape
        logp_old = -torch.linspace(0.4, 2.5, B * T, dtype=torch.float64).view(B, T)
        mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).double()
        if o.importance_sampling_level == "sequence":
            mean = (log_r * mask).sum(1) / mask.sum(1)
            bounds = reference.log_ratio_bounds(o)
            shift = torch.tensor([placed_log_ratio(float(m), bounds) - float(m) for m in mean])
            log_r = log_r + shift.double()[:, None]
        logp_new = logp_old + log_r
        A = torch.tensor(advantages, dtype=torch.float64)
        return logp_new.float(), logp_old.float(), A.float(), mask.float()

    def around_bound(self, name: str, bound: float) -> CheckResult:
        """A clip option's bound (delta, dual-clip): ratios around it with A < 0 (where both
        act) and A > 0 (where neither may), values and gradients against the reference."""
        case = self.ratio_case(
            [[bound - 0.3, bound + 0.5, 1.0, 0.5], [bound - 0.3, bound + 0.5, 1.1, 0.9]],
            [-1.0, 0.7],
            [4, 4],
        )
        (values, _, grad), (ref, _, ref_grad) = self.values_and_grads(*case)
        gap = max(max_abs(values.double() - ref), max_abs(grad.double() - ref_grad))
        return self.result(
            f"max |per_token or its grad - reference| around {name} = {bound:g}, both signs of A",
            gap,
            "<= 1e-5",
            gap <= 1e-5,
        )

    # --- The functions under test, called as the trainer calls them ------------------------

    def loss(self, logp_new, logp_old, logp_ref, advantages, mask, beta=0.0, L=None, **extra):
        """The implementation's grpo_loss under the declared objective (its conventions
        passed where the function takes them), with `beta` and `L` for this check."""
        o = self.objective
        L = L or o.max_completion_length or logp_new.shape[1]
        kwargs = o.loss_kwargs() | {"beta": beta, "max_completion_length": L} | extra
        kwargs = core.accepted_kwargs(self.impl.grpo_loss, kwargs)
        return self.impl.grpo_loss(logp_new, logp_old, logp_ref, advantages, mask, **kwargs)

    def policy(self, logp_new, logp_old, adv, mask):
        o = self.objective
        kwargs = core.accepted_kwargs(self.impl.policy_loss, o.policy_kwargs())
        return self.impl.policy_loss(
            logp_new, logp_old, adv, mask, o.epsilon, o.epsilon_high, **kwargs
        )

    def values_and_grads(self, logp_new, logp_old, adv, mask):
        """(per_token, clip_frac, grad) of the implementation and (per_token, active, grad) of
        the float64 reference, grads of the masked per-token sum w.r.t. logp_new."""
        new = logp_new.clone().requires_grad_(True)
        per_token, clip_frac = self.policy(new, logp_old, adv, mask)
        (per_token * mask).sum().backward()
        ref_new = logp_new.double().clone().requires_grad_(True)
        ref, active = self.reference_policy(ref_new, logp_old, adv, mask)
        (ref * mask.double()).sum().backward()
        return (per_token.detach(), clip_frac, new.grad), (ref.detach(), active, ref_new.grad)

    @staticmethod
    def backward(loss) -> None:
        torch.as_tensor(loss).backward()

    # --- The float64 references -------------------------------------------------------------

    def reference_policy(self, logp_new, logp_old, adv, mask):
        return reference.policy(self.objective, logp_new, logp_old, adv, mask)

    def reference_ratio(self, logp_new, logp_old, mask, level: str | None = None):
        return reference.ratio(self.objective, logp_new, logp_old, mask, level)

    def aggregate(self, per_token, mask, L: int) -> torch.Tensor:
        """The declared aggregation (core's: the seed's code, exact in float64)."""
        return core.aggregate(per_token, mask, self.objective.aggregation, L)
