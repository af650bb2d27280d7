"""The seed's objective: G samples per prompt, group advantages (r - mean) / (std + eps) with
the population std and exactly 0 for a flat group, the clipped ratio against an extra
forward's log-probs, k3 KL weighted by beta, an explicit normaliser. Its maths are
grpolab.core's six functions; this unit declares its keys, what they pass and its card rows.
The conventions the peers differ in (the std, the zero-std guard) are keys of it that the
profiles set (`grpolab.objective.profiles`)."""

from __future__ import annotations

from dataclasses import dataclass

from grpolab.objective.base import Option, Passed
from grpolab.schema import Inert, at_least, finite_in, key


@dataclass(frozen=True)
class SeedKeys:
    # The clip range of the ratio: [1 - epsilon, 1 + epsilon_high] (DAPO's clip-higher: 0.28).
    epsilon: float = key(0.2, **finite_in(0, 1))
    epsilon_high: float = key(0.28, **finite_in(0))
    beta: float = key(0.0, **at_least(0))  # k3 KL weight; > 0 loads a frozen reference copy
    num_iterations: int = key(1, **at_least(1))  # mu: inner epochs over each batch
    scale_rewards: str = key("group", choices=("group", "batch", "none"))
    advantage_eps: float = key(1e-4, **at_least(0))
    # Conventions (set by the profiles): the std of the advantages' groups, population
    # (divide by G) or sample (G - 1); a group whose std <= advantage_eps gets advantages
    # exactly 0 (zero_std_guard) or is divided by std + advantage_eps like any other.
    advantage_std: str = key("population", choices=("population", "sample"))
    zero_std_guard: bool = True
    # trainer: logp_old from the training model before any update (exact) | engine: the
    # rollout engine's log-probs (saves a forward; biased by the two numerical stacks).
    logprob_source: str = key("trainer", choices=("trainer", "engine"))


def _card(o) -> dict[str, str]:
    source = {
        "trainer": "an extra forward of the training model before any update (exact)",
        "engine": "the rollout engine's log-probs (saves a forward, biased)",
    }[o.logprob_source]
    guard = (
        f"exactly 0 where group std <= {o.advantage_eps:g}"
        if o.zero_std_guard
        else "no zero-std guard: an equal-reward group is 0, a near-equal one is divided by "
        f"std + {o.advantage_eps:g}"
    )
    rows = {
        "groups": f"G = {o.num_generations} samples per prompt, contiguous",
        "advantage": _advantage_formula(o) if o.advantage_estimator == "grpo" else "",
        "zero std": guard + o.mark("zero_std_guard"),
        "logp_old": source,
        "inner epochs": f"num_iterations = {o.num_iterations}",
        "entropy": "masked mean reported",
    }
    if o.importance_sampling_level == "token":
        rows["ratio"] = f"exp(logp_new - logp_old) per token at temperature {o.temperature:g}"
    if o.truncated_sampling:
        rows["sampled"] = _sampled_row(o)
    if o.policy_term == "clip":
        lo, hi = 1 - o.epsilon, 1 + o.epsilon_high
        rows["clip"] = (
            f"ratio in [1 - {o.epsilon:g}, 1 + {o.epsilon_high:g}] = [{lo:g}, {hi:g}]; per token "
            f"-min(ratio*A, clip(ratio)*A){o.mark('epsilon', 'epsilon_high')}"
        )
    return rows


def _sampled_row(o) -> str:
    """What the engine draws from under top-k / top-p, and which distribution every log-prob
    is of (the engine's, the trainer's, the ratio's and the importance weights')."""
    cut = [f"top-k {o.top_k}"] * (o.top_k > 0) + [f"top-p {o.top_p:g}"] * (o.top_p < 1)
    return (
        f"from softmax(logits / {o.temperature:g}) cut to its {' then '.join(cut)}; every "
        f"log-prob (engine, trainer, ratio, importance weights) of the untruncated "
        f"softmax(logits / {o.temperature:g})"
    )


def _advantage_formula(o) -> str:
    divisor = "G - 1" if o.advantage_std == "sample" else "G"
    std = {
        "group": f"{o.advantage_std} std of the group (divide by {divisor})",
        "batch": f"{o.advantage_std} std of the whole batch",
        "none": "none: mean-centred only (Dr. GRPO)",
    }[o.scale_rewards]
    return f"(r - mean_group) / ({std} + {o.advantage_eps:g})" + o.mark(
        "advantage_std", "advantage_eps"
    )


ADVANTAGE_CAUSES = ("objective.advantage_estimator", "objective.scale_rewards",
                    "objective.zero_std_guard", "objective.dynamic_sampling")  # fmt: skip
INERT = (
    Inert(("objective.scale_rewards",), ("objective.advantage_estimator",),
          lambda c: c.objective.advantage_estimator != "grpo",
          "with objective.advantage_estimator={c.objective.advantage_estimator}: it scales "
          "GRPO's advantages (rloo's are not scaled, reinforce_pp's are whitened over the batch)"),
    Inert(("objective.advantage_eps",), ADVANTAGE_CAUSES,
          lambda c: (c.objective.advantage_estimator != "grpo"
                     or c.objective.scale_rewards == "none")
          and not c.objective.zero_std_guard and not c.objective.dynamic_sampling,
          "here: nothing divides by a std (advantage_estimator="
          "{c.objective.advantage_estimator}, scale_rewards={c.objective.scale_rewards}) and "
          "neither zero_std_guard nor dynamic_sampling compares a group's std with it"),
    Inert(("objective.advantage_std",), ADVANTAGE_CAUSES,
          lambda c: (c.objective.advantage_estimator == "rloo" or (
              c.objective.advantage_estimator == "grpo" and c.objective.scale_rewards == "none"))
          and not c.objective.zero_std_guard,
          "here: no std is used (advantage_estimator={c.objective.advantage_estimator}, "
          "scale_rewards={c.objective.scale_rewards}, zero_std_guard=false)"),
)  # fmt: skip
SEED = Option(
    name="seed",
    trl={k: k for k in ("epsilon", "epsilon_high", "beta", "num_iterations")},
    keys=SeedKeys,
    loss=(
        Passed("epsilon", "eps_low"),
        Passed("epsilon_high", "eps_high"),
        Passed("beta"),
        Passed("loss_type", "loss_agg"),
        Passed("max_completion_length"),
    ),
    advantages=(
        Passed("scale_rewards", "scale"),
        Passed("advantage_eps", "eps"),
        Passed("advantage_std", "std", "population", convention=True),
        Passed("zero_std_guard", unless=True, convention=True),
        Passed("advantage_estimator", "estimator", "grpo"),
    ),
    card=_card,
    inert=INERT,
    # The rows no reward function could score and the rows out of the loss do not vote in
    # their group's statistics (TRL's convention for all-None rewards).
    convention_keywords=("valid",),
)
