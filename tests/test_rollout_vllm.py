"""VLLMEngine on a tiny real Llama (vLLM CPU): log-probs, masks, seeding, weight sync.

Skips only when vllm cannot be imported and CI is unset; under CI a missing vllm fails.
One engine is shared by the module (starting one takes ~10 s).
"""

from __future__ import annotations

import random

import pytest
import torch
from need_vllm import require_vllm
from tolerances import logprob_tolerance

from grpolab import core
from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model
from grpolab.rollout import RolloutConfig, SamplingParams
from grpolab.rollout.vllm import VLLMEngineConfig

PROMPTS = ["37+48=", "5+6=", "a longer prompt here:"]

pytestmark = pytest.mark.slow  # vLLM


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def trained(tokenizer):
    """The trainer's model (a copy the tests may change) and the shared engine."""
    require_vllm()
    from grpolab.rollout.vllm import VLLMEngine

    model = build_tiny_model(tokenizer, TinyModelSpec(), seed=0)
    # a whole KV block + decode
    cfg = RolloutConfig(engine="vllm", vllm=VLLMEngineConfig(max_model_len=256))
    torch.manual_seed(0)
    before = torch.get_rng_state(), random.getstate(), torch.get_num_threads()
    engine = VLLMEngine.from_model(model, tokenizer, cfg)
    after = torch.get_rng_state(), random.getstate(), torch.get_num_threads()
    yield model, engine, (before, after)
    engine.close()


def check_logprobs(model, rollout, temperature):
    logp, mask = core.sequence_logprobs(
        model, rollout.input_ids, rollout.attention_mask, rollout.completion_mask, temperature
    )
    assert rollout.engine_logprobs is not None
    assert (rollout.engine_logprobs[mask == 0] == 0).all()
    tol = logprob_tolerance(model, temperature)  # vLLM's kernels against the trainer's forward
    torch.testing.assert_close(rollout.engine_logprobs, logp * mask, atol=tol, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_logprobs_masks_and_groups(trained, tokenizer, temperature):
    model, engine, _ = trained
    G, C = 4, 12
    params = SamplingParams(max_completion_length=C, temperature=temperature, seed=1)
    r = engine.generate(PROMPTS, G, params)
    B, P = len(PROMPTS) * G, r.prompt_length
    assert r.batch_size == B and r.group_ids.tolist() == [i // G for i in range(B)]
    assert max(len(p) for p in PROMPTS) == P
    eos = tokenizer.eos_token_id
    for i in range(B):
        n = int(r.completion_mask[i].sum())
        prompt = tokenizer(r.prompts[i])["input_ids"]
        assert r.input_ids[i, P - len(prompt) : P].tolist() == prompt
        assert (r.attention_mask[i, : P - len(prompt)] == 0).all()
        assert (r.completion_mask[i, P : P + n] == 1).all() and (
            r.attention_mask[i, P + n :] == 0
        ).all()
        completion = r.input_ids[i, P : P + n].tolist()
        assert r.truncated[i] == (eos not in completion)
        if not r.truncated[i]:
            assert completion[-1] == eos
        else:
            assert n == C
    assert len(set(r.completions[:G])) > 1
    check_logprobs(model, r, temperature)


def test_vllm_seeded_and_host_state_untouched(trained):
    _, engine, (before, after) = trained
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
    params = SamplingParams(max_completion_length=8, seed=3)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    a = engine.generate(PROMPTS, 3, params)
    assert torch.equal(torch.rand(3), expected)
    b = engine.generate(PROMPTS, 3, params)
    c = engine.generate(PROMPTS, 3, SamplingParams(max_completion_length=8, seed=4))
    assert torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)
    # top-p truncates: vLLM's log-probs would be renormalised over the nucleus, so none.
    assert engine.generate(PROMPTS[:1], 2, SamplingParams(top_p=0.9)).engine_logprobs is None


def test_vllm_follows_weight_sync(trained):
    """After the trainer updates its weights and syncs, the engine samples from the new policy."""
    model, engine, _ = trained
    params = SamplingParams(max_completion_length=10, seed=7)
    old = engine.generate(PROMPTS, 3, params)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    engine.sync_weights(model)
    new = engine.generate(PROMPTS, 3, params)
    check_logprobs(model, new, 1.0)  # the engine's log-probs are the new model's
    assert not torch.equal(old.input_ids, new.input_ids)
    # The old samples scored by the new model differ from what the engine reported then.
    logp, mask = core.sequence_logprobs(
        model, old.input_ids, old.attention_mask, old.completion_mask
    )
    assert (old.engine_logprobs - logp * mask).abs().max() > 1e-2


def test_vllm_sync_is_verified_and_a_corrupted_weight_is_caught(trained):
    """The canary check after a sync: a faithful sync passes with a tiny gap; a sync that
    delivers one wrong tensor (as a LoRA-merge or shard-gather bug would) raises, naming it."""
    from grpolab.rollout.vllm import WeightSyncError

    model, engine, _ = trained
    assert engine.sync_tolerance == 1e-3  # float32
    engine.sync_weights(model)
    tol = logprob_tolerance(model)  # the canary: vLLM's log-probs against the trainer's
    assert engine.last_sync_gap is not None and engine.last_sync_gap <= tol
    state = {k: v.clone() for k, v in model.state_dict().items()}
    name = "model.layers.1.mlp.down_proj.weight"
    state[name] = state[name] * 1.5  # the engine gets a corrupted copy; the trainer does not
    engine.load_weights(state)
    with pytest.raises(WeightSyncError, match=r"differ from the trainer's by up to [0-9.e-]+ "):
        engine.check_sync(model)
    assert engine.last_sync_gap > 1e-3
    engine.sync_weights(model)  # a faithful sync afterwards passes again
    assert engine.last_sync_gap <= tol


def test_rollout_json_with_vllm_keeps_stdout_for_the_json():
    """vLLM logs to stdout; under --json those lines go to stderr, stdout is the object."""
    import json
    import subprocess
    import sys

    require_vllm()
    cmd = [sys.executable, "-m", "grpolab", "rollout", "--json", "--n-prompts", "2"]
    args = ["rollout.engine=vllm", "rollout.vllm.max_model_len=64", "batch.num_generations=2"]
    out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(out.stdout.splitlines()) == 1, out.stdout[:2000]
    assert len(json.loads(out.stdout)["samples"]) == 4
    assert "Loading" in out.stderr  # what vLLM printed went somewhere: to stderr


def test_the_canary_catches_a_stale_prefix_cache(trained):
    """A sync that loads the new weights but keeps the KV blocks cached with the old ones
    (verl #7495, prime-rl PR #1650): scoring the canary as a prompt bypasses the cache and
    agrees; decoding after its cached first half does not, and the check says so."""
    from grpolab.rollout.vllm import WeightSyncError, engine_state_dict, state_dict_bytes

    model, engine, _ = trained
    engine.sync_weights(model)  # caches the canary's prefix with these weights
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    payload = state_dict_bytes(engine_state_dict(model))
    engine.llm.collective_rpc("grpolab_load_weights", args=(payload,))  # no cache reset
    with pytest.raises(WeightSyncError, match="stale prefix cache"):
        engine.check_sync(model)
    engine.sync_weights(model)  # the faithful sync resets the cache: agreement again
    assert engine.last_sync_gap <= logprob_tolerance(model)
