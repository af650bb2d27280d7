"""The shape of one unit of the objective (`Option`) and of the two kinds of unit the core
functions dispatch to by name (`Surrogate`: a policy term other than the seed's clip;
`Estimator`: advantages other than GRPO's). A unit declares everything about its option in one
module: its config keys (a frozen dataclass whose fields carry their constraints,
`grpolab.schema.key`), the rules between keys, what it passes to the core functions, its card
line, its float64 reference and its checks; `grpolab.objective` assembles them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from grpolab.check import Check
from grpolab.schema import Inert, SchemaError

ALWAYS = object()  # `Passed.unless`: the keyword is always passed


@dataclass(frozen=True)
class Passed:
    """An objective key handed to a core function as `keyword`, left out where its value is
    `unless` (the function's own default), so that a function written for the seed's
    signature takes the seed's objective unchanged. `convention`: a user's function may leave
    the keyword out and compute one fixed convention, which the preflight then checks against
    the declared one. `policy`: core.policy_loss takes it too (not only grpo_loss).
    `keyword` "" is the key's own name."""

    key: str
    keyword: str = ""
    unless: Any = ALWAYS
    convention: bool = False
    policy: bool = False

    def __post_init__(self) -> None:
        if not self.keyword:
            object.__setattr__(self, "keyword", self.key)


@dataclass(frozen=True)
class Needs:
    """`function` must take `keyword` when this unit is declared: named by `key` if not."""

    function: str
    keyword: str
    key: str


def no_rules(o: Any) -> None:
    return None


@dataclass(frozen=True)
class ClipBound:
    """A key that bounds the seed's clipped surrogate (delta, dual-clip): a number > 1 or null,
    a probe bound of the clip checks, null under any other surrogate (nothing to bound), and
    without effect there when a file gave it under a later override's surrogate."""

    key: str

    def rules(self, o: Any) -> None:
        value = getattr(o, self.key)
        if value is not None and o.policy_term != "clip":
            raise SchemaError(
                self.key, value, f"null with loss_type={o.loss_type}: it bounds the clipped "
                "surrogate, which that loss does not have"
            )  # fmt: skip

    def bounds(self, o: Any) -> list[float]:
        value = getattr(o, self.key)
        return [] if value is None else [value]

    @property
    def inert(self) -> Inert:
        return Inert(
            (f"objective.{self.key}",),
            ("objective.loss_type",),
            lambda c: c.objective.policy_term != "clip",
            "with objective.loss_type={c.objective.loss_type}: that loss has no clipped "
            "surrogate for it to bound",
        )

    def check(self, ctx) -> Any:
        """Around its bound, values and gradients against the reference (Context)."""
        return ctx.around_bound(self.key, getattr(ctx.objective, self.key))

    def declared(self, ctx) -> bool:
        return getattr(ctx.objective, self.key) is not None


def declared(o: Any) -> bool:
    return True


def no_needs(o: Any) -> tuple[Needs, ...]:
    return ()


def no_card(o: Any) -> Mapping[str, str]:
    return {}


def never(o: Any) -> bool:
    return False


def no_rounds(o: Any) -> int:
    return 0


@dataclass(frozen=True)
class StepTokens:
    """The step's whole batch before any update, as a unit's `before_update` sees it."""

    mask: torch.Tensor  # [B, T-1]: the tokens in the loss (rows out of it zeroed)
    entropy: torch.Tensor | None  # [B, T-1]: the policy's, when a declared unit reads it
    # 1-D values of every rank, concatenated in rank order (the values themselves on one
    # process): a statistic over the global batch is the same on every rank.
    gather: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MicroTokens:
    """One micro-batch of the update, as a unit's `token_weights` sees it: [b, T-1] each."""

    logp: torch.Tensor  # the policy's log-probs of the sampled tokens, detached
    logp_old: torch.Tensor  # the sampling policy's (the trainer's, or the engine's)
    engine_logprobs: torch.Tensor | None  # the engine's own, when it reports them
    mask: torch.Tensor  # the tokens in the loss
    before: Mapping[str, torch.Tensor]  # the units' before_update tensors, these rows


@dataclass(frozen=True)
class Option:
    """One unit of the objective.

    keys: the frozen dataclass of its keys in the `objective` config section (None: none).
    rules(o): what no single key's constraint can see, on the whole Objective record; raises
        grpolab.schema.SchemaError naming the key.
    active(o): whether its keywords are passed at all (a surrogate's own options only when
        that surrogate is the declared one).
    loss / advantages: what it passes to grpo_loss (and policy_loss) / group_advantages.
    needs(o): keywords a user's function must take where this unit is declared.
    card(o): {row of the objective card: its text}; rows are joined in registry order.
    checks: its preflight checks (grpolab.check.Check).
    inert: where its keys have no effect (grpolab.schema.Inert, on the whole config: the
        config refuses them there).
    trl: {TRL GRPOConfig name: its key here} for the names that mean the same.
    policy_term / estimator: the surrogate (`Surrogate`) or advantage estimator (`Estimator`)
        it brings. A surrogate's keys are its own: passed to policy_loss as themselves and
        without effect under another surrogate, both derived here from `keys`.
    functions: {name: function} the step calls for this unit, which a user's file may replace
        by defining a function of that name (the preflight then checks it).

    The data-flow hooks, each called by the step only where `active(o)` holds; `fns` is the
    run's function table (the user's functions where given):
    keep_groups(o, fns, rewards [B], G) -> [B // G] bool: the groups a step keeps; with
        extra_rounds(o) > 0 the step samples further rounds of prompts until it has a
        batch's worth, then fills with dropped groups out of the loss (their rows' loss 0).
    loss_rows(o, fns, rollout) -> [B] float: 1 for the rows in the loss, 0 for those out of
        it and of their group's statistics.
    advantage_inputs(o, rollout) -> {keyword: [B] tensor}: per-row inputs of
        group_advantages, gathered over every rank.
    before_update(o, fns, StepTokens) -> {name: [B, T-1] tensor}: fixed for the step before
        its first update (with reads_entropy, from the entropy of the policy that sampled).
    token_weights(o, fns, MicroTokens) -> ([b, T-1] weights, {name: sum}): multiplies each
        token's policy term (the product over units); the sums add up over the step.
    metrics(o, sums) -> {metric: value}: from the step's sums over every rank; the metric
        names start with `metric_prefix` (default: the unit's name).
    reads_every_row: the key whose non-zero value adds a loss term that reads rows without
        advantage (the KL, the entropy bonus): the update then runs every row.
    engine_logprobs(o) -> str | None: the key that needs the engine's own log-probs, when
        declared (an engine without them is refused before training)."""

    name: str
    keys: type | None = None
    rules: Callable[[Any], None] = no_rules
    active: Callable[[Any], bool] = declared
    loss: tuple[Passed, ...] = ()
    advantages: tuple[Passed, ...] = ()
    needs: Callable[[Any], tuple[Needs, ...]] = no_needs
    card: Callable[[Any], Mapping[str, str]] = no_card
    checks: tuple[Check, ...] = ()
    inert: tuple[Inert, ...] = ()
    # Keywords a step passes (not objective keys) that a user's function may leave out.
    convention_keywords: tuple[str, ...] = ()
    trl: Mapping[str, str] = field(default_factory=dict)
    policy_term: Surrogate | None = None
    estimator: Estimator | None = None
    functions: Mapping[str, Callable] = field(default_factory=dict)
    keep_groups: Callable[..., torch.Tensor] | None = None
    extra_rounds: Callable[[Any], int] = no_rounds
    loss_rows: Callable[..., torch.Tensor] | None = None
    advantage_inputs: Callable[..., Mapping[str, torch.Tensor]] | None = None
    before_update: Callable[..., Mapping[str, torch.Tensor]] | None = None
    reads_entropy: bool = False
    token_weights: Callable[..., tuple[torch.Tensor, Mapping[str, float]]] | None = None
    metrics: Callable[..., Mapping[str, float]] | None = None
    metric_prefix: str = ""
    reads_every_row: str | None = None
    engine_logprobs: Callable[[Any], str | None] = lambda o: None

    def __post_init__(self) -> None:
        if self.policy_term is None or self.keys is None:
            return
        own = [f.name for f in dataclasses.fields(self.keys)]
        name = self.policy_term.name
        if not self.loss:
            object.__setattr__(self, "loss", tuple(Passed(k, policy=True) for k in own))
        not_declared = Inert(
            tuple(f"objective.{k}" for k in own),
            ("objective.loss_type", "objective.surrogate"),
            lambda c: c.objective.policy_term != name,
            "with objective.loss_type={c.objective.loss_type}, objective.surrogate="
            f"{{c.objective.surrogate}}: it is the {name} surrogate's own key",
        )
        object.__setattr__(self, "inert", (not_declared, *self.inert))


@dataclass(frozen=True)
class Surrogate:
    """A policy term chosen by `objective.loss_type = name` (TRL's loss types), in place of the
    seed's clipped surrogate (which core.policy_loss computes itself).

    per_token(ratio, adv, logp_new, mask, eps_low, eps_high, **options) -> (per_token [B, T],
        clip_frac): ratio [B, T] or [B, 1] (GSPO), adv [B, 1]; clip_frac the masked share of
        tokens its bound acts on.
    reference(ratio, adv, logp_new, valid, o) -> (per_token, active): the float64 reference
        of the same term (differentiable in logp_new) and the tokens its bound acts on.
    bounds(o): the ratios at which it changes branch (probes keep off them).
    Its options (the policy_loss keywords it reads besides eps_low / eps_high) are its unit's
    keys (`Option.policy_term`)."""

    name: str
    aggregation: str  # the normaliser its loss_type names, as TRL normalises it
    per_token: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    reference: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    bounds: Callable[[Any], list[float]]


@dataclass(frozen=True)
class Estimator:
    """Advantages chosen by `objective.advantage_estimator = name`, in place of GRPO's scaled
    group advantages (which core.group_advantages computes itself).

    estimate(centred, n, weights, unbiased) -> [n_groups, G]: centred = rewards minus their
        group's mean ([n_groups, G], 0 on rows that do not vote), n = voting rows per group
        (the int G when all vote, else [n_groups, 1]), weights = what reinforce_pp's batch
        statistics weigh each row by ([n_groups, G]: token counts, 0 on rows that do not vote;
        None: equal).
    reference(rewards, G, o, lengths) -> [B]: the float64 reference, every row voting, before
        the zero-std guard (the seed's, which applies to every estimator).
    token_weighted: group_advantages takes `lengths` (each row's completion tokens) for it.
    batch_whitened: statistics over the whole batch move every group (a group's sum is the
        reference's, not 0; a flat group's advantages need not be 0)."""

    name: str
    estimate: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    token_weighted: bool = False
    batch_whitened: bool = False


def max_abs(x: torch.Tensor) -> float:
    """The largest |x| (0 for an empty tensor)."""
    return x.abs().max().item() if x.numel() else 0.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over positions where mask is set (0 when none is)."""
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))
    return masked.sum() / mask.sum().clamp(min=1)
