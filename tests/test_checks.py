"""The preflight checks on a tiny real model and a real rollout: the correct core passes every
check, each known silent bug (tests/mutants/*.py) fails the check named for it."""

import json
from pathlib import Path

import pytest
import torch

from grpolab import core
from grpolab.check import GOALS
from grpolab.checks import registry
from grpolab.checks.context import PreflightBatch, PreflightSettings
from grpolab.checks.rewards import check_reward_probes
from grpolab.checks.runner import blamed, goal_status, run_checks
from grpolab.functions import ImplLoadError, load_impl
from grpolab.model.policy import build_char_tokenizer, build_tiny_model
from grpolab.objective.profiles import profile_objective
from grpolab.rewards import load_rewards
from grpolab.rewards.probes import probe_rows, run_probes
from grpolab.rollout.base import SamplingParams
from grpolab.rollout.hf import HFEngine
from grpolab.tasks import load_task

MUTANTS = Path(__file__).parent / "mutants"

# Every known bug the registry declares: mutant file -> (the check that must catch it, the
# objective that declares the option the bug is in). A check declares its mutants
# (grpolab.check.Mutant); these tables are read from the registry, by kind.
DECLARED_MUTANTS = {m: (c.id, o) for m, (c, o) in registry.mutants().items()}
# the seed's functions, under the seed's objective
CAUGHT_BY = {
    m: c for m, (c, o) in DECLARED_MUTANTS.items() if not o and registry.BY_ID[c].stage == "batch"
    and not registry.BY_ID[c].declared_only
}  # fmt: skip
# reward mutants (their function has the file's only public name) -> the probe
REWARD_CAUGHT_BY = {m: c for m, (c, _) in DECLARED_MUTANTS.items() if c.startswith("rewards.")}
# the menu's and the conventions' mutants: (the check, the objective declaring the option)
MENU_CAUGHT_BY = {
    m: (c, o) for m, (c, o) in DECLARED_MUTANTS.items()
    if registry.BY_ID[c].stage == "batch" and (o or registry.BY_ID[c].declared_only)
}  # fmt: skip

