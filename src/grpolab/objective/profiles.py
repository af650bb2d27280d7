"""Whose GRPO: each peer's conventions, as its defaults set them (its GRPO recipe where its
defaults are not GRPO). `objective.profile` picks one; the config applies it at load onto the
keys the file and the overrides did not give (a key set explicitly overrides its profile's
value), and the objective card marks * what differs from the seed's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpolab.objective.base import Option
from grpolab.schema import key

PROFILES: dict[str, dict[str, Any]] = {
    "seed": {
        "advantage_std": "population",
        "advantage_eps": 1e-4,
        "zero_std_guard": True,
        "loss_type": "sequence",
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "log_ratio_clamp": None,
        "dual_clip": None,
        "kl_estimator": "k3",
        "kl_clamp": None,
        "use_bias_correction_kl": False,
    },
    # GRPOConfig's defaults: sample std (nanstd) + 1e-4, no zero guard, loss_type "dapo",
    # epsilon_high = epsilon, k3 times the importance ratio (use_bias_correction_kl).
    "trl": {
        "advantage_std": "sample",
        "advantage_eps": 1e-4,
        "zero_std_guard": False,
        "loss_type": "dapo",
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "log_ratio_clamp": None,
        "dual_clip": None,
        "kl_estimator": "k3",
        "kl_clamp": None,
        "use_bias_correction_kl": True,
    },
    # compute_grpo_outcome_advantage (torch.std + 1e-6), loss_agg_mode "token-mean",
    # clip_ratio 0.2, log-ratio clamped to +-20, dual-clip clip_ratio_c = 3, KL loss
    # "low_var_kl" (k3, d in [-20, 20], value in [-10, 10]).
    "verl": {
        "advantage_std": "sample",
        "advantage_eps": 1e-6,
        "zero_std_guard": False,
        "loss_type": "token",
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "log_ratio_clamp": 20.0,
        "dual_clip": 3.0,
        "kl_estimator": "k3",
        "kl_clamp": 10.0,
        "use_bias_correction_kl": False,
    },
    # The group_norm estimator (std + 1e-9), token-mean loss, eps_clip 0.2, log-ratio
    # clamped to +-20, no dual-clip by default, KL as a loss with k3 clamped to [-10, 10].
    "openrlhf": {
        "advantage_std": "sample",
        "advantage_eps": 1e-9,
        "zero_std_guard": False,
        "loss_type": "token",
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "log_ratio_clamp": 20.0,
        "dual_clip": None,
        "kl_estimator": "k3",
        "kl_clamp": 10.0,
        "use_bias_correction_kl": False,
    },
}
PROFILE_SOURCES = {
    "seed": "grpolab's own",
    "trl": "TRL 1.16 GRPOTrainer's defaults",
    "verl": "verl 0.9's GRPO recipe (core_algos)",
    "openrlhf": "OpenRLHF 0.11's GRPO recipe (group_norm, KL loss k3)",
}


@dataclass(frozen=True)
class ProfileKeys:
    # Whose GRPO: seed | trl | verl | openrlhf. A profile sets each convention in which the
    # trainers differ (the keys in PROFILES) the way that trainer does; a key given
    # explicitly overrides its profile's value. The objective card prints the result.
    profile: str = key("seed", choices=tuple(PROFILES))


def profile_objective(name: str, **keys: Any) -> dict[str, Any]:
    """The objective fields of profile `name` with its conventions applied, and `keys` on top
    (what a config naming the profile and giving `keys` resolves to)."""
    return {"profile": name, **PROFILES[name], **keys}


def differs_from_seed(o: Any, name: str) -> bool:
    """Whether the resolved value of a convention is not the seed's."""
    return getattr(o, name) != PROFILES["seed"][name]


PROFILE = Option(name="profile", keys=ProfileKeys)
