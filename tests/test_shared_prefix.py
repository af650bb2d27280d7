"""One forward per prompt: the trainer's log-probs and the engine's prefill share a group's
prompt, and must give what one forward per row gives (values and parameter gradients)."""

import logging

import pytest
import torch
from layout import rollout_layout
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpolab import core
from grpolab.model.logprobs import (
    MAX_SUFFIX_BUCKETS,
    plan_shared_prefix,
    shared_prefix_status,
    suffix_buckets,
    token_logprobs,
)
from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model
from grpolab.rollout import SamplingParams
from grpolab.rollout.hf import HFEngine, truncate

FP32 = dict(atol=1e-5, rtol=1e-5)
PROMPTS = ["37+48=", "5+5=", "a longer prompt:"]
# Completions of very different lengths inside each group, an empty one (EOS only) too.
COMPLETIONS = ["85", "8", "eighty-five, since 37 + 48 = 85", "10", "", "ten", "x", "y" * 20, "z"]
COMPLETIONS += ["1", "22", "333"]
G = 3


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tokenizer):
    return build_tiny_model(tokenizer, TinyModelSpec(arch=request.param), seed=3).train()


def grouped_batch(tokenizer, prompts=PROMPTS, completions=COMPLETIONS, g=G):
    """G rows per prompt, contiguous, each with its own completion."""
    rows = [p for p in prompts for _ in range(g)]
    batch, _ = rollout_layout(tokenizer, rows, completions[: len(rows)])
    return batch


def sliding_window_model(tokenizer, window: int, seed: int):
    """A tiny Qwen2 whose every layer attends to the last `window` positions only."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
        use_sliding_window=True, sliding_window=window, max_window_layers=0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def values_and_grads(model, batch, **kwargs):
    """logp and the parameter gradients of an advantage-weighted sum (both signs)."""
    model.zero_grad(set_to_none=True)
    logp, mask = token_logprobs(model, *batch, 0.8, **kwargs)
    weights = torch.linspace(-1, 1, logp.shape[0])[:, None]
    (logp * mask * weights).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return logp.detach(), mask, grads


def test_shared_prefix_equals_one_forward_per_row(model, tokenizer):
    batch = grouped_batch(tokenizer)
    assert plan_shared_prefix(*batch).firsts.tolist() == [0, 3, 6]
    shared, mask, shared_grads = values_and_grads(model, batch)
    assert shared_prefix_status(model, *batch) is None  # the shared path ran
    plain, plain_mask, plain_grads = values_and_grads(model, batch, shared_prefix=False)
    seed, _ = core.sequence_logprobs(model, *batch, 0.8)
    torch.testing.assert_close(mask, plain_mask, atol=0, rtol=0)
    torch.testing.assert_close(shared, plain, **FP32)
    torch.testing.assert_close(shared, seed * mask, **FP32)
    assert (shared[mask == 0] == 0).all()
    for a, b in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, **FP32)


def test_runs_of_any_length_and_a_slice_through_groups(model, tokenizer):
    """A micro-batch may start and end inside groups: runs of 2, 3 and 1 rows here."""
    full = grouped_batch(tokenizer)
    batch = tuple(x[1:7] for x in full)
    plan = plan_shared_prefix(*batch)
    assert plan.owner.tolist() == [0, 0, 1, 1, 1, 2]
    shared, _, shared_grads = values_and_grads(model, batch)
    plain, _, plain_grads = values_and_grads(model, batch, shared_prefix=False)
    torch.testing.assert_close(shared, plain, **FP32)
    for a, b in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, **FP32)


def test_no_plan_where_sharing_does_not_pay_or_apply(tokenizer):
    distinct, _ = rollout_layout(tokenizer, PROMPTS, COMPLETIONS[:3])
    assert plan_shared_prefix(*distinct) is None  # one row per prompt
    batch = grouped_batch(tokenizer)
    assert plan_shared_prefix(batch[0], batch[1], torch.zeros_like(batch[2])) is None
    # Same tokens, different padding: not the same prefix.
    ids, attn, comp = (x.clone() for x in grouped_batch(tokenizer, g=4))
    assert plan_shared_prefix(ids, attn, comp).owner.tolist()[:4] == [0, 0, 0, 0]
    attn[1, 0] = 1 - attn[1, 0]
    assert plan_shared_prefix(ids, attn, comp).owner.tolist()[:4] == [0, 1, 2, 2]


def test_gradient_checkpointing_keeps_the_shared_prompt(tokenizer):
    """Checkpointed layers run their forward again in backward: the prompt's KV cache must
    give them the same keys the second time, and the gradient must be the plain one's."""
    model = build_tiny_model(tokenizer, seed=4).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = grouped_batch(tokenizer)
    logp, _, grads = values_and_grads(model, batch)
    assert shared_prefix_status(model, *batch) is None  # the shared path ran, checkpointed
    model.gradient_checkpointing_disable()
    plain, _, plain_grads = values_and_grads(model, batch, shared_prefix=False)
    torch.testing.assert_close(logp, plain, **FP32)
    for a, b in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, **FP32)
    # The layers' own setting is back: outside grpolab's forward they drop a cache as before.
    assert not any(m.__dict__.get("_can_checkpoint_with_cache") for m in model.modules())


