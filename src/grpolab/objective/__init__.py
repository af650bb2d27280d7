"""The objective: which GRPO is optimised, assembled from its units.

Each option is one module here (an `Option`, `grpolab.objective.base`): its config keys, the
rules between them, what it passes to the core functions, its card row and its checks; the
surrogates and advantage estimators beyond the seed's also bring their maths and their float64
reference (`Surrogate`, `Estimator`), which grpolab.core dispatches to by name. This module is
the registry: `UNITS` (their order is the card's and the checks'), the `Objective` record
built from every unit's keys, the objective card, the keywords a user's function must take,
and the variants `loss_type` and `advantage_estimator` name.

To add an option: a module declaring its `Option` (its keys, rules, card row, checks, TRL
names, and the data-flow hooks and step functions it needs), listed in OPTIONS below
(entropy_quantile.py is the example of a data-flow option); a surrogate's unit also brings its
`Surrogate` (sapo.py), an estimator's its `Estimator` (rloo.py): SURROGATES and ESTIMATORS
are read from the units."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from grpolab.check import Check
from grpolab.objective import (
    cispo,
    delta,
    dual_clip,
    dynamic_sampling,
    entropy,
    entropy_quantile,
    gspo,
    kl,
    log_ratio_clamp,
    reinforce_pp,
    rloo,
    sapo,
    tis,
    truncation,
)
from grpolab.objective.base import ALWAYS, Estimator, Needs, Option, Passed, Surrogate
from grpolab.objective.profiles import PROFILE, PROFILE_SOURCES, PROFILES, differs_from_seed
from grpolab.objective.seed import SEED
from grpolab.schema import SchemaError, check_fields, choices_of, key

# Every option's unit after the seed, the profiles and the choices below, in the order of the
# card's fragments and of their checks: add an option here.
OPTIONS: tuple[Option, ...] = (
    gspo.GSPO,
    log_ratio_clamp.LOG_RATIO_CLAMP,
    cispo.CISPO,
    sapo.SAPO,
    delta.DELTA,
    dual_clip.DUAL_CLIP,
    kl.KL,
    tis.TIS,
    dynamic_sampling.DYNAMIC_SAMPLING,
    truncation.TRUNCATION,
    entropy.ENTROPY,
    entropy_quantile.ENTROPY_QUANTILE,
    rloo.RLOO,
    reinforce_pp.REINFORCE_PP,
)

# The variants a name picks (the seed's clip and GRPO advantages are core's own).
_SURROGATE_UNITS = [u for u in OPTIONS if u.policy_term]
SURROGATES: dict[str, Surrogate] = {u.policy_term.name: u.policy_term for u in _SURROGATE_UNITS}
ESTIMATORS: dict[str, Estimator] = {u.estimator.name: u.estimator for u in OPTIONS if u.estimator}
# The policy_loss keywords each surrogate reads besides eps_low / eps_high: its unit's keys.
SURROGATE_OPTIONS: dict[str, tuple[str, ...]] = {
    u.policy_term.name: tuple(p.keyword for p in u.loss if p.policy) for u in _SURROGATE_UNITS
}

AGGREGATIONS = ("sequence", "token", "constant")
# TRL's loss_type names for the normalisers; a surrogate's name also names the normaliser
# TRL gives it.
LOSS_TYPE_ALIASES = {"grpo": "sequence", "bnpo": "token", "dapo": "token", "dr_grpo": "constant"}
LOSS_TYPE_ALIASES |= {s.name: s.aggregation for s in SURROGATES.values()}
LOSS_TYPES = (*AGGREGATIONS, *sorted(LOSS_TYPE_ALIASES))
ADVANTAGE_ESTIMATORS = ("grpo", *ESTIMATORS)
SURROGATE_NAMES = ("clip", *SURROGATES)


def aggregation(loss_type: str) -> str:
    """The normaliser a loss_type names: one of AGGREGATIONS, TRL's aliases resolved."""
    resolved = LOSS_TYPE_ALIASES.get(loss_type, loss_type)
    if resolved not in AGGREGATIONS:
        raise ValueError(f"loss_type={loss_type!r} is not one of {list(LOSS_TYPES)}")
    return resolved


def surrogate_of(loss_type: str) -> str:
    """The policy term a loss_type picks: a registered surrogate's name, else "clip"."""
    return loss_type if loss_type in SURROGATES else "clip"


