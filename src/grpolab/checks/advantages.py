"""Goal 2, the advantages: the declared std, exactly zero where a group's std ~ 0, contiguous
groups, group sums ~ 0; the declared estimator; the rows out of the vote. Measured on the real
batch's rewards and on designed ones (DESIGNED_REWARDS: G = 4, a flat group, a 1e-9-noise
group, groups an interleaved reading would mix)."""

from __future__ import annotations

import torch

from grpolab import core
from grpolab.check import Check, Mutant
from grpolab.checks import reference
from grpolab.objective import estimator_of
from grpolab.objective.base import max_abs
from grpolab.objective.profiles import profile_objective


def advantage_kwargs(o, lengths: torch.Tensor | None = None) -> dict:
    """group_advantages's keywords for the declared objective: eps, the conventions and the
    estimator (scale left at its default, the group's: the checks measure per-group
    statistics)."""
    kwargs = o.advantage_kwargs()
    del kwargs["scale"]  # the function's default: group
    if kwargs["eps"] == 1e-4:  # the seed's default: a function without eps is checked as before
        del kwargs["eps"]
    estimator = estimator_of(o)
    if estimator is not None and estimator.token_weighted and lengths is not None:
        kwargs["lengths"] = lengths
    return kwargs


def batch_whitened(o) -> bool:
    estimator = estimator_of(o)
    return estimator is not None and estimator.batch_whitened


def advantages_of(ctx, rewards, group_size: int, lengths) -> torch.Tensor:
    fn = ctx.impl.group_advantages
    kwargs = core.accepted_kwargs(fn, advantage_kwargs(ctx.objective, lengths))
    return fn(rewards, group_size, **kwargs).double()


def designed(ctx):
    """(the implementation's, the reference's) advantages of the designed rewards, G = 4."""

    def compute():
        rewards, lengths = ctx.designed_rewards()
        adv = advantages_of(ctx, rewards, 4, lengths)
        return adv, reference.advantages(rewards, 4, ctx.objective, lengths)

    return ctx.memo("advantages.designed", compute)


def contiguous(ctx):
    """The layout, whatever the convention: the samples of a group contiguous, so that
    reordering the groups, and the samples inside each group, reorders the advantages alike."""
    rewards, lengths = ctx.designed_rewards()
    adv, _ = designed(ctx)
    # The groups of G contiguous samples in another order (reversed), and the samples inside
    # group k rotated by k + 1: no reading of the groups but the contiguous one keeps them.
    groups = torch.arange(rewards.numel()).view(-1, 4).flip(0)
    perm = torch.stack([g.roll(k + 1) for k, g in enumerate(groups)]).flatten()
    gap = max_abs(advantages_of(ctx, rewards[perm], 4, lengths[perm]) - adv[perm])
    return ctx.result(
        "max |adv(reordered) - adv reordered| on designed rewards (G = 4), groups and the "
        "samples inside each reordered (group i = samples [i*G, (i+1)*G))",
        gap,
        "<= 1e-6",
        gap <= 1e-6,
    )


def group_sums(ctx):
    o, batch = ctx.objective, ctx.batch
    G = batch.group_size
    lengths = batch.completion_mask.sum(dim=1).double()
    real = advantages_of(ctx, batch.rewards, G, lengths)
    ref_real = reference.advantages(batch.rewards, G, o, lengths)
    adv, ref = designed(ctx)
    sums = max(
        max_abs(real.view(-1, G).sum(1) - ref_real.view(-1, G).sum(1)),
        max_abs(adv.view(-1, 4).sum(1) - ref.view(-1, 4).sum(1)),
    )
    return ctx.result(
        "max |sum of a group's advantages"
        + (" - the whitened reference's" if batch_whitened(o) else "")
        + f"| on the real batch (G = {G}) and designed rewards (G = 4)",
        sums,
        "<= 1e-4",
        sums <= 1e-4,
    )


def declared_std(ctx):
    """advantages.population_std / sample_std: the std of the designed groups with real spread
    equals the reference's (1 when eps is far below the group's std)."""
    o = ctx.objective
    adv, ref = designed(ctx)
    live = torch.tensor([0, 3])  # groups with real spread in the designed batch
    unbiased = o.advantage_std == "sample"
    stds = adv.view(-1, 4)[live].std(dim=1, unbiased=unbiased)
    dev = max_abs(stds - ref.view(-1, 4)[live].std(dim=1, unbiased=unbiased))
    return ctx.result(
        f"max |{o.advantage_std} std of a group's advantages - 1| on designed rewards (G = 4; "
        f"declared {o.advantage_std} std, profile {o.profile})",
        dev,
        "<= 1e-2",
        dev <= 1e-2,
    )


def zero_std_groups(ctx):
    """The designed batch's equal-reward group and 1e-9-noise group, against the reference
    under the objective's guard."""
    o = ctx.objective
    adv, ref = designed(ctx)
    flat, flat_ref = adv.view(-1, 4)[1:3], ref.view(-1, 4)[1:3]
    if o.zero_std_guard and max_abs(flat_ref) == 0.0:
        worst = max_abs(flat)
        what, expected, ok = "max |adv|", "== 0 exactly", worst == 0.0
    elif o.zero_std_guard:  # eps below the noise's std: the guard keeps that group
        worst = max_abs(flat - flat_ref)
        what, expected = f"max |adv - the guarded reference| (eps {o.advantage_eps:g})", "<= 1e-6"
        ok = worst <= 1e-6 and max_abs(adv.view(-1, 4)[1]) == 0.0
    else:
        worst = max_abs(flat - flat_ref)
        what, expected = "max |adv - (r - mean) / (std + eps)| (no zero-std guard)", "<= 1e-6"
        ok = worst <= 1e-6
        if not batch_whitened(o):  # whitening over the batch moves every group
            ok = ok and max_abs(adv.view(-1, 4)[1]) == 0.0
    return ctx.result(
        f"{what} in an equal-reward group and a 1e-9-noise group (designed rewards, G = 4)",
        worst,
        expected,
        ok,
    )


