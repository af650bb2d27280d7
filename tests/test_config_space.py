"""A property test over the valid config space: grpolab's own functions pass every check of
the preflight under every sampled config (a false alarm is as bad as a missed bug).

Configs are drawn with a fixed seed from every key the objective has (profiles, clip values
across (0, 1), G, temperature, beta, loss types, estimators, scales, the menu's options and
their combinations) and from the keys the checks read besides (the sampler's top-k and top-p,
the minibatch and micro-batch split) and go through load_config, so only configs it accepts
are checked. CI checks CI_CONFIGS of them at each of CI_SEEDS, each mutant of the seed's
functions under MUTANT_CONFIGS, and each of the menu's mutants under MENU_CONFIGS with its
option declared on top;
`python tests/test_config_space.py N [SEED] [--mutants] [--menu]` checks N offline and prints
each false alarm (and each mutant that passes its check where it is a bug).
"""

from __future__ import annotations

import functools
import random
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_policy
from test_checks import CAUGHT_BY, MENU_CAUGHT_BY

from grpolab import core
from grpolab.checks.context import Context, PreflightBatch
from grpolab.checks.registry import BY_ID
from grpolab.checks.runner import run_check, run_checks
from grpolab.config import ConfigError, load_config, skips_zero_advantage
from grpolab.functions import core_functions, load_impl
from grpolab.rollout import SamplingParams
from grpolab.rollout.hf import HFEngine
from grpolab.train.preflight import settings_from_config

CI_CONFIGS = 40
CI_SEEDS = (21, 2026)
MUTANT_CONFIGS = 12  # of the same draw, for each mutant of the seed's functions
MUTANTS = Path(__file__).parent / "mutants"
# Where a mutant is a bug at all: beyond these, wherever its named check runs. (A symmetric
# clip cannot be swapped; k1 declared is what naive_kl computes; ...)
APPLIES = {
    "no_zero_std_guard": lambda o: o.zero_std_guard,
    "eps_swapped": lambda o: o.epsilon != o.epsilon_high,
    "naive_kl": lambda o: o.kl_estimator == "k3",
    "reversed_k3": lambda o: o.kl_estimator == "k3",
    "token_mean_declared_sequence": lambda o: core.aggregation(o.loss_type) != "token",
    "no_temperature": lambda o: o.temperature != 1.0,
    # under a token mean, GSPO's sequence value weighs each sequence by its length as declared
    "gspo_length_weighted": lambda o: core.aggregation(o.loss_type) != "token",
}
MENU_CONFIGS = 3  # sampled configs per menu mutant, its option declared on top of each
PROMPTS = ["37+48=", "5+5=", "12+30=", "99+1="]


def _clip(rng: random.Random) -> float:
    return round(rng.uniform(0.01, 0.99), 3)


