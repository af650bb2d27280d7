"""Truncated importance sampling in the trainer: an engine sampling from other weights than
the trainer's is corrected token by token, and the mismatch is reported every step."""

import copy
from pathlib import Path

import pytest
import torch
from tolerances import logprob_tolerance

from grpolab.config import ConfigError, load_config
from grpolab.functions import load_impl
from grpolab.rollout.hf import HFEngine
from grpolab.train.setup import build_run, load_start_model
from grpolab.train.step import grpo_step

TINY = [
    "batch.prompts_per_step=4",
    "batch.num_generations=4",
    "rollout.max_completion_length=6",
    "eval.eval_examples=0",
    # The importance weights' statistics over every token: no row skipped for a 0 advantage.
    "runtime.skip_zero_advantage=false",
]


def _run(tmp_path, *overrides):
    cfg = load_config(None, [f"output_dir={tmp_path}", *TINY, *overrides])
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    return build_run(cfg, model, tokenizer), tokenizer


def test_an_engine_on_the_same_weights_gets_weights_of_one(tmp_path):
    run, _ = _run(tmp_path, "objective.tis_cap=2.0")
    tol = logprob_tolerance(run.model)  # the engine's decode against the trainer's forward
    metrics, _ = grpo_step(run, 1)
    # Weights exp(d) for log-prob gaps |d| <= tol: within ~tol of 1.
    assert metrics["tis/weight_mean"] == pytest.approx(1.0, abs=tol)
    assert metrics["tis/capped_frac"] == 0.0


def test_a_stale_engine_is_reweighted_and_reported(tmp_path):
    run, tokenizer = _run(tmp_path, "objective.tis_cap=1.0")
    stale = copy.deepcopy(run.model)
    with torch.no_grad():
        for p in stale.parameters():
            p.add_(0.05 * torch.randn_like(p))
    run.engine = HFEngine(stale, tokenizer)  # samples from weights the trainer doesn't have
    metrics, _ = grpo_step(run, 1)
    # Tokens the trainer finds likelier than the engine did hit the cap of 1; the others
    # are down-weighted, so the mean weight is below 1.
    assert 0.05 < metrics["tis/capped_frac"] < 0.95
    assert metrics["tis/weight_mean"] < 1.0
    assert metrics["monitor/engine_gap"] > 1e-2  # and the mismatch is reported


def test_tis_needs_the_trainers_old_logprobs():
    with pytest.raises(ConfigError, match=r"objective\.tis_cap"):
        load_config(None, ["objective.tis_cap=2", "objective.logprob_source=engine"])
    with pytest.raises(ConfigError, match=r"objective\.tis_cap"):
        load_config(None, ["objective.tis_cap=0"])


def test_a_learners_seed_signature_loss_is_refused_with_tis(tmp_path):
    # A grpo_loss with the seed's signature (no token_weights), as a learner writes it.
    impl = load_impl(Path(__file__).parent / "mutants" / "sign_flipped.py")
    cfg = load_config(None, [f"output_dir={tmp_path}", *TINY, "objective.tis_cap=2"])
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"token_weights; the one from .*sign_flipped\.py"):
        build_run(cfg, model, tokenizer, functions=impl)
