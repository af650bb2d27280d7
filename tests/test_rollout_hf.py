"""HFEngine: transformers generate on a tiny real model; masks, groups, log-probs, seeding."""

from __future__ import annotations

import pytest
import torch
from tolerances import logprob_tolerance

from grpolab import core
from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model
from grpolab.rollout import SamplingParams
from grpolab.rollout.common import SAMPLERS
from grpolab.rollout.hf import HFEngine

PROMPTS = ["37+48=", "5+6=", "a longer prompt here:"]
EOS_BIAS = 4.0  # added to the EOS logit by eos_biased_model


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def eos_biased_model(tokenizer, bias: float = EOS_BIAS, seed: int = 0):
    """A tiny Llama whose lm_head favours EOS, so that completions of many lengths occur."""
    model = build_tiny_model(tokenizer, TinyModelSpec(), seed=seed)
    shift = torch.zeros(len(tokenizer))
    shift[tokenizer.eos_token_id] = bias
    model.lm_head.register_forward_hook(lambda module, args, out: out + shift)
    return model


@pytest.fixture(scope="module")
def model(tokenizer):
    return eos_biased_model(tokenizer)


def test_shapes_groups_and_masks(model, tokenizer):
    G, C = 4, 10
    r = HFEngine(model, tokenizer).generate(
        PROMPTS, G, SamplingParams(max_completion_length=C, seed=0)
    )
    B = len(PROMPTS) * G
    assert r.batch_size == B and r.input_ids.shape[1] <= r.prompt_length + C
    assert r.group_ids.tolist() == [i // G for i in range(B)]
    assert r.prompts == [p for p in PROMPTS for _ in range(G)]
    P, eos, pad = r.prompt_length, tokenizer.eos_token_id, tokenizer.pad_token_id
    assert max(len(p) for p in PROMPTS) == P  # one char per token
    lengths = r.completion_mask.sum(1)
    assert not r.truncated.all() and len(set(lengths.tolist())) > 1  # EOS at many places
    for i in range(B):
        prompt = tokenizer(r.prompts[i])["input_ids"]
        n = int(lengths[i])
        row, attn, comp = r.input_ids[i], r.attention_mask[i], r.completion_mask[i]
        # prompt left-padded, ending at column P; prompt and padding never in the completion mask
        assert row[P - len(prompt) : P].tolist() == prompt
        assert (row[: P - len(prompt)] == pad).all() and (attn[: P - len(prompt)] == 0).all()
        assert (attn[P - len(prompt) : P] == 1).all() and (comp[:P] == 0).all()
        # completion: contiguous from P; EOS (if any) is its last token and masked 1
        assert (comp[P : P + n] == 1).all() and (attn[P : P + n] == 1).all()
        assert (comp[P + n :] == 0).all() and (attn[P + n :] == 0).all()
        assert (row[P + n :] == pad).all()
        completion = row[P : P + n].tolist()
        if r.truncated[i]:
            assert n == C and eos not in completion
        else:
            assert completion[-1] == eos and eos not in completion[:-1]
        text_ids = completion if r.truncated[i] else completion[:-1]
        assert r.completions[i] == tokenizer.decode(text_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_completion_length=12, seed=1),
        SamplingParams(max_completion_length=12, seed=2, temperature=0.7, top_k=5, top_p=0.9),
        SamplingParams(max_completion_length=12, seed=3, temperature=1.3, top_p=0.5),
        SamplingParams(max_completion_length=12, seed=4, sampler="inverse_cdf"),
        SamplingParams(
            max_completion_length=12, seed=5, temperature=0.7, top_k=5, sampler="inverse_cdf"
        ),
    ],
    ids=["t1", "t0.7-topk-topp", "t1.3-topp", "inverse_cdf", "inverse_cdf-topk"],
)
def test_engine_logprobs_equal_sequence_logprobs(model, tokenizer, params):
    r = HFEngine(model, tokenizer).generate(PROMPTS, 3, params)
    assert r.engine_logprobs.shape == (r.batch_size, r.input_ids.shape[1] - 1)
    logp, mask = core.sequence_logprobs(
        model, r.input_ids, r.attention_mask, r.completion_mask, params.temperature
    )
    assert torch.equal(mask, r.completion_mask[:, 1:].float())
    assert (r.engine_logprobs[mask == 0] == 0).all()
    # The engine's decode (a KV cache, one token at a time) against one forward of the batch.
    tol = logprob_tolerance(model, params.temperature, logit_shift=EOS_BIAS)
    torch.testing.assert_close(r.engine_logprobs, logp * mask, atol=tol, rtol=0)