def sample_overrides(rng: random.Random) -> list[str]:
    """One draw from the config space, as the command line's overrides."""
    t: dict[str, object] = {}
    profile = rng.choice(["seed", "trl", "verl", "openrlhf"])
    if profile != "seed":
        t["profile"] = profile
    t["num_generations"] = rng.choice([2, 4, 8])
    t["loss_type"] = rng.choice(
        ["sequence", "token", "constant", "grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo"]
    )
    if t["loss_type"] == "sapo":
        t["sapo_temperature_pos"] = round(rng.uniform(0.3, 3.0), 2)
        t["sapo_temperature_neg"] = round(rng.uniform(0.3, 3.0), 2)
    t["epsilon"] = _clip(rng)
    if t["loss_type"] == "cispo":
        t["epsilon_high"] = round(rng.uniform(1.0, 8.0), 2)
    else:
        t["epsilon_high"] = rng.choice([t["epsilon"], _clip(rng), _clip(rng)])
    t["beta"] = rng.choice([0.0, 0.04, round(rng.uniform(0.001, 1.0), 3)])
    if t["beta"]:
        t["kl_estimator"] = rng.choice(["k1", "k2", "k3"])
        t["kl_clamp"] = rng.choice(["null", 10.0, round(rng.uniform(0.5, 20), 2)])
        t["use_bias_correction_kl"] = rng.choice(["true", "false"])
    t["advantage_estimator"] = rng.choice(["grpo", "grpo", "rloo", "reinforce_pp"])
    if t["advantage_estimator"] == "grpo":
        t["advantage_std"] = rng.choice(["population", "sample"])
        t["scale_rewards"] = rng.choice(["group", "batch", "none"])
        t["zero_std_guard"] = rng.choice(["true", "false"])
    t["advantage_eps"] = rng.choice([0.0, 1e-6, 1e-4, 0.01])
    t["importance_sampling_level"] = rng.choice(["token", "token", "sequence"])
    if rng.random() < 0.3:
        t["delta"] = round(rng.uniform(1.05, 4.0), 2)
    if rng.random() < 0.3:
        t["dual_clip"] = round(rng.uniform(1.5, 6.0), 2)
    t["mask_truncated_completions"] = rng.choice(["true", "false"])
    t["dynamic_sampling"] = rng.choice(["true", "false"])
    t["entropy_coef"] = rng.choice([0.0, 0.0, 0.01])
    engine_side = rng.random()
    if engine_side < 0.15:  # the engine's log-probs as logp_old
        t["logprob_source"] = "engine"
    elif engine_side < 0.45:  # importance weights against them (logp_old the trainer's)
        t["tis_cap"] = round(rng.uniform(1.5, 10), 2)
        t["tis_mode"] = rng.choice(
            ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
        )
    t["num_iterations"] = rng.choice([1, 1, 2])
    # The options added since, from a generator of their own (seeded by the draw so far), so
    # that the draws above, and the configs every seed gives, stay as they were.
    extra = random.Random(" ".join(f"{k}={v}" for k, v in t.items()))
    if t["loss_type"] not in ("cispo", "sapo") and extra.random() < 0.3:
        bounded = "delta" in t or "dual_clip" in t  # bounds of the clip alone
        others = [] if bounded else ["sapo"] + ["cispo"] * (t["epsilon_high"] > 1)
        t["surrogate"] = extra.choice(["clip", *others])
    t["top_entropy_quantile"] = extra.choice([1.0, 1.0, 0.2, round(extra.uniform(0.05, 1), 2)])
    overrides = [f"trainer.{k}={v}" for k, v in t.items()]
    overrides.append(f"rollout.temperature={round(rng.uniform(0.3, 1.5), 2)}")
    overrides.append(f"rollout.top_k={rng.choice([0, 0, 0, 5, 20])}")
    overrides.append(f"rollout.top_p={rng.choice([1.0, 1.0, 0.9, 0.7])}")
    # The batch of len(PROMPTS) prompts, cut as the run cuts it.
    G = t["num_generations"]
    overrides.append(f"batch.prompts_per_step={len(PROMPTS)}")
    overrides.append(f"batch.mini_batch_size={rng.choice(['null', 2 * G, G])}")
    overrides.append(f"batch.gradient_accumulation_steps={rng.choice([1, 2, 4])}")
    return overrides


@functools.cache
def valid_configs(n: int, seed: int):
    """The first n sampled configs that load_config accepts: (overrides, config)."""
    rng, found, tries = random.Random(seed), [], 0
    while len(found) < n:
        tries += 1
        assert tries < 100 * n, "the sampler rarely draws a valid config"
        overrides = sample_overrides(rng)
        try:
            found.append((overrides, load_config(None, overrides)))
        except ConfigError:
            continue
    return found


