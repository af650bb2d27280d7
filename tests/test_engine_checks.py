"""The engine against the trainer, on real engines: under every sampling option the samples
come from the declared distribution and every log-prob is of the one the objective card
declares (engine.sampling), the loss trains the engine's tokens (engine.trained_tokens), and
the weight sync reaches every trained parameter, a tied head and LoRA adapters on it
included (engine.sync_coverage). The hf engine in-process; vLLM on CPU (slow)."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch
from need_vllm import require_vllm

from grpolab import core
from grpolab.checks.context import Context, PreflightBatch, PreflightSettings
from grpolab.checks.registry import BY_ID, mutants
from grpolab.checks.runner import blamed, run_check, run_checks
from grpolab.checks.sync import parameter_groups, probe_sync
from grpolab.config.sections import LoraConfig
from grpolab.functions import core_functions, load_impl
from grpolab.model.lora import wrap_lora
from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model
from grpolab.model.precision import Precision
from grpolab.objective import Objective
from grpolab.rollout import SamplingParams
from grpolab.rollout.hf import HFEngine

MUTANTS = Path(__file__).parent / "mutants"
SYNC = BY_ID["engine.sync_coverage"]
SYNC_CAUGHT_BY = {m: c.id for m, (c, _) in mutants().items() if c is SYNC}
PROMPTS = ["37+48=", "5+5=", "12+30=", "99+1="]
BF16 = Precision("bf16", "the engine's bf16 copies")
# The sampling options the rollout section has: temperature, top-k, top-p, and both.
SAMPLING = {
    "temperature": {"temperature": 0.7},
    "top_k": {"top_k": 20},
    "top_p": {"temperature": 1.3, "top_p": 0.8},
    "top_k_top_p": {"temperature": 0.7, "top_k": 12, "top_p": 0.9},
}


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_char_tokenizer()
    return build_tiny_model(tokenizer, seed=0), tokenizer


def scored_batch(engine, G: int = 4, **sampling) -> PreflightBatch:
    params = SamplingParams(max_completion_length=8, seed=3, **sampling)
    r = engine.generate(PROMPTS, G, params)
    rewards = torch.tensor([1.0, 0.0] * (r.batch_size // 2))
    return PreflightBatch(
        r.input_ids, r.attention_mask, r.completion_mask, rewards, G, r.engine_logprobs,
        tuple(engine.stop_ids),
    )  # fmt: skip


def declared(**sampling) -> PreflightSettings:
    return PreflightSettings(objective=Objective(num_generations=4, **sampling))


def by_id(results):
    return {r.id: r for r in results}


# --- Sampling: the declared distribution, like with like ---------------------------------------


@pytest.mark.parametrize("name", sorted(SAMPLING))
def test_grpolab_passes_the_engine_checks_under_each_sampling_option(tiny, name):
    model, tokenizer = tiny
    batch = scored_batch(HFEngine(model, tokenizer), **SAMPLING[name])
    for path in ("fused", "naive"):
        results = by_id(run_checks(model, batch, declared(**SAMPLING[name]), core_functions(path)))
        engine_ids = {"engine.agreement", "engine.trained_tokens"}
        if name != "temperature":
            engine_ids.add("engine.sampling")
        assert engine_ids <= set(results)
        failed = [(i, r.what, r.measured) for i, r in results.items() if not r.passed]
        assert [f for f in failed if f[0] != "rewards.variance"] == []
        if "engine.sampling" in results:  # no sampled token outside the kept set
            assert results["engine.sampling"].measured == 0


@pytest.mark.parametrize("name", ["top_k", "top_p", "top_k_top_p"])
def test_the_importance_weights_compare_like_with_like_under_truncation(tiny, name):
    # The engine's and the trainer's log-probs are both of the untruncated distribution: at
    # step one every weight is 1 within the engine's own gap, under every tis_mode.
    model, tokenizer = tiny
    batch = scored_batch(HFEngine(model, tokenizer), **SAMPLING[name])
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        s = declared(tis_cap=2.0, tis_mode=mode, **SAMPLING[name])
        results = by_id(run_checks(model, batch, s))
        for check in ("engine.is_weights", "engine.is_step_one", "engine.is_finite"):
            assert results[check].passed, (mode, results[check].what)


def test_a_trainer_scoring_its_samplers_top_k_is_named(tiny):
    model, tokenizer = tiny
    batch = scored_batch(HFEngine(model, tokenizer), top_k=20)
    impl = load_impl(MUTANTS / "logprobs_top_k.py")
    results = run_checks(model, batch, declared(top_k=20), impl)
    sampling = by_id(results)["engine.sampling"]
    assert not sampling.passed and "trainer 0," not in sampling.what
    assert "0 outside the kept set" in sampling.what  # the engine drew from top-k 20
    assert blamed(results)[0].id == "engine.sampling"


def test_an_engine_that_ignores_its_top_k_or_temperature_fails(tiny):
    # Real samples drawn without the declared truncation, or at another temperature.
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    full = scored_batch(engine)
    results = by_id(run_checks(model, full, declared(top_k=5)))
    assert not results["engine.sampling"].passed
    assert results["engine.sampling"].measured > 0
    hot = scored_batch(engine, temperature=1.5, top_p=0.5)
    results = by_id(run_checks(model, hot, declared(temperature=0.5, top_p=0.5)))
    assert not results["engine.sampling"].passed


def test_the_card_declares_the_distribution_of_every_logprob():
    card = core.objective_card(Objective(temperature=0.7, top_k=20, top_p=0.9))
    assert "sampled" in card and "top-k 20 then top-p 0.9" in card
    assert "every log-prob (engine, trainer, ratio, importance weights) of the untruncated" in card
    assert "sampled" not in core.objective_card(Objective(temperature=0.7))


def test_a_loss_mask_training_a_prompt_token_is_out_of_the_engines_tokens(tiny):
    model, tokenizer = tiny
    batch = scored_batch(HFEngine(model, tokenizer))
    ours = by_id(run_checks(model, batch))["engine.trained_tokens"]
    assert ours.passed and ours.measured == 0
    impl = load_impl(MUTANTS / "prompt_in_mask.py")
    results = run_checks(model, batch, impl=impl)
    trained = by_id(results)["engine.trained_tokens"]
    assert not trained.passed and trained.measured > 0
    assert blamed(results)[0].id == "norm.masked_gradient"  # the gradient's check pins it


# --- The weight sync -----------------------------------------------------------------------------


def sync_mutant(engine, name: str):
    """`engine` with the sync of tests/mutants/<name>.py in place of its own."""
    spec = importlib.util.spec_from_file_location(name, MUTANTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    engine.sync_weights = types.MethodType(module.sync_weights, engine)
    return engine


def registry_check(engine, model):
    """engine.sync_coverage from the registry, as the preflight runs it on a run's engine."""
    run = types.SimpleNamespace(engine=engine)  # what the check reads of the run
    ctx = Context(core_functions("naive"), PreflightSettings(), model, run=run)
    assert SYNC.when(ctx)
    return run_check(SYNC, ctx)


