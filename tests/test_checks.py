"""The preflight checks on a tiny real model and a real rollout: the correct core passes every
check, each known silent bug (tests/mutants/*.py) fails the check named for it."""

import json
from pathlib import Path

import pytest
import torch

from grpolab import checks, core
from grpolab.functions import ImplLoadError, load_impl
from grpolab.models import build_char_tokenizer, build_tiny_model
from grpolab.rewards import load_rewards
from grpolab.rewards.probes import probe_rows, run_probes
from grpolab.rollout.base import SamplingParams
from grpolab.rollout.hf import HFEngine
from grpolab.tasks import load_task

MUTANTS = Path(__file__).parent / "mutants"

# mutant file -> the check that must catch it
CAUGHT_BY = {
    "no_shift": "logprobs.shift",
    "bf16_log_softmax": "logprobs.float32",
    "no_temperature": "logprobs.temperature",
    "unbiased_std": "advantages.population_std",
    "no_zero_std_guard": "advantages.zero_std_groups",
    "interleaved_groups": "advantages.contiguous",
    "max_not_min": "clip.values",
    "eps_swapped": "clip.asymmetric",
    "naive_kl": "kl.nonnegative",
    "reversed_k3": "kl.tracks_exact",
    "token_mean_declared_sequence": "norm.aggregation",
    "prompt_in_mask": "norm.masked_gradient",
    "sign_flipped": "loss.sgd_direction",
    "unmasked_ratio_mean": "loss.metrics",
}
# reward mutant file (its function has the file's only public name) -> the probe that catches it
REWARD_CAUGHT_BY = {
    "reward_accepts_echo": "rewards.echo",
    "reward_pays_inaction": "rewards.no_answer",
}

PROFILE_TRL = {"profile": "trl", **core.PROFILES["trl"], "beta": 0.04}
PROFILE_VERL = {"profile": "verl", **core.PROFILES["verl"], "beta": 0.04}
# mutant of the menu's code -> (the check that must catch it, the objective that declares
# the option the bug is in)
MENU_CAUGHT_BY = {
    "gspo_length_weighted": ("gspo.length_weighting", {"importance_sampling_level": "sequence"}),
    "gspo_exp_of_sum": ("gspo.ratio", {"importance_sampling_level": "sequence"}),
    "cispo_no_detach": ("cispo.gradient", {"loss_type": "cispo", "epsilon_high": 5.0}),
    "dual_clip_both_signs": ("clip.dual_clip", {"dual_clip": 3.0}),
    "delta_positive_only": ("clip.delta", {"delta": 2.0}),
    "dynamic_keeps_all": ("dynamic_sampling.normaliser", {"dynamic_sampling": True}),
    "seq_is_wrong_sign": ("engine.is_weights", {"tis_cap": 3.0, "tis_mode": "sequence_mask"}),
    "rloo_includes_self": ("advantages.estimator", {"advantage_estimator": "rloo"}),
    "truncation_inverted": ("truncation.mask", {"mask_truncated_completions": True}),
    "entropy_bonus_added": ("entropy.bonus", {"entropy_coef": 0.01}),
    "entropy_unmasked_metric": ("loss.metrics", {}),
    "kl_without_ratio": ("kl.convention", PROFILE_TRL),
    "kl_unclamped": ("kl.convention", PROFILE_VERL),
    "population_std": ("advantages.sample_std", PROFILE_TRL),
    "excluded_rows_vote": ("advantages.excluded_rows", {}),
    "nan_times_mask": ("loss.masked_nan", {}),
    "kl_sequence_ratio": ("kl.bias_correction_gradient", PROFILE_TRL),
    "micro_scale_by_rows": ("norm.minibatch_invariance", {"loss_type": "token"}),
    "sequence_counts_masked_rows": (
        "norm.minibatch_invariance",
        {"loss_type": "sequence", "mask_truncated_completions": True},
    ),
}
# Every profile, every option of the menu: grpolab's own functions pass every check.
DECLARED = {
    "trl": PROFILE_TRL,
    "verl": PROFILE_VERL,
    "openrlhf": {"profile": "openrlhf", **core.PROFILES["openrlhf"], "beta": 0.04},
    "gspo": {"importance_sampling_level": "sequence", "loss_type": "grpo"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
    "delta+dual_clip": {"delta": 2.0, "dual_clip": 3.0},
    "rloo": {"advantage_estimator": "rloo"},
    "reinforce_pp": {"advantage_estimator": "reinforce_pp", "advantage_std": "sample"},
    "menu": {
        "tis_cap": 3.0,
        "tis_mode": "sequence_mask",
        "dynamic_sampling": True,
        "mask_truncated_completions": True,
        "entropy_coef": 0.01,
    },
    "kl": {"kl_estimator": "k2", "kl_clamp": 10.0, "beta": 0.04},
}


@pytest.fixture(scope="module")
def model_and_batch():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    engine = HFEngine(model, tokenizer)
    prompts = ["37+48=", "5+5=", "12+30=", "99+1="]
    rollout = engine.generate(prompts, 4, SamplingParams(max_completion_length=8, seed=0))
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0.5, 0, 0, 0, 0, 0, 0])
    batch = checks.PreflightBatch(
        rollout.input_ids,
        rollout.attention_mask,
        rollout.completion_mask,
        rewards,
        4,
        rollout.engine_logprobs,
    )
    return model, batch