@dataclass(frozen=True)
class ChoiceKeys:
    # sequence | token | constant, TRL's grpo | bnpo | dapo | dr_grpo for them, or a surrogate
    # of its own: cispo (epsilon_high is then the cap on the ratio, e.g. 5) | sapo.
    loss_type: str = key("sequence", choices=LOSS_TYPES)
    # grpo | rloo (leave-one-out baseline) | reinforce_pp (group baseline, batch-whitened).
    advantage_estimator: str = key("grpo", choices=ADVANTAGE_ESTIMATORS)
    # The policy term, apart from the normaliser: clip (the seed's clipped surrogate) | cispo
    # | sapo; null = the one loss_type names (clip, or TRL's cispo / sapo with their own
    # normaliser). surrogate: sapo with loss_type: token is SAPO over the batch's tokens.
    surrogate: str | None = key(None, choices=(None, *SURROGATE_NAMES))


def _aggregation_card(o) -> dict[str, str]:
    normaliser = {
        "sequence": "mean over each sequence's completion tokens, then mean over sequences",
        "token": "sum over all completion tokens / number of completion tokens",
        "constant": f"sum over all completion tokens / (B * {o.max_completion_length})",
    }[o.aggregation]
    return {"aggregation": f"{o.aggregation} ({o.loss_type}): {normaliser}{o.mark('loss_type')}"}


def _choice_rules(o) -> None:
    if o.aggregation == "constant" and not o.max_completion_length:
        raise SchemaError("loss_type", o.loss_type, "max_completion_length > 0 with it")
    named = surrogate_of(o.loss_type)
    if o.surrogate is not None and named != "clip" and o.surrogate != named:
        raise SchemaError(
            "surrogate", o.surrogate, f"null or {named} with loss_type={o.loss_type} (which "
            f"names the {named} surrogate); for {o.surrogate} with {named}'s normaliser: "
            f"loss_type={aggregation(o.loss_type)}"
        )  # fmt: skip


CHOICES = Option(
    name="choices",
    keys=ChoiceKeys,
    rules=_choice_rules,
    loss=(Passed("surrogate", unless=None),),
    card=_aggregation_card,
    trl={"loss_type": "loss_type"},
)

# Every unit, in the order of the card's fragments and of their checks.
UNITS: tuple[Option, ...] = (SEED, PROFILE, CHOICES, *OPTIONS)
# The objective card's rows, in order (a row no unit writes is left out).
CARD_ROWS = ("groups", "advantage", "zero std", "ratio", "logp_old", "sampled", "clip", "KL",
             "aggregation", "inner epochs", "engine", "entropy", "truncated",
             "sampling")  # fmt: skip

# The `objective` keys: every unit's, the seed's first; with the variants they pick.
ObjectiveKeys = dataclasses.make_dataclass(
    "ObjectiveKeys",
    [],
    bases=tuple(u.keys for u in reversed(UNITS) if u.keys),
    frozen=True,
    namespace={
        "aggregation": property(lambda self: aggregation(self.loss_type)),
        "policy_term": property(lambda self: self.surrogate or surrogate_of(self.loss_type)),
    },
)
ObjectiveKeys.__doc__ = """Every unit's keys of the objective: the `objective` config section.
`aggregation`: the normaliser its loss_type picks; `policy_term`: the surrogate it computes
(`surrogate`, or the one its loss_type names)."""