class Batches:
    """One real rollout of the tiny model per G, rewards that vary in some groups only.
    `tiny`: (the tiny model of seed 0, its character tokenizer), built here when not given."""

    def __init__(self, tiny=None):
        self.model, self.tokenizer = tiny or tiny_policy()
        self.engine = HFEngine(self.model, self.tokenizer)
        self.model64 = None  # the float64 copy the gradient checks compare with
        self.cache: dict[tuple, PreflightBatch] = {}

    def get(self, cfg) -> PreflightBatch:
        """The batch of cfg's G, sampled as cfg's rollout section samples (temperature, top-k,
        top-p)."""
        r = cfg.rollout
        key = (cfg.batch.num_generations, r.temperature, r.top_k, r.top_p)
        if key not in self.cache:
            G = cfg.batch.num_generations
            params = SamplingParams(
                temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_completion_length=8,
                seed=G,
            )  # fmt: skip
            rollout = self.engine.generate(PROMPTS, G, params)
            g = torch.Generator().manual_seed(G)
            rewards = (torch.rand(len(PROMPTS) * G, generator=g) > 0.5).float()
            rewards.view(-1, G)[-1] = 1.0  # one flat group
            self.cache[key] = PreflightBatch(
                rollout.input_ids,
                rollout.attention_mask,
                rollout.completion_mask,
                rewards,
                G,
                rollout.engine_logprobs,
                tuple(self.engine.stop_ids),
            )
        return self.cache[key]


def false_alarms(batches: Batches, cfg) -> list[tuple[str, float, str]]:
    s = settings_from_config(cfg)
    batch = batches.get(cfg)
    results = run_checks(batches.model, batch, s)
    results += gradient_checks(batches, cfg, batch, s)
    # rewards.variance reads the task's rewards, not the functions: not a claim about them.
    return [
        (r.id, r.measured, r.expected)
        for r in results
        if not r.passed and r.id != "rewards.variance"
    ]


def gradient_checks(batches: Batches, cfg, batch, s) -> list:
    """The preflight's float64 gradient checks on grpolab's functions as the trainer would
    run them: split.gradient_invariance, and update.skip_invariance where rows are skipped."""
    from grpolab.checks.gradients import float64_copy

    if batches.model64 is None:
        batches.model64 = float64_copy(batches.model)
    functions = core_functions(cfg.runtime.logprobs, cfg.runtime.shared_prefix)
    ctx = Context(functions, s, batches.model, batch)
    ctx.shared["float64 copy"] = batches.model64  # made once for every config
    ids = ["split.gradient_invariance"]
    ids += ["update.skip_invariance"] if skips_zero_advantage(cfg) else []
    return [run_check(BY_ID[i], ctx) for i in ids]


@pytest.fixture(scope="module")
def batches(tiny):
    return Batches(tiny)


@pytest.mark.parametrize("seed", CI_SEEDS)
@pytest.mark.parametrize("index", range(CI_CONFIGS))
def test_grpolabs_own_functions_pass_every_check_under_sampled_configs(batches, index, seed):
    overrides, cfg = valid_configs(CI_CONFIGS, seed)[index]
    assert not false_alarms(batches, cfg), overrides


def mutant_misses(batches: Batches, cfg, mutant: str) -> str | None:
    """None when `mutant` fails its named check under cfg (or is no bug there), else why."""
    s = settings_from_config(cfg)
    check = CAUGHT_BY[mutant]
    if not APPLIES.get(mutant, lambda o: True)(s.objective):
        return None
    impl = load_impl(MUTANTS / f"{mutant}.py")
    batch = batches.get(cfg)
    results = run_checks(batches.model, batch, s, impl=impl, only={check})  # that check alone
    if not results or not results[0].passed:
        return None
    return f"{mutant} passes {check} ({results[0].measured})"


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_mutant_fails_its_check_under_sampled_configs(batches, mutant):
    for overrides, cfg in valid_configs(CI_CONFIGS, CI_SEEDS[0])[:MUTANT_CONFIGS]:
        assert mutant_misses(batches, cfg, mutant) is None, overrides


SAMPLING_KEYS = ("temperature", "top_k", "top_p")  # declared with the objective, set in rollout


