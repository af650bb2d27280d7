"""The EOS that ends a finished completion is in the loss and carries gradient (norm.eos) for
every kind of tokenizer grpolab loads: one with a pad token of its own, one that pads with
its EOS (pad == EOS, as SmolLM2's does), and one with no pad token at all (the engines then
pad with the EOS). The demo model, which has learnt to stop, samples real EOS tokens; a
log-prob function that finds padding by its token id fails. SmolLM2's own tokenizer and model
are slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpolab.checks.context import Context, PreflightBatch, PreflightSettings
from grpolab.checks.registry import BY_ID
from grpolab.checks.runner import run_check, run_checks
from grpolab.functions import core_functions, load_impl
from grpolab.model.policy import eval_mode, load_policy
from grpolab.rollout import SamplingParams
from grpolab.rollout.hf import HFEngine
from grpolab.train.setup import DEMO_MODEL_DIR

MUTANT = Path(__file__).parent / "mutants" / "eos_as_padding.py"
PROMPTS = ["12+34=", "5+5=", "70+21=", "8+9="]


def demo_with(pad: str):
    """The demo model with its tokenizer padding with its own token ("own"), with its EOS
    ("eos") or without a pad token ("none")."""
    model, tokenizer = load_policy(DEMO_MODEL_DIR)
    if pad == "eos":
        tokenizer.pad_token = tokenizer.eos_token
    elif pad == "none":
        tokenizer.pad_token = None
    return model, tokenizer


def rollout_batch(engine, prompts, G: int, length: int, seed: int = 0):
    """(the scored batch, the rows that ended in EOS as sampled)."""
    rollout = engine.generate(prompts, G, SamplingParams(max_completion_length=length, seed=seed))
    batch = PreflightBatch(
        rollout.input_ids, rollout.attention_mask, rollout.completion_mask,
        torch.tensor([1.0, 0.0] * (rollout.batch_size // 2)), G, rollout.engine_logprobs,
        tuple(engine.stop_ids),
    )  # fmt: skip
    return batch, (~rollout.truncated).nonzero().flatten()


def eos_checks(model, batch, impl) -> dict:
    """norm.eos and engine.trained_tokens on the batch, as the preflight runs them."""
    ctx = Context(impl, PreflightSettings(), model, batch)
    with eval_mode(model, zero_grad=True):
        return {i: run_check(BY_ID[i], ctx) for i in ("norm.eos", "engine.trained_tokens")}


def assert_eos_in_the_batch(batch, finished, eos: int):
    """Each finished row's last completion token is the EOS, inside the completion and
    attention masks, whatever the pad id is."""
    for row in finished.tolist():
        last = int(batch.completion_mask[row].nonzero().max())
        assert batch.input_ids[row, last] == eos
        assert batch.attention_mask[row, last] == 1 and batch.completion_mask[row, last] == 1


@pytest.mark.parametrize("pad", ["own", "eos", "none"])
def test_the_eos_is_trained_whatever_the_tokenizer_pads_with(pad):
    model, tokenizer = demo_with(pad)
    engine = HFEngine(model, tokenizer)
    eos = tokenizer.eos_token_id
    assert (engine.pad_id == eos) == (pad != "own")
    batch, finished = rollout_batch(engine, PROMPTS, 4, 8)
    assert len(finished) >= 8  # the demo model stops after its answer
    assert_eos_in_the_batch(batch, finished, eos)
    for path in ("fused", "naive"):
        results = eos_checks(model, batch, core_functions(path))
        assert all(r.passed for r in results.values()), [r.what for r in results.values()]
        assert f"({len(finished)} ended in EOS as sampled" in results["norm.eos"].what
    wrong = eos_checks(model, batch, load_impl(MUTANT))["norm.eos"]
    assert not wrong.passed and wrong.measured == batch.input_ids.shape[0]
    assert "pad == EOS" in wrong.hint


def test_every_check_passes_on_a_batch_padded_with_the_eos():
    model, tokenizer = demo_with("eos")
    batch, _ = rollout_batch(HFEngine(model, tokenizer), PROMPTS, 4, 8, seed=1)
    failed = [(r.id, r.what) for r in run_checks(model, batch) if not r.passed]
    assert [f for f in failed if f[0] != "rewards.variance"] == []


@pytest.mark.slow
def test_smollm2_pads_with_its_eos_and_its_eos_is_trained():
    model, tokenizer = load_policy("smollm2-135m-instruct")
    assert tokenizer.pad_token_id == tokenizer.eos_token_id  # <|im_end|>
    engine = HFEngine(model, tokenizer, chat_template=True)
    prompts = ["What is 2+2? Answer with the number only.", "Say hello in one word."]
    batch, finished = rollout_batch(engine, prompts, 2, 32)
    assert len(finished) >= 1
    assert_eos_in_the_batch(batch, finished, tokenizer.eos_token_id)
    results = eos_checks(model, batch, core_functions("fused"))
    assert all(r.passed for r in results.values()), [r.what for r in results.values()]
    wrong = eos_checks(model, batch, load_impl(MUTANT))["norm.eos"]
    assert not wrong.passed and wrong.measured == batch.input_ids.shape[0]