@dataclass(frozen=True)
class Objective(ObjectiveKeys):
    """Everything that decides which "GRPO" is optimised, with TRL's names, validated on
    construction (each key's declared constraint, then each unit's rules). The trainer's loss,
    the objective card and the preflight's expectations all read this one record."""

    # From the other sections: G, the sampling temperature, the constant normaliser's L, and
    # the sampler's truncation (top-p, top-k: 1 and 0 are off).
    num_generations: int = 8
    temperature: float = 1.0
    max_completion_length: int | None = None
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        check_fields(self)
        for unit in UNITS:
            unit.rules(self)

    @property
    def truncated_sampling(self) -> bool:
        """The engine samples from softmax(logits / T) cut to its top-k / top-p."""
        return self.top_k > 0 or self.top_p < 1

    @property
    def on_policy(self) -> bool:
        """logp_old is the sampling policy's own log-probs, taken by the trainer."""
        return self.logprob_source == "trainer"

    @classmethod
    def of(cls, config: Any) -> Objective:
        """From an Objective, a mapping of its fields, or any object with some of its fields
        as attributes; missing fields take the defaults."""
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(config, Objective):
            return config
        if isinstance(config, Mapping):
            unknown = sorted(set(config) - set(names))
            if unknown:
                raise ValueError(f"unknown objective keys {unknown}; valid keys: {names}")
            return cls(**config)
        given = {n: getattr(config, n) for n in names if hasattr(config, n)}
        if not given:  # a whole config, say: its defaults would stand in for its objective
            raise TypeError(
                f"Objective.of({type(config).__name__}): none of the objective's fields is "
                "there; pass an Objective (config.objective_of(cfg) for a run's config) or its "
                "fields"
            )
        return cls(**given)

    def loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `grpo_loss` (after the tensors) this objective sets: the
        seed's five, and each option's where it differs from its default."""
        return _passed(self, "loss")

    def advantage_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `group_advantages` (after rewards and group size): scale
        and eps, the conventions and the estimator where they differ from the seed's."""
        return _passed(self, "advantages")

    def policy_kwargs(self) -> dict[str, Any]:
        """policy_loss's options this objective sets (beyond eps_low / eps_high)."""
        kwargs = _passed(self, "loss", policy_only=True)
        return kwargs | ({"loss": self.policy_term} if self.policy_term != "clip" else {})

    def differs_from_seed(self, name: str) -> bool:
        """Whether the resolved value of a profile convention is not the seed's."""
        return differs_from_seed(self, name)

    def mark(self, *names: str) -> str:
        """The card's mark, " *", where a convention differs from the seed's."""
        return " *" if any(self.differs_from_seed(n) for n in names) else ""


def _passed(o: Objective, to: str, policy_only: bool = False) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for unit in UNITS:
        if not unit.active(o):
            continue
        for p in getattr(unit, to):
            value = getattr(o, p.key)
            if (p.policy or not policy_only) and (p.unless is ALWAYS or value != p.unless):
                kwargs[p.keyword] = value
    return kwargs


def _all_passed():
    return [p for unit in UNITS for p in (*unit.loss, *unit.advantages)]


# grpo_loss's options beyond the seed's and the value at which each is left out.
LOSS_OPTION_DEFAULTS = {
    p.keyword: p.unless for u in UNITS for p in u.loss if p.unless is not ALWAYS
}
# Keyword arguments a user's function may leave out: a function without them computes one
# fixed convention, which the preflight checks against the declared one. The others change
# the algorithm and need a function that takes them.
CONVENTION_KWARGS = tuple(
    dict.fromkeys(
        [p.keyword for p in _all_passed() if p.convention]
        + [k for u in UNITS for k in u.convention_keywords]
    )
)


# grpo_loss's options beyond the seed's five, by keyword; the KL term's, in its order.
LOSS_OPTIONS = {p.keyword: p for u in UNITS if u is not SEED for p in u.loss}
KL_OPTIONS = tuple(p.keyword for p in kl.KL.loss)


def choices(key: str) -> tuple[Any, ...] | None:
    """The values the objective key `key` may take (None: any of its type)."""
    return choices_of(next(f for f in dataclasses.fields(ObjectiveKeys) if f.name == key))


def check_value(key: str, value: Any, name: str | None = None) -> None:
    """`value` held to the constraint the objective key `key` declares (SchemaError naming
    `name`, the caller's word for it, or the key)."""
    field = next(f for f in dataclasses.fields(ObjectiveKeys) if f.name == key)
    holder = dataclasses.make_dataclass("_One", [(key, Any, field)], frozen=True)
    try:
        check_fields(holder(value))
    except SchemaError as e:
        raise SchemaError(name or key, value, e.expected) from None


def keywords_not_taken(fn: Callable, optional) -> frozenset[str]:
    """Those of the `optional` keywords that `fn`'s signature does not take (none when it
    takes any keyword, or has no signature to read): a user's function written for one
    convention is called as it was written, and the preflight checks that it computes the
    declared one."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return frozenset()
    return frozenset(optional) - set(params)


def accepted_kwargs(fn: Callable, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`kwargs` without the conventions `fn` does not take (CONVENTION_KWARGS); everything
    else is passed as given."""
    dropped = keywords_not_taken(fn, CONVENTION_KWARGS)
    return {k: v for k, v in kwargs.items() if k not in dropped}


def required_keywords(o: Objective) -> list[Needs]:
    """What the declared objective needs a user's functions to take: each keyword it passes
    that is not a convention, and what its units need besides (token_weights, entropy)."""
    needs = []
    for function, to in (("grpo_loss", "loss"), ("group_advantages", "advantages")):
        for keyword in _passed(o, to):
            if keyword not in CONVENTION_KWARGS:
                passed = next(p for p in _all_passed() if p.keyword == keyword)
                needs.append(Needs(function, keyword, passed.key))
    return needs + [n for unit in UNITS for n in unit.needs(o)]


