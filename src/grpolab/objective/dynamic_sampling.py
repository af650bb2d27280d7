"""DAPO's dynamic sampling: a group whose rewards do not vary (std <= advantage_eps) teaches
nothing, so it is dropped and more prompts are sampled, at most dynamic_sampling_max_rounds
extra rounds per step; if the batch is still short, dropped groups fill it, out of the loss
and its normaliser."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpolab.check import Check, Mutant
from grpolab.objective.base import Option
from grpolab.schema import Inert, key


@dataclass(frozen=True)
class DynamicSamplingKeys:
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = key(
        4, check=lambda v: v >= 0, expected="an integer >= 0 (extra generation rounds per step)"
    )


def informative_groups(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """Which groups teach something: population std of the group's rewards > eps, computed
    in float64 (DAPO's dynamic sampling keeps these and samples more). [B] -> [n_groups] bool."""
    r = rewards.double().view(-1, group_size)
    return r.std(dim=1, unbiased=False) > eps


def _active(o) -> bool:
    return o.dynamic_sampling


def keep_groups(o, fns, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] rewards -> [B // G] bool: the groups whose rewards vary (the function table's
    informative_groups, a user's where given)."""
    return fns.informative_groups(rewards, group_size, o.advantage_eps)


def _card(o) -> dict[str, str]:
    if not o.dynamic_sampling:
        return {}
    return {
        "sampling": f"dynamic: groups with reward std <= {o.advantage_eps:g} dropped, up to "
        f"{o.dynamic_sampling_max_rounds} more rounds"
    }


def normaliser(ctx):
    """The designed batch's flat groups (equal rewards, 1e-9 noise) must be dropped, its
    informative ones kept: a kept flat group's tokens dilute the loss's normaliser."""
    rewards, lengths = ctx.designed_rewards()
    keep = ctx.impl.informative_groups(rewards.float(), 4, ctx.objective.advantage_eps).bool()
    flat = torch.tensor([False, True, True, False])  # equal rewards, 1e-9 noise
    leaked = float(lengths.view(-1, 4)[keep & flat].sum())
    lost = float(lengths.view(-1, 4)[~keep & ~flat].sum())
    return ctx.result(
        "tokens of zero-variance groups kept in the loss's normaliser (informative groups' "
        f"tokens dropped: {lost:g})",
        leaked + lost,
        "0",
        leaked + lost == 0,
    )


DYNAMIC_SAMPLING = Option(
    name="dynamic_sampling",
    keys=DynamicSamplingKeys,
    active=_active,
    card=_card,
    functions={"informative_groups": informative_groups},
    keep_groups=keep_groups,
    extra_rounds=lambda o: o.dynamic_sampling_max_rounds,
    metric_prefix="dynamic",
    inert=(
        Inert(
            ("objective.dynamic_sampling_max_rounds",),
            ("objective.dynamic_sampling",),
            lambda c: not c.objective.dynamic_sampling,
            "with objective.dynamic_sampling=false",
        ),
    ),
    checks=(
        Check(
            "dynamic_sampling.normaliser",
            0,
            "drop (do not just zero) the groups whose rewards do not vary: kept, their tokens "
            "still count in the loss's normaliser and dilute every gradient",
            normaliser,
            when=lambda ctx: ctx.objective.dynamic_sampling,
            mutants=(Mutant("dynamic_keeps_all", {"dynamic_sampling": True}),),
            declared_only=True,
        ),
    ),
)