def with_declared(overrides: list[str], declared: dict) -> list[str]:
    """A sampled config's overrides with a mutant's declared options on top (its profile
    first, so that its keys win over the profile's)."""
    profile = [f"trainer.profile={declared['profile']}"] if "profile" in declared else []
    keys = [
        f"{'rollout' if k in SAMPLING_KEYS else 'trainer'}.{k}={'null' if v is None else v}"
        for k, v in declared.items()
        if k != "profile"
    ]
    return overrides + profile + keys


def menu_config(overrides: list[str], mutant: str):
    """(overrides, config) of a sampled config with the menu mutant's option declared on
    top, or None where that is no valid config or the mutant no bug there."""
    overrides = with_declared(overrides, MENU_CAUGHT_BY[mutant][1])
    try:
        cfg = load_config(None, overrides)
    except ConfigError:
        return None
    bug_there = APPLIES.get(mutant, lambda o: True)(settings_from_config(cfg).objective)
    return (overrides, cfg) if bug_there else None


def menu_configs(mutant: str, n: int, seed: int):
    """`menu_config` of each of the first 10 n sampled configs, where there is one."""
    found = (menu_config(overrides, mutant) for overrides, _ in valid_configs(10 * n, seed))
    return (pair for pair in found if pair is not None)


def menu_mutant_misses(batches: Batches, cfg, mutant: str) -> tuple[bool, str | None]:
    """(whether the mutant's named check runs under cfg, None when it fails it there, else
    why). A check may not run where another key makes its option inert (delta under SAPO)."""
    check = MENU_CAUGHT_BY[mutant][0]
    impl = load_impl(MUTANTS / f"{mutant}.py")
    s = settings_from_config(cfg)
    results = run_checks(batches.model, batches.get(cfg), s, impl=impl, only={check})
    if not results:
        return False, None
    return True, None if not results[0].passed else f"{mutant} passes {check}"


@pytest.mark.parametrize("mutant", sorted(MENU_CAUGHT_BY))
def test_each_menu_mutant_fails_its_check_under_sampled_configs(batches, mutant):
    """The menu's mutants under sampled configs with their option declared on top (a check
    that catches its bug under the one objective test_checks declares may miss it beside
    other options: a micro-batch of one row, another loss type)."""
    ran = 0
    for overrides, cfg in menu_configs(mutant, MENU_CONFIGS, CI_SEEDS[0]):
        checked, why = menu_mutant_misses(batches, cfg, mutant)
        assert why is None, overrides
        ran += checked
        if ran == MENU_CONFIGS:
            break
    assert ran, f"{MENU_CAUGHT_BY[mutant][0]} ran under no sampled config"


def main(argv: list[str]) -> int:
    numbers = [a for a in argv if not a.startswith("--")]
    n = int(numbers[0]) if numbers else 200
    seed = int(numbers[1]) if len(numbers) > 1 else 0
    batches, alarms, misses, pairs = Batches(), 0, 0, 0
    for overrides, cfg in valid_configs(n, seed):
        failed = false_alarms(batches, cfg)
        if failed:
            alarms += 1
            print(" ".join(overrides), "->", failed)
        for mutant in sorted(CAUGHT_BY) if "--mutants" in argv else []:
            pairs += 1
            why = mutant_misses(batches, cfg, mutant)
            if why:
                misses += 1
                print(" ".join(overrides), "->", why)
        for mutant in sorted(MENU_CAUGHT_BY) if "--menu" in argv else []:
            pair = menu_config(overrides, mutant)
            checked, why = menu_mutant_misses(batches, pair[1], mutant) if pair else (0, None)
            pairs += checked
            if why:
                misses += 1
                print(" ".join(pair[0]), "->", why)
    print(f"{n} valid configs (seed {seed}): {alarms} false alarms; ", end="")
    print(f"{misses} mutant misses of {pairs} (mutant, config) pairs")
    return 1 if alarms or misses else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
