"""The preflight checks on a tiny real model and a real rollout (the session's scored batch,
tests/conftest.py): the correct core passes every check, each known silent bug
(tests/mutants/*.py) is blamed on the check named for it first. That each mutant fails its
named check and that every check runs on grpolab's own code under each declared objective is
tests/test_check_coverage.py's."""

import json
from pathlib import Path

import pytest
import torch

from grpolab import core
from grpolab.check import GOALS
from grpolab.checks import registry
from grpolab.checks.context import PreflightBatch, PreflightSettings
from grpolab.checks.runner import blamed, goal_status, run_checks
from grpolab.functions import ImplLoadError, load_impl
from grpolab.objective.profiles import profile_objective

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
        "top_entropy_quantile": 0.2,
    },
    # the surrogate apart from its normaliser: SAPO over the tokens (TRL's SAPO: per sequence),
    # with GSPO's sequence ratio (whose checks probe the clipped surrogate, not the given one)
    "sapo_token": {
        "surrogate": "sapo",
        "loss_type": "token",
        "importance_sampling_level": "sequence",
    },
    "kl": {"kl_estimator": "k2", "kl_clamp": 10.0, "beta": 0.04},
    # every tis_mode ("menu" declares sequence_mask), and k1 with TRL's bias correction
    "tis_token_truncate": {"tis_cap": 2.0, "tis_mode": "token_truncate"},
    "tis_token_mask": {"tis_cap": 2.0, "tis_mode": "token_mask"},
    "tis_sequence_truncate": {"tis_cap": 2.0, "tis_mode": "sequence_truncate", "beta": 0.1},
    "kl_k1": {"kl_estimator": "k1", "use_bias_correction_kl": True, "beta": 0.1},
}


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


def declared(overrides: dict) -> PreflightSettings:
    return PreflightSettings(objective=core.Objective(num_generations=4, **overrides))


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


# The seed's mutants under the seed's objective, the menu's under the one declaring the option.
BLAMED = {**{m: (c, {}) for m, c in CAUGHT_BY.items()}, **MENU_CAUGHT_BY}


def blame_order(model, batch, mutant: str) -> list[str]:
    """The checks `mutant` fails, in blame order: every check runs, under the objective that
    declares the option it gets wrong."""
    impl = load_impl(MUTANTS / f"{mutant}.py")
    results = run_checks(model, batch, declared(BLAMED[mutant][1]), impl=impl)
    return [r.id for r in blamed(results) if r.id != "rewards.variance"]


@pytest.mark.parametrize("mutant", sorted(BLAMED))
def test_each_mutant_is_blamed_on_its_own_check_first(model_and_batch, mutant):
    failing = blame_order(*model_and_batch, mutant)
    assert failing[:1] == [BLAMED[mutant][0]], failing


@pytest.mark.parametrize("same_rows", [False, True])
def test_the_sgd_direction_is_measured_with_one_row_per_micro_batch(model_and_batch, same_rows):
    """A trainer's micro-batch of one row (mini-batch 2 in 2 accumulation steps) and a batch
    whose rows are all one sequence (a confident model) still give the step a direction to
    show: the gradient is accumulated over micro-batches of rows holding distinct sequences,
    and a batch of one sequence gets a second."""
    model, batch = model_and_batch
    if same_rows:
        batch = batch.rows(torch.zeros(batch.input_ids.shape[0], dtype=torch.long))
    settings = PreflightSettings(grad_rows=1)
    only = {"loss.sgd_direction"}
    (ours,) = run_checks(model, batch, settings, only=only)
    assert ours.passed and ours.measured > 0, ours.measured
    flipped = load_impl(MUTANTS / "sign_flipped.py")
    (theirs,) = run_checks(model, batch, settings, impl=flipped, only=only)
    assert not theirs.passed and theirs.measured < 0, theirs.measured


def test_an_unmasked_ratio_mean_is_caught_where_the_padded_ratios_average_to_one(
    model_and_batch,
):
    """The clip case's padded ratios are 1 +- the mean epsilon: with epsilon 0.36 and
    epsilon_high 0.138 they average to 1, as the real ratios nearly do, and a ratio mean over
    every slot came within 3e-5 of the masked one."""
    model, batch = model_and_batch
    settings = declared({"epsilon": 0.36, "epsilon_high": 0.138, "loss_type": "bnpo"})
    only = {"loss.metrics"}
    (ours,) = run_checks(model, batch, settings, only=only)
    assert ours.passed, ours.measured
    unmasked = load_impl(MUTANTS / "unmasked_ratio_mean.py")
    (theirs,) = run_checks(model, batch, settings, impl=unmasked, only=only)
    assert not theirs.passed, theirs.measured


if __name__ == "__main__":  # the blame table: which checks each known bug fails
    from conftest import scored_batch, tiny_policy, tiny_rollout

    model, tokenizer = tiny_policy()
    batch = scored_batch(tiny_rollout(model, tokenizer))
    for mutant, (check, _) in sorted(BLAMED.items()):
        failing = blame_order(model, batch, mutant)
        mark = "" if failing[:1] == [check] else "   <- not first"
        print(f"{mutant:30s} {check:30s} {', '.join(failing)}{mark}")