def test_sliding_window_cache_is_refused_and_the_result_still_right(tokenizer, caplog):
    """A sliding-window KV cache is not a plain concatenation: verified once, then refused."""
    model = sliding_window_model(tokenizer, window=4, seed=0).train()
    batch = grouped_batch(tokenizer)
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        logp, mask, _ = values_and_grads(model, batch)
    assert "one forward per prompt unavailable" in caplog.text
    assert "not a plain per-layer concatenation" in shared_prefix_status(model, *batch)
    seed, _ = core.sequence_logprobs(model, *batch, 0.8)
    torch.testing.assert_close(logp, seed * mask, **FP32)


@pytest.mark.parametrize(
    "needed",
    [
        [5] * 8 + [1] * 100,
        list(range(64)),
        [3] * 10,
        [0, 0, 7, 0],
        [1],
    ],
)
def test_suffix_buckets_partition_and_save(needed):
    needed = torch.tensor(needed)
    buckets = suffix_buckets(needed)
    rows = torch.cat(buckets).sort().values
    assert torch.equal(rows, torch.arange(len(needed)))  # every row exactly once
    assert 1 <= len(buckets) <= MAX_SUFFIX_BUCKETS
    cost = sum(len(b) * int(needed[b].max()) for b in buckets)
    assert cost <= len(needed) * int(needed.max())
    if len(set(needed.tolist())) == 1:
        assert len(buckets) == 1  # nothing to save


def test_two_length_populations_get_two_buckets():
    needed = torch.tensor([1] * 100 + [30] * 8)
    buckets = suffix_buckets(needed)
    assert sorted(len(b) for b in buckets) == [8, 100]


# --- The engine's shared prefill and its sampler --------------------------------------------------


def test_shared_prefill_samples_what_one_prefill_per_row_samples(model, tokenizer):
    params = SamplingParams(max_completion_length=12, seed=7, temperature=0.9, top_p=0.95)
    shared = HFEngine(model, tokenizer).generate(PROMPTS, 4, params)
    plain = HFEngine(model, tokenizer, shared_prefill=False).generate(PROMPTS, 4, params)
    assert torch.equal(shared.input_ids, plain.input_ids)
    torch.testing.assert_close(shared.engine_logprobs, plain.engine_logprobs, atol=1e-5, rtol=0)
    assert model.training  # restored


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (5, 1.0), (5, 0.5), (3, 0.999), (0, 0.01)])
def test_truncation_matches_transformers_warpers(top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(top_k)
    scaled = torch.randn(32, 50, generator=gen) * 3
    expected = scaled
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = truncate(scaled, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got[~torch.isinf(got)], scaled[~torch.isinf(got)])


def test_engine_on_a_sliding_window_model_prefills_per_row_and_reports_true_logprobs(tokenizer):
    """A sliding-window cache is not repeated per group: the engine prefills every row, and
    dropping finished rows from that cache still gives the model's own log-probs."""
    model = sliding_window_model(tokenizer, window=6, seed=1)
    shift = torch.zeros(len(tokenizer))
    shift[tokenizer.eos_token_id] = 3.0  # rows finish at many different steps
    model.lm_head.register_forward_hook(lambda module, args, out: out + shift)
    params = SamplingParams(max_completion_length=10, seed=3)
    rows = []  # batch size of each forward
    model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    r = HFEngine(model, tokenizer).generate(PROMPTS, 3, params)
    assert len(set(r.completion_mask.sum(1).tolist())) > 2
    assert rows[:2] == [3, 9]  # tried once per prompt, then per row
    rows.clear()
    HFEngine(model, tokenizer).generate(PROMPTS, 3, params)
    assert rows[0] == 9  # remembered: no wasted shared prefill on later rollouts
    logp, mask = core.sequence_logprobs(model, r.input_ids, r.attention_mask, r.completion_mask)
    torch.testing.assert_close(r.engine_logprobs, logp * mask, atol=1e-4, rtol=0)


def test_entropy_through_the_shared_prefix(model, tokenizer):
    batch = grouped_batch(tokenizer)
    with torch.no_grad():
        shared = token_logprobs(model, *batch, 0.8, return_entropy=True)
        plain = token_logprobs(model, *batch, 0.8, return_entropy=True, shared_prefix=False)
    for a, b in zip(shared, plain, strict=True):
        torch.testing.assert_close(a, b, **FP32)
    assert (shared[2][shared[1] == 1] > 0).all()
