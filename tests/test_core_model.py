"""sequence_logprobs against a tiny real transformers model built offline."""

import pytest
import torch
from layout import rollout_layout
from tolerances import logprob_tolerance

from grpolab import core
from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tokenizer):
    return build_tiny_model(tokenizer, TinyModelSpec(arch=request.param), seed=1)


def _batch(tokenizer, prompts, completions):
    return rollout_layout(tokenizer, prompts, completions)[0]


PROMPTS = ["37+48=", "5+5=", "123+456="]
COMPLETIONS = ["85", "10", "579"]


def test_equals_minus_the_models_own_labels_loss(model, tokenizer):
    ids, attn, comp = _batch(tokenizer, PROMPTS, COMPLETIONS)
    with torch.no_grad():
        logp, mask = core.sequence_logprobs(model, ids, attn, comp)
        assert logp.shape == mask.shape == (3, ids.shape[1] - 1)
        for i in range(3):
            # Row i alone, without its padding: the model's mean cross-entropy over the
            # completion tokens (labels are shifted inside the model).
            keep = attn[i].bool()
            labels = ids[i][keep].masked_fill(comp[i][keep] == 0, -100)
            ce = model(input_ids=ids[i][keep][None], labels=labels[None]).loss
            n = int(mask[i].sum())
            ours = (logp[i] * mask[i]).sum() / n
            torch.testing.assert_close(ours, -ce, atol=logprob_tolerance(model), rtol=0)


def test_mask_is_the_completion_shifted_by_one(tokenizer, model):
    ids, attn, comp = _batch(tokenizer, PROMPTS, COMPLETIONS)
    with torch.no_grad():
        _, mask = core.sequence_logprobs(model, ids, attn, comp)
    assert torch.equal(mask, comp[:, 1:].float())
    # Each row predicts exactly its completion tokens + EOS.
    assert mask.sum(1).tolist() == [len(c) + 1 for c in COMPLETIONS]


def test_left_padding_does_not_change_logprobs(model, tokenizer):
    ids, attn, comp = _batch(tokenizer, PROMPTS, COMPLETIONS)
    with torch.no_grad():
        batched, mask = core.sequence_logprobs(model, ids, attn, comp)
        for i in range(3):
            keep = attn[i].bool()
            alone, m = core.sequence_logprobs(
                model, ids[i][keep][None], attn[i][keep][None], comp[i][keep][None]
            )
            # The padding changes the shapes the kernels reduce over, not the value.
            torch.testing.assert_close(
                batched[i][mask[i].bool()],
                alone[0][m[0].bool()],
                atol=logprob_tolerance(model),
                rtol=0,
            )


def test_temperature_divides_the_logits(model, tokenizer):
    ids, attn, comp = _batch(tokenizer, PROMPTS, COMPLETIONS)
    with torch.no_grad():
        logp, _ = core.sequence_logprobs(model, ids, attn, comp, temperature=0.7)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, :-1]
        ref = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, ids[:, 1:, None])[..., 0]
        plain, _ = core.sequence_logprobs(model, ids, attn, comp)
    # The same logits (the same forward), a float32 against a float64 log-softmax.
    torch.testing.assert_close(logp.double(), ref, atol=logprob_tolerance(model, 0.7), rtol=0)
    assert (logp - plain).abs().max() > 1e-2  # temperature 0.7 is not temperature 1


def test_bf16_model_gives_float32_matching_a_float64_reference(tokenizer):
    model = build_tiny_model(tokenizer, seed=2).to(torch.bfloat16)
    ids, attn, comp = _batch(tokenizer, PROMPTS, COMPLETIONS)
    with torch.no_grad():
        logp, _ = core.sequence_logprobs(model, ids, attn, comp)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, :-1]
        assert logits.dtype == torch.bfloat16
        ref = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        bf16 = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert logp.dtype == torch.float32
    tol = logprob_tolerance(model)  # float32 rounding of a log-softmax of these logits
    torch.testing.assert_close(logp.double(), ref, atol=tol, rtol=0)
    assert (bf16.double() - ref).abs().max() > 10 * tol  # what the float32 cast protects against


def test_gradient_flows_only_through_completion_tokens(model, tokenizer):
    ids, attn, comp = _batch(tokenizer, PROMPTS, COMPLETIONS)
    logp, mask = core.sequence_logprobs(model, ids, attn, comp)
    logp.retain_grad()
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, _ = core.grpo_loss(logp, logp.detach(), None, adv, mask)
    model.zero_grad()
    loss.backward()
    assert torch.all(logp.grad[~mask.bool()] == 0)
    assert torch.all(logp.grad[mask.bool()] != 0)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"completion_mask": torch.ones(3, 5)}, "completion_mask (3, 5)"),
        ({"input_ids": torch.ones(3, 1, dtype=torch.long)}, "attention_mask"),
    ],
)
def test_sequence_logprobs_errors(model, tokenizer, kwargs, message):
    ids, attn, comp = _batch(tokenizer, PROMPTS, COMPLETIONS)
    args = {"input_ids": ids, "attention_mask": attn, "completion_mask": comp} | kwargs
    with pytest.raises(ValueError) as err:
        core.sequence_logprobs(model, **args)
    assert message in str(err.value)


def test_sequence_logprobs_needs_two_tokens(model):
    one = torch.ones(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="T >= 2"):
        core.sequence_logprobs(model, one, one, one)