def by_id(results):
    return {r.id: r for r in results}


def test_the_core_passes_every_check(model_and_batch):
    model, batch = model_and_batch
    before = {k: v.clone() for k, v in model.state_dict().items()}
    results = checks.run_checks(model, batch)
    failed = [(r.id, r.measured, r.error) for r in results if not r.passed]
    assert not failed
    ids = set(by_id(results))
    assert set(CAUGHT_BY.values()) <= ids
    assert {"engine.agreement", "rewards.variance", "ratio.initial"} <= ids
    assert checks.goal_status(results) == dict.fromkeys(checks.GOALS, True)
    # The checks leave the user's model as they found it.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training
    json.dumps([r.to_json() for r in results])


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_mutant_fails_its_named_check(model_and_batch, mutant):
    model, batch = model_and_batch
    impl = load_impl(MUTANTS / f"{mutant}.py")
    results = by_id(checks.run_checks(model, batch, impl=impl))
    named = results[CAUGHT_BY[mutant]]
    assert not named.passed, named
    assert named.hint  # a failure names the likely bug


@pytest.mark.parametrize("mutant", sorted(REWARD_CAUGHT_BY))
def test_each_reward_mutant_fails_its_named_probe(mutant):
    # On the demo's own task: bare "37+48=" prompts.
    module = (MUTANTS / f"{mutant}.py").read_text()
    (name,) = [line[4:].split("(")[0] for line in module.splitlines() if line.startswith("def ")]
    rewards = load_rewards([f"{MUTANTS / mutant}.py:{name}"], task="arithmetic")
    report = run_probes(probe_rows(load_task()), rewards)
    results = by_id(checks.check_reward_probes(report))
    named = results[REWARD_CAUGHT_BY[mutant]]
    assert not named.passed, named
    assert named.hint and f"reward {name!r}" in named.what


def test_every_mutant_file_is_listed():
    from test_episodes import EPISODE_CAUGHT_BY  # the episode mutants, tested there
    from test_skip_zero_advantage import SKIP_CAUGHT_BY  # the skipping's, tested there

    listed = set(CAUGHT_BY) | set(REWARD_CAUGHT_BY) | set(MENU_CAUGHT_BY) | set(EPISODE_CAUGHT_BY)
    listed |= set(SKIP_CAUGHT_BY)
    assert {p.stem for p in MUTANTS.glob("*.py")} == listed


def declared(overrides: dict) -> checks.PreflightSettings:
    return checks.PreflightSettings(objective=core.Objective(num_generations=4, **overrides))


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_the_core_passes_every_check_of_each_declared_objective(model_and_batch, name):
    model, batch = model_and_batch
    results = checks.run_checks(model, batch, declared(DECLARED[name]))
    failed = [(r.id, r.measured, r.error) for r in results if not r.passed]
    assert not failed
    ids = set(by_id(results))
    assert {check for check, o in MENU_CAUGHT_BY.values() if o is DECLARED[name]} <= ids


@pytest.mark.parametrize("mutant", sorted(MENU_CAUGHT_BY))
def test_each_menu_mutant_fails_its_named_check(model_and_batch, mutant):
    model, batch = model_and_batch
    check, overrides = MENU_CAUGHT_BY[mutant]
    impl = load_impl(MUTANTS / f"{mutant}.py")
    results = by_id(checks.run_checks(model, batch, declared(overrides), impl=impl))
    named = results[check]
    assert not named.passed, named
    assert named.hint
    # The same file passes that check where the option it gets wrong is not declared.
    if overrides and check not in {"loss.metrics"}:
        plain = by_id(checks.run_checks(model, batch, impl=impl))
        assert check not in plain or plain[check].passed


def test_the_declared_std_is_checked_not_assumed(model_and_batch):
    # A TRL user's advantages (sample std, no zero-std guard) pass under profile=trl and fail
    # under the seed's declared population std; the seed's own fail under profile=trl.
    model, batch = model_and_batch
    trl = load_impl(Path(__file__).parent / "impls" / "trl_advantages.py")
    under_trl = by_id(checks.run_checks(model, batch, declared(PROFILE_TRL), impl=trl))
    assert all(under_trl[i].passed for i in checks.advantage_ids(declared(PROFILE_TRL).objective))
    under_seed = by_id(checks.run_checks(model, batch, declared({}), impl=trl))
    assert not under_seed["advantages.population_std"].passed
    seed = load_impl(MUTANTS / "population_std.py")
    assert by_id(checks.run_checks(model, batch, declared({}), impl=seed))[
        "advantages.population_std"
    ].passed