def estimator(ctx):
    adv, ref = designed(ctx)
    gap = max_abs(adv - ref)
    return ctx.result(
        f"max |adv - the {ctx.objective.advantage_estimator} reference| (G = 4, unequal lengths)",
        gap,
        "<= 1e-6",
        gap <= 1e-6,
    )


# Rows out of the vote (no function could score them, or out of the loss) with rewards that
# would move their group's mean and std if they voted; 3 valid rows in every group, so the
# reference is the declared convention on the valid rows with G = 3 (NeMo-RL PR #4160's
# [1, 0, 0] + a masked row: [0.667, -0.333, -0.333] mean-centred).
EXCLUDED_REWARDS = (1.0, 0.0, 0.0, 5.0, -3.0, 0.5, 1.0, 0.0, 0.25, 0.25, 0.25, 1.0)  # binary-exact
EXCLUDED_VALID = (1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0)


def excluded_rows(ctx):
    """Rows given valid=False do not vote in their group's statistics and get advantage
    exactly 0 (TRL PR #5902; NeMo-RL PR #4160)."""
    o = ctx.objective
    rewards = torch.tensor(EXCLUDED_REWARDS, dtype=torch.float64)
    valid = torch.tensor(EXCLUDED_VALID, dtype=torch.bool)
    lengths = ctx.designed_rewards()[1][:12]
    kwargs = core.accepted_kwargs(ctx.impl.group_advantages, advantage_kwargs(o, lengths))
    adv = ctx.impl.group_advantages(rewards, 4, valid=valid, **kwargs).double()
    ref = torch.zeros_like(rewards)
    ref[valid] = reference.advantages(rewards[valid], 3, o, lengths[valid])
    gap = max_abs(adv - ref)
    leaked = max_abs(adv[~valid])
    return ctx.result(
        "max |adv - the reference over the valid rows only| (G = 4, 3 valid per group); "
        f"excluded rows' max |adv| {leaked:.3g}",
        gap,
        "<= 1e-6, excluded rows exactly 0",
        gap <= 1e-6 and leaked == 0.0,
    )


def _grpo_with(std: str):
    return lambda ctx: (
        ctx.objective.advantage_estimator == "grpo" and ctx.objective.advantage_std == std
    )


CHECKS = (
    Check(
        "advantages.contiguous",
        2,
        "the G samples of a prompt are contiguous: rewards.view(-1, G), not view(G, -1) or a "
        "transpose",
        contiguous,
        mutants=(Mutant("interleaved_groups"),),
    ),
    Check(
        "advantages.group_sums",
        2,
        "subtract each group's own mean: r.view(-1, G).mean(dim=1)",
        group_sums,
    ),
    Check(
        "advantages.population_std",
        2,
        "the declared convention is the population std, std(unbiased=False) (divide by G), and "
        "(std + eps); the sample std (divide by G - 1, TRL's and verl's) is another convention: "
        "declare it with objective.profile or objective.advantage_std",
        declared_std,
        when=_grpo_with("population"),
        mutants=(Mutant("unbiased_std"),),
    ),
    Check(
        "advantages.sample_std",
        2,
        "the declared convention is the sample std, std(unbiased=True) (divide by G - 1, as TRL, "
        "verl and OpenRLHF do), and (std + eps); the population std is the seed's: declare it "
        "with objective.advantage_std=population",
        declared_std,
        when=_grpo_with("sample"),
        mutants=(Mutant("population_std", profile_objective("trl", beta=0.04)),),
        declared_only=True,
    ),
    Check(
        "advantages.zero_std_groups",
        2,
        "with the zero-std guard (the seed's), set the advantage to exactly 0 where the group's "
        "std <= eps: torch.where(std > eps, adv, 0); without it (TRL, verl, OpenRLHF) every "
        "group is (r - mean) / (std + eps)",
        zero_std_groups,
        mutants=(Mutant("no_zero_std_guard"),),
    ),
    Check(
        "advantages.estimator",
        2,
        "rloo: r_i minus the mean of the OTHER G - 1 rewards of its group (G / (G - 1) * (r - "
        "mean)); reinforce_pp: r - group mean, then (x - mean) / sqrt(var + 1e-8) over the "
        "batch, each sequence weighted by its completion tokens",
        estimator,
        when=lambda ctx: ctx.objective.advantage_estimator != "grpo",
        mutants=(Mutant("rloo_includes_self", {"advantage_estimator": "rloo"}),),
        declared_only=True,
    ),
    Check(
        "advantages.excluded_rows",
        2,
        "a row no reward function could score (every one returned None) or one out of the loss "
        "must not vote: compute each group's mean and std over its valid rows only (valid [B] "
        "bool) and give the others advantage exactly 0, not reward 0 in the baseline (TRL PR "
        "#5902, NeMo-RL PR #4160)",
        excluded_rows,
        when=lambda ctx: ctx.takes("group_advantages", "valid"),  # else it cannot exclude
        mutants=(Mutant("excluded_rows_vote"),),
        declared_only=True,
    ),
)