def surrogate_needs_grpolab(o: Objective) -> str | None:
    """Why a user's grpo_loss cannot compute the declared objective (None: it can): a
    surrogate other than the clip is picked inside grpolab's grpo_loss by its loss_agg."""
    if o.policy_term == "clip":
        return None
    given = f"surrogate={o.surrogate}" if o.surrogate else f"loss_type={o.loss_type}"
    return f"{given} is computed by grpolab's grpo_loss (its loss_agg or surrogate picks it)"


# A profile's convention that an explicitly given key makes meaningless is not applied:
# (the convention, when it yields, why). The same value given explicitly stays an error.
PROFILE_YIELDS: tuple[tuple[str, Callable[[Any], bool], Callable[[Any], str]], ...] = tuple(
    (bound.key, lambda o: o.policy_term != "clip",
     lambda o: f"{o.loss_type.upper()} has no clipped surrogate to bound")
    for bound in (dual_clip.BOUND, delta.BOUND)
)  # fmt: skip


def objective_card(config: Any) -> str:
    """The resolved objective on one screen, printed at the start of every run: the profile
    and every resolved convention, marked * where it differs from the seed's.

    `config`: anything `Objective.of` takes."""
    o = Objective.of(config)
    rows: dict[str, str] = {}
    for unit in UNITS:
        for row, text in unit.card(o).items():
            rows[row] = rows.get(row, "") + text
    header = (
        f"GRPO objective, profile {o.profile} ({PROFILE_SOURCES[o.profile]}); * differs from "
        "the seed's"
    )
    return "\n".join([header, *(f"  {row:<14}{rows[row]}" for row in CARD_ROWS if row in rows)])


def active_units(o: Objective) -> tuple[Option, ...]:
    """The units the objective declares, in UNITS order: those whose data-flow hooks the
    step calls."""
    return tuple(unit for unit in UNITS if unit.active(o))


def rows_can_leave_loss(o: Objective) -> bool:
    """Whether a declared unit takes rows out of the loss (its loss_rows, or the filler of
    its keep_groups)."""
    return any(u.loss_rows or u.keep_groups for u in active_units(o))


def row_readers(o: Any) -> list[str]:
    """The keys whose loss term reads rows without advantage (the KL, the entropy bonus)
    and are non-zero: the update then runs every row. `o`: an Objective or the config's
    objective section."""
    return [u.reads_every_row for u in UNITS if u.reads_every_row and getattr(o, u.reads_every_row)]


def estimator_of(o: Any) -> Estimator | None:
    """The registered estimator the objective declares (None: GRPO's own)."""
    return ESTIMATORS.get(o.advantage_estimator)


# Each unit's step functions, by the name a user's file replaces them by (core.CoreFunctions).
UNIT_FUNCTIONS: dict[str, Callable] = {n: fn for u in UNITS for n, fn in u.functions.items()}
# TRL's GRPOConfig names the units declare -> the dotted key (config.trl.TRL_KEYS).
TRL_NAMES: dict[str, str] = {t: f"objective.{k}" for u in UNITS for t, k in u.trl.items()}


def unit_checks() -> tuple[Check, ...]:
    """Every unit's checks, in UNITS order."""
    return tuple(c for unit in UNITS for c in unit.checks)


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "CONVENTION_KWARGS",
    "ESTIMATORS",
    "KL_OPTIONS",
    "LOSS_OPTIONS",
    "LOSS_OPTION_DEFAULTS",
    "LOSS_TYPES",
    "LOSS_TYPE_ALIASES",
    "PROFILES",
    "PROFILE_SOURCES",
    "PROFILE_YIELDS",
    "SURROGATES",
    "SURROGATE_NAMES",
    "SURROGATE_OPTIONS",
    "TRL_NAMES",
    "UNITS",
    "UNIT_FUNCTIONS",
    "Objective",
    "ObjectiveKeys",
    "accepted_kwargs",
    "active_units",
    "aggregation",
    "check_value",
    "choices",
    "estimator_of",
    "keywords_not_taken",
    "objective_card",
    "required_keywords",
    "row_readers",
    "rows_can_leave_loss",
    "surrogate_needs_grpolab",
    "surrogate_of",
]
