"""grpolab.model.logprobs: the chunked lm-head against the seed's full-logits path.

Tolerances: float32 values and gradients equal the naive path to 1e-5 (absolute and
relative); bfloat16 log-probs to 1e-4 (both paths round the logits to bfloat16 the same way,
then work in float32) and bfloat16 gradients to 2 units in the last place of bfloat16
(2^-7 relative) of the largest gradient entry.
"""

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout import rollout_layout
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM

from grpolab import core
from grpolab.model.logprobs import (
    MIN_VOCAB_CHUNK,
    Chunks,
    choose_chunks,
    fused_token_logprobs,
    kept_chunks,
    split_model,
    token_logprobs,
)
from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model

FP32 = dict(atol=1e-5, rtol=1e-5)


def naive_token_logprobs(hidden, weight, targets, temperature=1.0):
    """The seed's computation on [N, H] hidden states: full logits, float32 log-softmax."""
    logits = (hidden @ weight.t()).float() / temperature  # [N, V]
    logprobs = torch.log_softmax(logits, dim=-1)
    logp = logprobs.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logp, entropy


def _problem(n, h, v, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    # Upstream gradients of a GRPO-like loss: per-token weights of both signs.
    g_logp = torch.randn(n, generator=gen) / n
    g_entropy = torch.randn(n, generator=gen) / n
    return hidden, weight, targets, g_logp, g_entropy


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


# --- The fused function against the naive one --------------------------------------------------

CHUNKINGS = [
    (None, None),  # automatic: one tile here
    (7, 100),  # ragged edges in both directions
    (64, 37),
    (1, 1000),  # one token per tile, the whole vocabulary
]


@pytest.mark.parametrize(("token_chunk", "vocab_chunk"), CHUNKINGS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_values_and_gradients_equal_naive(token_chunk, vocab_chunk, temperature):
    hidden, weight, targets, g, _ = _problem(50, 32, 1000)
    ref = naive_token_logprobs(hidden, weight, targets, temperature)[0]
    ref_grads = _grads((ref * g).sum(), hidden, weight)
    ours = fused_token_logprobs(
        hidden, weight, targets, temperature, token_chunk=token_chunk, vocab_chunk=vocab_chunk
    )
    assert ours.dtype == torch.float32 and ours.shape == (50,)
    torch.testing.assert_close(ours, ref, **FP32)
    for got, want in zip(_grads((ours * g).sum(), hidden, weight), ref_grads, strict=True):
        torch.testing.assert_close(got, want, **FP32)


def _confident_problem(seed: int, n=64, h=64, v=4096):
    """Every target its row's argmax by a lead of 16-26 (1 - p from 1e-9 to 1e-2: the tokens
    a model samples confidently), on an offset of 30 shared by every logit (|z| ~ 60: one
    float32 ulp of a logit is larger than 1 - p)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(v, h, generator=gen) / h**0.5
    weight[:, 0] = 1.0
    targets = torch.randint(0, v, (n,), generator=gen)
    lead = 16 + 10 * torch.rand(n, 1, generator=gen)
    along = weight[targets] / (weight[targets, 1:] ** 2).sum(1, keepdim=True)
    hidden = 0.5 * torch.randn(n, h, generator=gen) + lead * along
    hidden[:, 0] = 30.0
    g = torch.randn(n, generator=gen) / n
    return hidden.requires_grad_(), weight.requires_grad_(), targets, g


@pytest.mark.parametrize(("token_chunk", "vocab_chunk"), [(None, None), (7, 1000)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("seed", "n"), [(0, 64), (1, 96)])  # logits kept / recomputed
def test_confident_tokens_keep_float32_precision(token_chunk, vocab_chunk, temperature, seed, n):
    """Against float64 on the same float32 inputs, with the rounding bounds of float32:
    a logit (a dot product of H terms, then / T) is off by at most (H + 1) u A, with
    u = 2^-24 and A = max_j sum_k |h_k w_jk| / T; every p_j and 1 - p of the target, made
    of differences of two logits, relatively by delta = 4 (H + 1) u A + 16 u; log p of a
    token with p >= 1/2 (-log1p of those) relatively by half that. A gradient entry sums V
    (or N) such terms: off by at most (delta + V u) times the sum of their magnitudes.
    The seed's log-softmax (1 - p formed as 1 - exp(log p), off by u / (1 - p)) misses
    these bounds by 100x and more; the fused path must meet them, and be no worse."""
    hidden, weight, targets, g = _confident_problem(seed, n=n)
    all_kept = kept_chunks(n, weight, choose_chunks(n, weight.shape[0])) == 1
    assert all_kept == (n <= 64)
    H, V, N = hidden.shape[1], weight.shape[0], hidden.shape[0]
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logp64 = torch.log_softmax(h64 @ w64.t() / temperature, -1).gather(-1, targets[:, None])[:, 0]
    grads64 = _grads((logp64 * g.double()).sum(), h64, w64)
    u = 2.0**-24
    A = float((hidden.detach().double().abs() @ weight.detach().double().abs().t()).max())
    A /= temperature
    delta = 4 * (H + 1) * u * A + 16 * u

    def errors(logp, grads):
        relative_logp = ((logp.double() - logp64).abs() / logp64.abs()).max().item()
        grad_errors = [(a.double() - b).abs() for a, b in zip(grads, grads64, strict=True)]
        return relative_logp, grad_errors

    fused = fused_token_logprobs(
        hidden, weight, targets, temperature, token_chunk=token_chunk, vocab_chunk=vocab_chunk
    )
    naive = naive_token_logprobs(hidden, weight, targets, temperature)[0]
    fused_logp, fused_grads = errors(fused, _grads((fused * g).sum(), hidden, weight))
    naive_logp, naive_grads = errors(naive, _grads((naive * g).sum(), hidden, weight))

    with torch.no_grad():
        assert (-logp64.expm1()).max() < 1e-2  # every token confident
        p = torch.softmax(h64 @ w64.t() / temperature, -1)  # [N, V]
        b = p.scatter_add(1, targets[:, None], -torch.ones(N, 1, dtype=p.dtype)).abs()
        g_abs = g.double().abs()[:, None] / temperature
        bound_h = (delta + V * u) * g_abs * (b @ w64.abs())  # [N, H]
        bound_w = (delta + N * u) * (b * g_abs).t() @ h64.abs()  # [V, H]
    assert fused_logp <= delta / 2
    assert (fused_grads[0] <= bound_h).all() and (fused_grads[1] <= bound_w).all()
    assert fused_logp <= naive_logp
    assert all(f.max() <= n.max() for f, n in zip(fused_grads, naive_grads, strict=True))


@pytest.mark.parametrize(("token_chunk", "vocab_chunk"), CHUNKINGS)
def test_entropy_and_its_gradient_equal_naive(token_chunk, vocab_chunk):
    hidden, weight, targets, g, g_ent = _problem(40, 16, 700, seed=1)
    ref_logp, ref_ent = naive_token_logprobs(hidden, weight, targets, 0.8)
    ref_grads = _grads((ref_logp * g + ref_ent * g_ent).sum(), hidden, weight)
    logp, ent = fused_token_logprobs(
        hidden,
        weight,
        targets,
        0.8,
        return_entropy=True,
        token_chunk=token_chunk,
        vocab_chunk=vocab_chunk,
    )
    torch.testing.assert_close(logp, ref_logp, **FP32)
    torch.testing.assert_close(ent, ref_ent, **FP32)
    assert (ent > 0).all() and (ent <= torch.log(torch.tensor(700.0)) + 1e-5).all()
    got = _grads((logp * g + ent * g_ent).sum(), hidden, weight)
    for a, b in zip(got, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logits_give_the_recomputed_gradients(dtype):
    # Fewer tokens than hidden units: the forward keeps its logits for the backward, which
    # frees them as it goes; a second backward (retain_graph) recomputes them.
    hidden, weight, targets, g, g_entropy = _problem(16, 64, 500, dtype=dtype, seed=8)
    assert kept_chunks(16, weight, Chunks(5, 128)) == 4  # all of them
    logp, entropy = fused_token_logprobs(
        hidden, weight, targets, 0.7, return_entropy=True, token_chunk=5, vocab_chunk=128
    )
    loss = (logp * g).sum() + (entropy * g_entropy).sum()
    kept = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    recomputed = _grads(loss, hidden, weight)
    for a, b in zip(kept, recomputed, strict=True):  # the same logits, up to GEMM blocking
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, **FP32)
        else:
            tol = 2 * 2**-7 * b.float().abs().max().item()  # 2 bf16 ulp of the largest
            assert (a.float() - b.float()).abs().max().item() <= tol
    if dtype == torch.float32:
        ref_logp, ref_entropy = naive_token_logprobs(hidden, weight, targets, 0.7)
        ref_loss = (ref_logp * g).sum() + (ref_entropy * g_entropy).sum()
        for a, b in zip(kept, _grads(ref_loss, hidden, weight), strict=True):
            torch.testing.assert_close(a, b, **FP32)


def test_unused_entropy_changes_no_gradient():
    hidden, weight, targets, g, _ = _problem(30, 16, 300, seed=2)
    logp, _ent = fused_token_logprobs(hidden, weight, targets, return_entropy=True, vocab_chunk=64)
    plain = fused_token_logprobs(hidden, weight, targets, vocab_chunk=64)
    for a, b in zip(
        _grads((logp * g).sum(), hidden, weight),
        _grads((plain * g).sum(), hidden, weight),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_gradcheck_float64():
    # Against finite differences of the fused forward itself: logp and entropy together.
    hidden, weight, targets, _, _ = _problem(6, 5, 23, dtype=torch.float64, seed=3)

    def f(h, w):
        logp, ent = fused_token_logprobs(
            h, w, targets, 0.9, return_entropy=True, token_chunk=4, vocab_chunk=10
        )
        return logp, ent

    assert torch.autograd.gradcheck(f, (hidden, weight))


def test_bf16_within_stated_tolerance():
    hidden, weight, targets, g, _ = _problem(48, 32, 1500, dtype=torch.bfloat16, seed=4)
    ref = naive_token_logprobs(hidden, weight, targets, 0.7)[0]
    ref_grads = _grads((ref * g).sum(), hidden, weight)
    ours = fused_token_logprobs(hidden, weight, targets, 0.7, token_chunk=16, vocab_chunk=400)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    got = _grads((ours * g).sum(), hidden, weight)
    for a, b in zip(got, ref_grads, strict=True):
        assert a.dtype == torch.bfloat16
        tol = 2 * 2**-7 * b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= tol


def test_no_grad_keeps_no_graph_and_gives_the_same_values():
    hidden, weight, targets, _, _ = _problem(20, 8, 200, seed=5)
    with torch.no_grad():
        cold, cold_ent = fused_token_logprobs(hidden, weight, targets, return_entropy=True)
    warm, warm_ent = fused_token_logprobs(hidden, weight, targets, return_entropy=True)
    assert not cold.requires_grad and cold.grad_fn is None
    assert warm.grad_fn is not None
    torch.testing.assert_close(cold, warm.detach(), atol=0, rtol=0)
    torch.testing.assert_close(cold_ent, warm_ent.detach(), atol=0, rtol=0)


def test_only_the_weight_or_only_the_hidden_states_need_grad():
    hidden, weight, targets, g, _ = _problem(20, 8, 200, seed=6)
    ref = naive_token_logprobs(hidden, weight, targets)[0]
    ref_h, ref_w = _grads((ref * g).sum(), hidden, weight)
    ours = fused_token_logprobs(hidden.detach(), weight, targets, vocab_chunk=64)
    (gw,) = _grads((ours * g).sum(), weight)
    torch.testing.assert_close(gw, ref_w, **FP32)
    ours = fused_token_logprobs(hidden, weight.detach(), targets, vocab_chunk=64)
    (gh,) = _grads((ours * g).sum(), hidden)
    torch.testing.assert_close(gh, ref_h, **FP32)


def test_extreme_logits_stay_finite():
    # Logits of +-1e4: a log-softmax without the running max would overflow exp().
    hidden, weight, targets, g, _ = _problem(10, 4, 600, seed=7)
    hidden = (hidden.detach() * 1e3).requires_grad_()
    ref = naive_token_logprobs(hidden, weight, targets)[0]
    ours = fused_token_logprobs(hidden, weight, targets, vocab_chunk=128)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, ref, atol=1e-2, rtol=1e-5)
    assert all(torch.isfinite(t).all() for t in _grads((ours * g).sum(), hidden, weight))


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 100_000),
    vocab=st.integers(1, 300_000),
    tile=st.sampled_from([1, 1000, 1 << 16, 1 << 22]),
)
def test_choose_chunks_bounds_the_tile(n, vocab, tile):
    c = choose_chunks(n, vocab, "cpu", tile_elements=tile)
    assert 1 <= c.tokens <= n and 1 <= c.vocab <= vocab
    # Never more than the budget, except for the minimum vocabulary width.
    assert c.tokens * c.vocab <= max(tile, c.tokens * min(vocab, MIN_VOCAB_CHUNK) * 2)


def test_choose_chunks_adapts_to_the_shape():
    small = choose_chunks(16, 1000, "cpu")
    assert small == Chunks(tokens=16, vocab=1000)  # one tile: no fixed tiles at small shapes
    big = choose_chunks(8192, 151_936, "cpu")
    assert big.vocab < 151_936 and big.tokens * big.vocab <= 1 << 22


# --- Bad input ------------------------------------------------------------------------------


def test_fused_input_errors():
    h, w, t, _, _ = _problem(4, 8, 10)
    with pytest.raises(ValueError, match=r"targets must be in \[0, 10\), got \[10\]"):
        fused_token_logprobs(h, w, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="same H"):
        fused_token_logprobs(h, w[:, :4], t)
    with pytest.raises(ValueError, match="dtypes differ"):
        fused_token_logprobs(h.double(), w, t)
    with pytest.raises(ValueError, match=r"targets must be \[N\] = \[4\]"):
        fused_token_logprobs(h, w, t[:3])
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        fused_token_logprobs(h, w, t, temperature=0)
    with pytest.raises(ValueError, match="vocab_chunk must be a positive int or None, got 0"):
        fused_token_logprobs(h, w, t, vocab_chunk=0)


# --- On tiny real models ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


MODEL_SPECS = {
    "llama-tied": TinyModelSpec(arch="llama"),
    "qwen2-untied": TinyModelSpec(arch="qwen2", tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(MODEL_SPECS))
def model(request, tokenizer):
    return build_tiny_model(tokenizer, MODEL_SPECS[request.param], seed=1)


def _batch(tokenizer, prompts, completions):
    return rollout_layout(tokenizer, prompts, completions)


PROMPTS = ["37+48=", "5+5=", "123+456=", "9*9="]
COMPLETIONS = ["85", "10 because 5 and 5", "579", ""]


def _params_grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_model_values_and_parameter_gradients_equal_naive(model, tokenizer, temperature):
    batch, _ = _batch(tokenizer, PROMPTS, COMPLETIONS)
    ref, ref_mask = core.sequence_logprobs(model, *batch, temperature)
    ours, mask = token_logprobs(model, *batch, temperature)
    torch.testing.assert_close(mask, ref_mask, atol=0, rtol=0)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref * mask, **FP32)
    assert (ours[mask == 0] == 0).all()

    def loss(logp):
        return core.aggregate(logp, mask, "token")

    ref_grads = _params_grads(model, loss(ref))
    for got, want in zip(_params_grads(model, loss(ours)), ref_grads, strict=True):
        torch.testing.assert_close(got, want, **FP32)


def test_prompt_length_hint_changes_nothing(model, tokenizer):
    batch, P = _batch(tokenizer, PROMPTS, COMPLETIONS)
    with torch.no_grad():
        plain = token_logprobs(model, *batch, return_entropy=True)
        hinted = token_logprobs(model, *batch, return_entropy=True, prompt_length=P)
    for a, b in zip(plain, hinted, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_model_entropy_equals_naive(model, tokenizer):
    batch, _ = _batch(tokenizer, PROMPTS, COMPLETIONS)
    with torch.no_grad():
        ref = token_logprobs(model, *batch, 0.7, impl="naive", return_entropy=True)
        ours = token_logprobs(model, *batch, 0.7, impl="fused", return_entropy=True)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, **FP32)
    mask = ref[1]
    assert (ours[2][mask == 0] == 0).all() and (ours[2][mask == 1] > 0).all()


def test_masked_positions_contribute_nothing(model, tokenizer):
    batch, _ = _batch(tokenizer, PROMPTS, COMPLETIONS)
    ours, mask = token_logprobs(model, *batch)
    assert mask[3].sum() == 1  # the empty completion still has its EOS
    # A plain sum over every position (masked ones included) has the gradient of the sum
    # over completion tokens of the reference path.
    ref, _ = core.sequence_logprobs(model, *batch)
    ref_grads = _params_grads(model, (ref * mask).sum())
    for got, want in zip(_params_grads(model, ours.sum()), ref_grads, strict=True):
        torch.testing.assert_close(got, want, **FP32)


def test_no_completion_token_at_all_gives_zeros_and_zero_gradients(model, tokenizer):
    batch, _ = _batch(tokenizer, PROMPTS, COMPLETIONS)
    no_completion = torch.zeros_like(batch[2])
    logp, mask = token_logprobs(model, batch[0], batch[1], no_completion)
    assert mask.sum() == 0 and torch.equal(logp, torch.zeros_like(logp))
    grads = _params_grads(model, logp.sum())
    assert all(g is None or torch.equal(g, torch.zeros_like(g)) for g in grads)
    hidden, weight, _, _, _ = _problem(0, 8, 100)
    (gw,) = _grads(
        fused_token_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long)).sum(), weight
    )
    assert torch.equal(gw, torch.zeros_like(gw))


def test_naive_impl_is_the_core_with_zeros_where_masked(model, tokenizer):
    batch, _ = _batch(tokenizer, PROMPTS, COMPLETIONS)
    with torch.no_grad():
        ref, ref_mask = core.sequence_logprobs(model, *batch)
        ours, mask = token_logprobs(model, *batch, impl="naive")
    assert torch.equal(mask, ref_mask)
    assert torch.equal(ours, torch.where(mask.bool(), ref, torch.zeros_like(ref)))


def test_bf16_model_within_tolerance(tokenizer):
    model = build_tiny_model(tokenizer, TinyModelSpec(arch="qwen2"), seed=2).to(torch.bfloat16)
    batch, _ = _batch(tokenizer, PROMPTS, COMPLETIONS)
    ref, mask = core.sequence_logprobs(model, *batch)
    ours, _ = token_logprobs(model, *batch)
    torch.testing.assert_close(ours, ref * mask, atol=1e-4, rtol=0)
    head = model.get_output_embeddings().weight
    (g_ref,) = torch.autograd.grad(core.aggregate(ref, mask, "token"), head)
    (g_ours,) = torch.autograd.grad(core.aggregate(ours, mask, "token"), head)
    assert g_ours.dtype == torch.bfloat16
    tol = 2 * 2**-7 * g_ref.float().abs().max().item()
    assert (g_ours.float() - g_ref.float()).abs().max().item() <= tol


def test_token_logprobs_input_errors(model, tokenizer):
    batch, P = _batch(tokenizer, PROMPTS, COMPLETIONS)
    with pytest.raises(ValueError, match=r"impl='chunked' is not one of \['fused', 'naive'\]"):
        token_logprobs(model, *batch, impl="chunked")
    with pytest.raises(ValueError, match="completion_mask has tokens before that column"):
        token_logprobs(model, *batch, prompt_length=P + 1)
    T = batch[0].shape[1]
    with pytest.raises(ValueError, match=rf"prompt_length must be in \[1, {T - 1}\]"):
        token_logprobs(model, *batch, prompt_length=T)
    with pytest.raises(ValueError, match="temperature must be > 0, got -1"):
        token_logprobs(model, *batch, temperature=-1)
    with pytest.raises(ValueError, match="shapes must match"):
        token_logprobs(model, batch[0], batch[1][:, 1:], batch[2])


# --- Models the split cannot reproduce: the naive path, with the reason logged -----------------


class ScaledHeadLlama(LlamaForCausalLM):
    """A Llama whose forward halves its logits: nothing in its config says so."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out


def _assert_falls_back(model, tokenizer, caplog, reason):
    batch, _ = _batch(tokenizer, PROMPTS, COMPLETIONS)
    with caplog.at_level(logging.WARNING, logger="grpolab"), torch.no_grad():
        ours, mask = token_logprobs(model, *batch)
        ref, _ = core.sequence_logprobs(model, *batch)
    assert torch.equal(ours, ref * mask)
    assert any(reason in r.getMessage() and "using naive" in r.getMessage() for r in caplog.records)


def test_lm_head_bias_falls_back(tokenizer, caplog):
    model = build_tiny_model(tokenizer, TinyModelSpec(tie_word_embeddings=False), seed=3)
    old = model.lm_head
    model.lm_head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    assert split_model(model).reason == "LlamaForCausalLM's lm-head has a bias"
    _assert_falls_back(model, tokenizer, caplog, "lm-head has a bias")


def test_logit_softcapping_falls_back(tokenizer, caplog):
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        pad_token_id=tokenizer.pad_token_id,
        final_logit_softcapping=30.0,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval()
    assert "final_logit_softcapping=30.0" in split_model(model).reason
    _assert_falls_back(model, tokenizer, caplog, "final_logit_softcapping")


def test_unannounced_logit_transform_is_caught_by_the_probe(tokenizer, caplog):
    spec = TinyModelSpec()
    base = build_tiny_model(tokenizer, spec, seed=4)
    model = ScaledHeadLlama(base.config).eval()
    model.load_state_dict(base.state_dict())
    assert split_model(model).reason is None  # nothing visible from outside...
    # ...but the one-time probe against model(...).logits sees it.
    _assert_falls_back(model, tokenizer, caplog, "differ from the model's logits")


def test_autocast_takes_the_fused_path_in_autocasts_dtype(model, tokenizer, caplog):
    """Under bf16 autocast the model's own head gives bf16 logits; the tiles are computed in
    bf16 too, so fused and naive agree to bf16 rounding of the logits (not to float32)."""
    batch, _ = _batch(tokenizer, PROMPTS, COMPLETIONS)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    with caplog.at_level(logging.WARNING, logger="grpolab"), autocast:
        ours, mask = token_logprobs(model, *batch)
        ref, _ = core.sequence_logprobs(model, *batch)
    assert not caplog.records  # no fallback
    assert ours.dtype == torch.float32
    gap = (ours - ref * mask).abs().max()
    assert 0 < gap <= 4e-3  # bf16 logits: about one unit in their last place
    fp32, _ = token_logprobs(model, *batch)  # outside autocast
    assert (fp32 - ours).abs().max() > gap  # float32 logits differ more: the dtype was used
    got = torch.autograd.grad((ours * mask).sum(), params, allow_unused=True)
    want = torch.autograd.grad((ref * mask).sum(), params, allow_unused=True)
    for a, b in zip(got, want, strict=True):
        if b is not None:
            assert (a - b).abs().max() <= 2e-2 * b.abs().max()