def test_top_k_truncates_sampling_but_not_the_reported_distribution(model, tokenizer):
    params = SamplingParams(max_completion_length=8, seed=0, top_k=1)
    r = HFEngine(model, tokenizer).generate(PROMPTS[:1], 2, params)
    greedy = HFEngine(model, tokenizer).generate(
        PROMPTS[:1], 2, SamplingParams(max_completion_length=8, temperature=0)
    )
    assert torch.equal(r.input_ids, greedy.input_ids)  # top_k=1 samples the argmax
    # ...but the log-probs are of the full softmax: below 0, not the truncated 0.
    assert (r.engine_logprobs[r.completion_mask[:, 1:].bool()] < 0).all()


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_each_sampler_draws_the_distribution_and_never_a_zero(sampler):
    """200k draws from one distribution with zeros first, inside and last (what top-k / top-p
    leave): each frequency within 6 binomial standard deviations of its probability (a false
    alarm about once in 10^8 per entry), the zeros never drawn, the same draws for the same
    seed."""
    p = torch.tensor([0.0, 0.3, 0.0, 0.05, 0.4, 1e-3, 0.249, 0.0, 0.0])  # sums to 1
    n = 200_000
    draw = SAMPLERS[sampler]
    tokens = draw(p.expand(n, -1), torch.Generator().manual_seed(0))
    assert tokens.shape == (n,) and tokens.dtype == torch.long
    frequency = torch.bincount(tokens, minlength=p.numel()).double() / n
    assert (frequency[p == 0] == 0).all()
    sigma = (p.double() * (1 - p.double()) / n).sqrt()
    assert ((frequency - p.double()).abs() <= 6 * sigma).all(), (frequency, p)
    again = draw(p.expand(n, -1), torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)
    # Unnormalised rows (a softmax's sum is 1 only to rounding) draw the same distribution.
    scaled = draw(3 * p.expand(64, -1), torch.Generator().manual_seed(1))
    assert torch.equal(scaled, draw(p.expand(64, -1), torch.Generator().manual_seed(1)))


