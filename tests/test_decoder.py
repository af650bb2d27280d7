"""The hf engine's own decode step (grpolab.model.decoder) against the model's forward: the
same logits step by step (rows leaving the batch included), the same tokens for the same seed
in float32, under bf16 no further from float64 than the model's own bf16 forward, and models
it does not reproduce decoded through their forward.

Tolerances: float32 logits of two float32 computations of the same network (a different
attention kernel, the same matmuls) agree to 1e-5 absolute and relative, as the fused
log-probs do (tests/test_logprobs.py); bf16 against float64 by the preflight's own bound
(`checks.tolerance.precision_tolerance`: 4x the plain bf16 forward's distance)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from grpolab.checks.tolerance import precision_tolerance
from grpolab.model.decoder import Decoder, KVCache, module_call, unsupported, verify_decoder
from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model
from grpolab.model.precision import Precision
from grpolab.rollout import SamplingParams
from grpolab.rollout.common import SAMPLERS
from grpolab.rollout.hf import CacheSteps, ForwardSteps, HFEngine, left_padded, prefill

FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = Precision("bf16", "test")
PROMPTS = ["37+48=", "5+6=", "a longer prompt here:"]
SPECS = {
    "llama": TinyModelSpec(arch="llama"),
    "qwen2": TinyModelSpec(arch="qwen2"),
    "llama-gqa": TinyModelSpec(arch="llama", num_heads=4, num_kv_heads=2, hidden_size=128),
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module", params=list(SPECS))
def model(request, tokenizer):
    return build_tiny_model(tokenizer, SPECS[request.param], seed=3)


def lora_model(tokenizer):
    """A tiny LoRA model whose adapters are not zero (peft starts B at 0)."""
    pytest.importorskip("peft")
    from grpolab.config import load_config
    from grpolab.model.lora import wrap_lora

    model = wrap_lora(build_tiny_model(tokenizer, seed=0), load_config(None, ["lora.r=4"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return model


def prompt_batch(engine, prompts=PROMPTS):
    ids = [engine.tokenizer(p)["input_ids"] for p in prompts]
    return left_padded(ids, engine.pad_id)  # (input_ids [n, P], attention_mask [n, P])


def forced_logprobs(engine, G: int, forced: torch.Tensor, fast: bool, leave=()):
    """Log-probs [B, steps] of the tokens `forced` [B, steps] fed row by row after the prompts,
    through the engine's decode step (fast) or the model's forward; rows listed in `leave`
    [(step, sample), ...] leave the batch after that step."""
    input_ids, mask = prompt_batch(engine)
    B, steps = forced.shape
    out = torch.zeros(B, steps)
    with torch.no_grad():
        if fast:
            decoder = engine.decoder(input_ids, mask)
            assert decoder is not None
            with engine.sampling_context():
                state = prefill(engine.model, input_ids, mask, G, repeat_cache=False)
            stepper = CacheSteps(decoder, *state, input_ids.shape[1] + steps)
            context = torch.no_grad
        else:
            with engine.sampling_context():
                stepper = ForwardSteps(engine.model, *prefill(engine.model, input_ids, mask, G))
            context = engine.sampling_context
        rows = torch.arange(B)
        for t in range(steps):
            logp = torch.log_softmax(stepper.logits.double(), dim=-1)
            out[rows, t] = logp.gather(1, forced[rows, t, None])[:, 0].float()
            stay = torch.tensor([(t, int(r)) not in leave for r in rows])
            kept = stepper.keep(stay)
            if kept is not None:
                rows = rows[kept]
            if t + 1 < steps:
                with context():
                    stepper.feed(forced[rows, t])
    return out


def test_the_decode_step_gives_the_models_log_probs_as_rows_leave(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    G, steps = 3, 7
    forced = torch.randint(
        4, len(tokenizer), (len(PROMPTS) * G, steps), generator=torch.Generator().manual_seed(0)
    )
    leave = {(1, 4), (2, 0), (2, 8), (4, 2), (4, 3)}  # holes below and above the kept count
    expected = forced_logprobs(engine, G, forced, fast=False, leave=leave)
    got = forced_logprobs(engine, G, forced, fast=True, leave=leave)
    torch.testing.assert_close(got, expected, **FP32)
    assert (got != 0).sum() == (expected != 0).sum()  # the same rows fed the same steps


def test_the_cache_keeps_rows_by_moving_the_last_ones_into_the_holes():
    cache = KVCache(
        layers=2, rows=6, kv_heads=1, length=4, head_dim=2, dtype=torch.float32, device="cpu"
    )
    cache.keys.copy_(torch.arange(6.0)[None, :, None, None, None].expand_as(cache.keys))
    cache.values.copy_(cache.keys)
    cache.used = 3
    cache.valid[:, :3] = torch.arange(6)[:, None] % 2 == 0
    stay = torch.tensor([True, False, True, True, False, True])
    order = cache.keep(stay)
    assert order.tolist() == [0, 5, 2, 3]  # row 1 left: row 5 takes its place, row 4 left
    assert cache.active == 4
    assert (
        cache.keys[:, :4, 0, :3, 0].tolist() == [[[0.0] * 3, [5.0] * 3, [2.0] * 3, [3.0] * 3]] * 2
    )
    assert cache.valid[:4, 0].tolist() == [True, False, True, False]
    assert cache.keep(torch.ones(4, dtype=torch.bool)) is None


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_float32_rollouts_draw_the_same_tokens_through_either_step(model, tokenizer, sampler):
    """The same seed gives the same tokens, however the decode step orders its rows (rows are
    drawn in sample order), and the same log-probs to float32 precision."""
    params = SamplingParams(temperature=1.0, max_completion_length=12, seed=5, sampler=sampler)
    engines = HFEngine(model, tokenizer, fast_decode=False), HFEngine(model, tokenizer)
    for engine in engines:  # a tenth of the vocabulary ends a completion: rows leave early
        engine.stop_ids = list(range(len(tokenizer) - len(tokenizer) // 10, len(tokenizer)))
    slow, fast = (engine.generate(PROMPTS, 4, params) for engine in engines)
    assert torch.equal(fast.input_ids, slow.input_ids)
    assert fast.completion_mask.sum(1).unique().numel() > 2  # rows left at several steps
    torch.testing.assert_close(fast.engine_logprobs, slow.engine_logprobs, **FP32)


def test_a_lora_model_decodes_with_its_adapters(tokenizer):
    model = lora_model(tokenizer)
    engine = HFEngine(model, tokenizer)
    G, steps = 2, 5
    forced = torch.randint(
        4, len(tokenizer), (len(PROMPTS) * G, steps), generator=torch.Generator().manual_seed(1)
    )
    expected = forced_logprobs(engine, G, forced, fast=False)
    torch.testing.assert_close(forced_logprobs(engine, G, forced, fast=True), expected, **FP32)
    with model.disable_adapter():  # the adapters matter here: without them, other log-probs
        plain = forced_logprobs(engine, G, forced, fast=False)
    assert (plain - expected).abs().max() > 1e-3


@pytest.mark.parametrize("lora", [False, True])
def test_under_bf16_the_decode_step_is_as_close_to_float64_as_the_models_bf16_forward(
    tokenizer, lora
):
    model = lora_model(tokenizer) if lora else build_tiny_model(tokenizer, seed=0)
    engine = HFEngine(model, tokenizer, precision=BF16)
    G, steps = 2, 6
    forced = torch.randint(
        4, len(tokenizer), (len(PROMPTS) * G, steps), generator=torch.Generator().manual_seed(2)
    )
    reference = forced_logprobs(
        HFEngine(copy.deepcopy(model).double(), tokenizer), G, forced, False
    )
    plain = forced_logprobs(engine, G, forced, fast=False)
    fast = forced_logprobs(engine, G, forced, fast=True)
    plain_err = float((plain - reference).abs().max())
    fast_err = float((fast - reference).abs().max())
    assert fast_err > 0  # bf16 matmuls: not the float64 model
    assert fast_err <= precision_tolerance(plain_err, float(reference.abs().max()), torch.bfloat16)


def test_models_the_step_does_not_reproduce_decode_through_their_forward(tokenizer, caplog):
    gemma = Gemma2ForCausalLM(
        Gemma2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    )  # fmt: skip
    assert "Gemma2ForCausalLM is not one of" in unsupported(gemma)
    # A Llama whose head adds to one logit (a hook no config announces): the probe sees it.
    hooked = build_tiny_model(tokenizer, seed=0)
    shift = torch.zeros(len(tokenizer))
    shift[tokenizer.eos_token_id] = 4.0
    hooked.lm_head.register_forward_hook(lambda module, args, out: out + shift)
    engine = HFEngine(hooked, tokenizer)
    input_ids, mask = prompt_batch(engine)
    with caplog.at_level(logging.INFO, logger="grpolab"):
        assert engine.decoder(input_ids, mask) is None
        assert engine.decoder(input_ids, mask) is None
    said = [r.getMessage() for r in caplog.records if "model's forward" in r.getMessage()]
    assert len(said) == 1 and "decode step differs from its forward" in said[0]
    # ... and its rollouts are those of the forward (the same tokens as with the step off)
    params = SamplingParams(max_completion_length=8, seed=3)
    slow = HFEngine(hooked, tokenizer, fast_decode=False).generate(PROMPTS, 2, params)
    assert torch.equal(engine.generate(PROMPTS, 2, params).input_ids, slow.input_ids)


def test_the_probe_compares_with_the_forward(tokenizer):
    model = build_tiny_model(tokenizer, seed=1)
    ids = torch.tensor(tokenizer("12+34=46")["input_ids"])
    assert verify_decoder(model, ids) is None
    assert verify_decoder(model, ids[:3]) == "a probe needs at least 4 tokens"
    decoder = Decoder(model, module_call, torch.float32)
    assert len(decoder.layers) == model.config.num_hidden_layers
