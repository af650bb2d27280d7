"""The shape of one unit of the objective (`Option`) and of the two kinds of unit the core
functions dispatch to by name (`Surrogate`: a policy term other than the seed's clip;
`Estimator`: advantages other than GRPO's). A unit declares everything about its option in one
module: its config keys (a frozen dataclass whose fields carry their constraints,
`grpolab.schema.key`), the rules between keys, what it passes to the core functions, its card
line, its float64 reference and its checks; `grpolab.objective` assembles them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
    the declared one. `policy`: core.policy_loss takes it too (not only grpo_loss)."""

    key: str
    keyword: str
    unless: Any = ALWAYS
    convention: bool = False
    policy: bool = False


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
        if value is not None and o.surrogate != "clip":
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
            lambda c: c.objective.surrogate != "clip",
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
        config refuses them there)."""

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
    options: the policy_loss keywords it reads besides eps_low / eps_high."""

    name: str
    aggregation: str  # the normaliser its loss_type names, as TRL normalises it
    per_token: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    reference: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    bounds: Callable[[Any], list[float]]
    options: tuple[str, ...] = ()


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
        the zero-std guard (the seed's, which applies to every estimator)."""

    name: str
    estimate: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]


def max_abs(x: torch.Tensor) -> float:
    """The largest |x| (0 for an empty tensor)."""
    return x.abs().max().item() if x.numel() else 0.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over positions where mask is set (0 when none is)."""
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))
    return masked.sum() / mask.sum().clamp(min=1)