def test_seeded_reproducible_and_global_rng_untouched(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(max_completion_length=10, seed=5)
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    a = engine.generate(PROMPTS, 4, params)
    assert torch.equal(torch.rand(4), expected)  # generation drew nothing from the global RNG
    b = engine.generate(PROMPTS, 4, params)
    c = engine.generate(PROMPTS, 4, SamplingParams(max_completion_length=10, seed=6))
    assert torch.equal(a.input_ids, b.input_ids) and a.completions == b.completions
    assert not torch.equal(a.input_ids, c.input_ids)
    # The G samples of one prompt differ from each other (sampling, not G copies of one).
    assert len(set(a.completions[:4])) > 1


def test_restores_train_mode_and_needs_no_grad(tokenizer):
    model = eos_biased_model(tokenizer)
    model.train()
    r = HFEngine(model, tokenizer).generate(PROMPTS[:1], 2, SamplingParams(max_completion_length=4))
    assert model.training
    assert not r.engine_logprobs.requires_grad
    model.eval()
    HFEngine(model, tokenizer).generate(PROMPTS[:1], 2, SamplingParams(max_completion_length=4))
    assert not model.training


def test_checkpoint_generation_config_does_not_change_sampling(tokenizer):
    """A repetition penalty in the model's own generation config must not leak into sampling
    (the reported log-probs would no longer be those of the distribution sampled from)."""
    model = eos_biased_model(tokenizer)
    model.generation_config.repetition_penalty = 5.0
    params = SamplingParams(max_completion_length=12, seed=1)
    r = HFEngine(model, tokenizer).generate(PROMPTS, 2, params)
    assert model.generation_config.repetition_penalty == 5.0  # restored
    logp, mask = core.sequence_logprobs(model, r.input_ids, r.attention_mask, r.completion_mask)
    tol = logprob_tolerance(model, logit_shift=EOS_BIAS)
    torch.testing.assert_close(r.engine_logprobs, logp * mask, atol=tol, rtol=0)


def test_chat_template(model, tokenizer):
    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    engine = HFEngine(model, tok, chat_template=True, system_prompt="Be brief.")
    r = engine.generate(["1+1="], 2, SamplingParams(max_completion_length=4))
    rendered = "<system>Be brief.\n<user>1+1=\n<assistant>"
    P = r.prompt_length
    assert len(rendered) == P
    assert tok.decode(r.input_ids[0, :P].tolist()) == rendered
    assert r.prompts == ["1+1=", "1+1="]  # as given, before templating
    logp, mask = core.sequence_logprobs(model, r.input_ids, r.attention_mask, r.completion_mask)
    tol = logprob_tolerance(model, logit_shift=EOS_BIAS)
    torch.testing.assert_close(r.engine_logprobs, logp * mask, atol=tol, rtol=0)
    with pytest.raises(ValueError, match="no chat_template"):
        HFEngine(model, tokenizer, chat_template=True).generate(["x"], 2, SamplingParams())


def test_bad_prompts(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate(["1+1=", "  "], 2, SamplingParams())
    context = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"prompt 0 .* exceeds the model context of {context}"):
        engine.generate(["9" * context], 2, SamplingParams(max_completion_length=4))
    with pytest.raises(ValueError, match="num_generations"):
        engine.generate(["1+1="], 0, SamplingParams())


# --- `grpolab rollout` ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from grpolab.model.policy import save_policy

    tok = build_char_tokenizer()
    path = tmp_path_factory.mktemp("policy")
    save_policy(build_tiny_model(tok, TinyModelSpec(), seed=1), tok, path)
    return path


def test_rollout_command_json(model_dir, capsys):
    import json

    from grpolab.commands.rollout import main
    from grpolab.tasks import SAMPLE_GSM8K

    args = [
        "--n-prompts", "2", "--json",
        f"model.name_or_path={model_dir}",
        "task.name=gsm8k", f"task.path={SAMPLE_GSM8K}", "task.prompt_template={prompt}",
        "batch.num_generations=3", "rollout.max_completion_length=6",
        "rewards.functions=accuracy,format", "rewards.weights=1,0.5",
    ]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    samples = out["samples"]
    assert len(samples) == 6 and [s["group"] for s in samples] == [0, 0, 0, 1, 1, 1]
    for s in samples:
        assert {"group", "prompt", "completion", "reward", "truncated"} <= set(s)
        assert s["rewards"].keys() == {"accuracy", "format"}
        assert s["reward"] == s["rewards"]["accuracy"] + 0.5 * s["rewards"]["format"]
        assert s["length"] <= 6 and (not s["truncated"] or s["length"] == 6)
    assert samples[0]["prompt"] == samples[2]["prompt"] != samples[3]["prompt"]
    assert "reward_errors/accuracy" in out["metrics"] and "truncated_frac" in out["metrics"]
    # Deterministic: same config and seed, same samples.
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == samples


def test_rollout_command_table_and_errors(model_dir, capsys):
    from grpolab.commands.rollout import main

    assert main(["--n-prompts", "1", f"model.name_or_path={model_dir}",
                 "batch.num_generations=2", "rollout.max_completion_length=4"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "rollout: arithmetic, G=2" in out and "accuracy" in out
    assert main(["batch.num_generations=1"]) == 2
    assert "batch.num_generations=1" in capsys.readouterr().err
    assert main(["task.name=jsonl", "task.path=/nonexistent/x.jsonl"]) == 2
    assert "/nonexistent/x.jsonl" in capsys.readouterr().err
    assert main(["rewards.functions=nope.py:f"]) == 2
    assert "reward file 'nope.py' does not exist" in capsys.readouterr().err


def test_every_registered_engine_implements_the_whole_interface():
    """rollout.engine names a class that fills every member of RolloutEngine (the trainer
    reads them without fallbacks); an unknown name says which names there are."""
    import inspect

    from grpolab.rollout import ENGINES, RolloutEngine, engine_class

    for name in ENGINES:
        cls = engine_class(name)
        assert issubclass(cls, RolloutEngine) and not inspect.isabstract(cls), name
    with pytest.raises(ValueError, match=r"rollout\.engine='sglang' is not one of"):
        engine_class("sglang")