def test_a_zero_variance_batch_is_reported(model_and_batch):
    model, batch = model_and_batch
    flat = checks.PreflightBatch(
        batch.input_ids, batch.attention_mask, batch.completion_mask, torch.ones(16), 4
    )
    results = by_id(checks.run_checks(model, flat))
    assert not results["rewards.variance"].passed
    assert results["rewards.variance"].measured == 1.0


def test_impl_errors_point_at_the_line(tmp_path, model_and_batch):
    model, batch = model_and_batch
    bad = tmp_path / "my_grpo.py"
    bad.write_text("import torch\n\n\ndef kl_k3(logp_new, logp_ref):\n    return logp_new.foo()\n")
    results = checks.run_checks(model, batch, impl=load_impl(bad))
    kl = by_id(results)["kl.nonnegative"]
    assert not kl.passed and kl.error_line == 5 and "AttributeError" in kl.error
    assert f"{bad}:5" in kl.error
    # The functions the file does not define are grpolab's, and still pass.
    assert by_id(results)["clip.values"].passed


def test_impl_load_errors(tmp_path):
    with pytest.raises(ImplLoadError, match="no such file"):
        load_impl(tmp_path / "missing.py")
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def kl_k3(a, b):\n    return a -\n")
    with pytest.raises(ImplLoadError) as err:
        load_impl(syntax)
    assert err.value.line == 2 and "syntax error" in str(err.value)
    raising = tmp_path / "raising.py"
    raising.write_text("x = 1\nraise RuntimeError('boom')\n")
    with pytest.raises(ImplLoadError) as err:
        load_impl(raising)
    assert err.value.line == 2 and "boom" in str(err.value)


def test_impl_source_names_what_was_replaced():
    impl = load_impl(MUTANTS / "naive_kl.py")
    assert impl.source["kl_k3"].endswith("naive_kl.py")
    assert impl.source["grpo_loss"] == "grpolab"


def test_an_error_is_reported_under_the_check_it_interrupted(tmp_path, model_and_batch):
    model, batch = model_and_batch
    impl_file = tmp_path / "my_grpo.py"
    impl_file.write_text(
        "import torch\n"
        "from grpolab import core\n\n\n"
        "def sequence_logprobs(model, ids, attention, completion, temperature=1.0):\n"
        "    if next(model.parameters()).dtype == torch.bfloat16:\n"
        "        raise TypeError('no bf16 here')\n"
        "    return core.sequence_logprobs(\n"
        "        model, ids, attention, completion, temperature\n"
        "    )\n"
    )
    results = by_id(checks.run_checks(model, batch, impl=load_impl(impl_file)))
    assert results["logprobs.shift"].passed  # measured before the failure: kept
    failed = results["logprobs.float32"]
    assert not failed.passed and failed.error_line == 7 and "no bf16 here" in failed.error


def test_every_declared_only_check_has_a_hint_and_a_mutant_or_a_declared_run():
    assert checks.DECLARED_ONLY.issubset(checks.HINTS)
    caught = {check for check, _ in MENU_CAUGHT_BY.values()}
    assert checks.DECLARED_ONLY - caught <= {"entropy.values"}  # a real model's entropy


def blame_table(model, batch) -> list[tuple[str, str, list[str]]]:
    """(mutant, its check, the failing checks in blame order) for every mutant of the
    seed's functions and of the menu's, each under the objective that declares its option."""
    rows = [(m, c, {}) for m, c in CAUGHT_BY.items()]
    rows += [(m, c, o) for m, (c, o) in MENU_CAUGHT_BY.items()]
    table = []
    for mutant, check, overrides in sorted(rows):
        impl = load_impl(MUTANTS / f"{mutant}.py")
        results = checks.run_checks(model, batch, declared(overrides), impl=impl)
        failing = [r.id for r in checks.blamed(results) if r.id != "rewards.variance"]
        table.append((mutant, check, failing))
    return table


def test_each_mutant_is_blamed_on_its_own_check_first(model_and_batch):
    wrong = [(m, c, f) for m, c, f in blame_table(*model_and_batch) if f[:1] != [c]]
    assert not wrong


if __name__ == "__main__":  # the blame table: which checks each known bug fails
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    for mutant, check, failing in blame_table(*model_and_batch.__wrapped__()):
        mark = "" if failing[:1] == [check] else "   <- not first"
        print(f"{mutant:30s} {check:30s} {', '.join(failing)}{mark}")