@pytest.mark.parametrize("tied", [True, False])
def test_the_hf_bf16_sync_covers_every_group_and_a_sync_skipping_the_head_fails(tied):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelSpec(tie_word_embeddings=tied), seed=1)
    engine = HFEngine(model, tokenizer, precision=BF16)
    scored_batch(engine, G=2)  # the engine's copies made by a rollout
    groups = parameter_groups(model)
    head = "the output head (tied to the input embedding)" if tied else "the output head"
    assert head in groups and ("the input embedding" in groups) == (not tied)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ours = registry_check(engine, model)
    assert ours.passed and ours.measured == 0, ours.what
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    for mutant in SYNC_CAUGHT_BY:
        result = registry_check(sync_mutant(engine, mutant), model)
        assert not result.passed and result.measured == 1, result.what
        assert f"first: {head}:" in result.what and "stale bf16 copy" in result.what
        assert result.hint


def test_the_hf_bf16_sync_covers_lora_adapters_on_a_tied_head():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=2)
    lora = LoraConfig(r=4, target_modules=["q_proj", "lm_head"])
    model = wrap_lora(model, types.SimpleNamespace(lora=lora))  # the config's lora section
    engine = HFEngine(model, tokenizer, precision=BF16)
    scored_batch(engine, G=2)
    groups = parameter_groups(model)
    assert "LoRA adapters on the output head (tied to the input embedding)" in groups
    assert "LoRA adapters" in groups and "every other trained weight" not in groups
    assert probe_sync(engine, model) == {}


# --- vLLM on CPU ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_engine(tiny):
    require_vllm()
    from grpolab.rollout import RolloutConfig
    from grpolab.rollout.vllm import VLLMEngine, VLLMEngineConfig

    model, tokenizer = tiny
    cfg = RolloutConfig(engine="vllm", vllm=VLLMEngineConfig(max_model_len=256))
    engine = VLLMEngine.from_model(model, tokenizer, cfg)
    yield engine
    engine.close()


@pytest.mark.slow
def test_vllm_samples_the_declared_distribution_under_each_option(tiny, vllm_engine):
    model, _ = tiny
    for name, sampling in SAMPLING.items():
        batch = scored_batch(vllm_engine, **sampling)
        results = by_id(run_checks(model, batch, declared(**sampling)))
        truncating = name != "temperature"
        # vLLM reports the truncated distribution's log-probs: with top-k / top-p none
        assert (batch.engine_logprobs is None) == truncating
        assert results["engine.trained_tokens"].passed
        if truncating:
            assert results["engine.sampling"].passed, results["engine.sampling"].what
        else:
            assert results["engine.agreement"].passed, results["engine.agreement"].what


@pytest.mark.slow
def test_vllm_sync_covers_the_tied_head_and_a_sync_skipping_it_fails(tiny, vllm_engine):
    model, _ = tiny
    ours = registry_check(vllm_engine, model)
    assert ours.passed, ours.what
    try:
        result = registry_check(sync_mutant(vllm_engine, "sync_skips_head"), model)
    finally:
        del vllm_engine.sync_weights  # its own again
        vllm_engine.sync_weights(model)
    assert not result.passed and "the output head (tied to the input embedding)" in result.what
    assert "the engine is not running the trainer's weights" in result.what
