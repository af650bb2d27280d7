"""The preflight checks on a tiny real model and a real rollout: the correct core passes every
check, each known silent bug (tests/mutants/*.py) fails the check named for it."""

import json
from pathlib import Path

import pytest
import torch

from grpolab import checks
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
    assert {p.stem for p in MUTANTS.glob("*.py")} == set(CAUGHT_BY) | set(REWARD_CAUGHT_BY)


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