PROFILE_TRL = profile_objective("trl", beta=0.04)
PROFILE_VERL = profile_objective("verl", beta=0.04)
# Every profile, every option of the menu: grpolab's own functions pass every check.
DECLARED = {
    "trl": PROFILE_TRL,
    "verl": PROFILE_VERL,
    "openrlhf": profile_objective("openrlhf", beta=0.04),
    "gspo": {"importance_sampling_level": "sequence", "loss_type": "grpo"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
    "sapo": {"loss_type": "sapo", "sapo_temperature_pos": 1.2, "sapo_temperature_neg": 0.8},
    "sapo+gspo": {"loss_type": "sapo", "importance_sampling_level": "sequence"},
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
    # every tis_mode ("menu" declares sequence_mask), and k1 with TRL's bias correction
    "tis_token_truncate": {"tis_cap": 2.0, "tis_mode": "token_truncate"},
    "tis_token_mask": {"tis_cap": 2.0, "tis_mode": "token_mask"},
    "tis_sequence_truncate": {"tis_cap": 2.0, "tis_mode": "sequence_truncate", "beta": 0.1},
    "kl_k1": {"kl_estimator": "k1", "use_bias_correction_kl": True, "beta": 0.1},
}


@pytest.fixture(scope="module")
def model_and_batch():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    engine = HFEngine(model, tokenizer)
    prompts = ["37+48=", "5+5=", "12+30=", "99+1="]
    rollout = engine.generate(prompts, 4, SamplingParams(max_completion_length=8, seed=0))
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0.5, 0, 0, 0, 0, 0, 0])
    batch = PreflightBatch(
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
    results = run_checks(model, batch)
    failed = [(r.id, r.measured, r.error) for r in results if not r.passed]
    assert not failed
    ids = set(by_id(results))
    assert set(CAUGHT_BY.values()) <= ids
    assert {"engine.agreement", "rewards.variance", "ratio.initial"} <= ids
    assert goal_status(results) == dict.fromkeys(GOALS, True)
    # The checks leave the user's model as they found it.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training
    json.dumps([r.to_json() for r in results])


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_each_mutant_fails_its_named_check(model_and_batch, mutant):
    model, batch = model_and_batch
    impl = load_impl(MUTANTS / f"{mutant}.py")
    results = by_id(run_checks(model, batch, impl=impl))
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
    results = by_id(check_reward_probes(report))
    named = results[REWARD_CAUGHT_BY[mutant]]
    assert not named.passed, named
    assert named.hint and f"reward {name!r}" in named.what


def test_every_mutant_file_is_declared_and_tested():
    from test_engine_checks import SYNC_CAUGHT_BY  # the weight sync's, tested there
    from test_episodes import EPISODE_CAUGHT_BY  # the episode mutants, tested there
    from test_skip_zero_advantage import SKIP_CAUGHT_BY  # the skipping's, tested there

    tested = set(CAUGHT_BY) | set(REWARD_CAUGHT_BY) | set(MENU_CAUGHT_BY) | set(EPISODE_CAUGHT_BY)
    tested |= set(SKIP_CAUGHT_BY) | set(SYNC_CAUGHT_BY)
    assert {p.stem for p in MUTANTS.glob("*.py")} == set(registry.mutants()) == tested


def declared(overrides: dict) -> PreflightSettings:
    return PreflightSettings(objective=core.Objective(num_generations=4, **overrides))


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_the_core_passes_every_check_of_each_declared_objective(model_and_batch, name):
    model, batch = model_and_batch
    results = run_checks(model, batch, declared(DECLARED[name]))
    failed = [(r.id, r.measured, r.error) for r in results if not r.passed]
    assert not failed
    ids = set(by_id(results))
    assert {check for check, o in MENU_CAUGHT_BY.values() if o == DECLARED[name]} <= ids


@pytest.mark.parametrize("mutant", sorted(MENU_CAUGHT_BY))
def test_each_menu_mutant_fails_its_named_check(model_and_batch, mutant):
    model, batch = model_and_batch
    check, overrides = MENU_CAUGHT_BY[mutant]
    impl = load_impl(MUTANTS / f"{mutant}.py")
    results = by_id(run_checks(model, batch, declared(overrides), impl=impl))
    named = results[check]
    assert not named.passed, named
    assert named.hint
    # The same file passes that check where the option it gets wrong is not declared.
    if overrides and check not in {"loss.metrics"}:
        plain = by_id(run_checks(model, batch, impl=impl))
        assert check not in plain or plain[check].passed


def test_the_declared_std_is_checked_not_assumed(model_and_batch):
    # A TRL user's advantages (sample std, no zero-std guard) pass under profile=trl and fail
    # under the seed's declared population std; the seed's own fail under profile=trl.
    model, batch = model_and_batch
    trl = load_impl(Path(__file__).parent / "impls" / "trl_advantages.py")
    under_trl = by_id(run_checks(model, batch, declared(PROFILE_TRL), impl=trl))
    assert all(r.passed for i, r in under_trl.items() if i.startswith("advantages."))
    under_seed = by_id(run_checks(model, batch, declared({}), impl=trl))
    assert not under_seed["advantages.population_std"].passed
    seed = load_impl(MUTANTS / "population_std.py")
    assert by_id(run_checks(model, batch, declared({}), impl=seed))[
        "advantages.population_std"
    ].passed


def test_a_zero_variance_batch_is_reported(model_and_batch):
    model, batch = model_and_batch
    flat = PreflightBatch(
        batch.input_ids, batch.attention_mask, batch.completion_mask, torch.ones(16), 4
    )
    results = by_id(run_checks(model, flat))
    assert not results["rewards.variance"].passed
    assert results["rewards.variance"].measured == 1.0


def test_impl_errors_point_at_the_line(tmp_path, model_and_batch):
    model, batch = model_and_batch
    bad = tmp_path / "my_grpo.py"
    bad.write_text("import torch\n\n\ndef kl_k3(logp_new, logp_ref):\n    return logp_new.foo()\n")
    results = run_checks(model, batch, impl=load_impl(bad))
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
    results = by_id(run_checks(model, batch, impl=load_impl(impl_file)))
    assert results["logprobs.shift"].passed  # measured before the failure: kept
    failed = results["logprobs.float32"]
    assert not failed.passed and failed.error_line == 7 and "no bf16 here" in failed.error


def test_every_declared_only_check_has_a_hint_and_a_mutant_or_a_declared_run():
    assert all(registry.HINTS[c] for c in registry.DECLARED_ONLY)
    caught = {check for check, _ in MENU_CAUGHT_BY.values()}
    assert registry.DECLARED_ONLY - caught <= {"entropy.values"}  # a real model's entropy


def blame_table(model, batch) -> list[tuple[str, str, list[str]]]:
    """(mutant, its check, the failing checks in blame order) for every mutant of the
    seed's functions and of the menu's, each under the objective that declares its option."""
    rows = [(m, c, {}) for m, c in CAUGHT_BY.items()]
    rows += [(m, c, o) for m, (c, o) in MENU_CAUGHT_BY.items()]
    table = []
    for mutant, check, overrides in sorted(rows):
        impl = load_impl(MUTANTS / f"{mutant}.py")
        results = run_checks(model, batch, declared(overrides), impl=impl)
        failing = [r.id for r in blamed(results) if r.id != "rewards.variance"]
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
