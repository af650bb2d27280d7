"""Multi-turn episodes on the vLLM engine (vLLM CPU, a tiny real Llama): the same layout and
the same episode checks as the HF engine's decode loop.

Skips only when vllm cannot be imported and CI is unset; under CI a missing vllm fails."""

from __future__ import annotations

import pytest
import torch
from need_vllm import require_vllm
from tolerances import logprob_tolerance

from grpolab import core
from grpolab.checks.episodes import probe_episodes
from grpolab.checks.runner import run_episode_checks
from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model
from grpolab.rollout import RolloutConfig, SamplingParams
from grpolab.rollout.episodes import EpisodeSetup, ProbeEnvironment
from grpolab.rollout.vllm import VLLMEngineConfig

pytestmark = pytest.mark.slow  # vLLM


@pytest.fixture(scope="module")
def setup():
    require_vllm()
    from grpolab.rollout.vllm import VLLMEngine

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelSpec(), seed=0)
    episodes = EpisodeSetup(ProbeEnvironment, tokenizer, chat_template=False)
    cfg = RolloutConfig(engine="vllm", vllm=VLLMEngineConfig(max_model_len=128))
    engine = VLLMEngine.from_model(model, tokenizer, cfg, episodes=episodes)
    yield model, tokenizer, engine
    engine.close()


def params(seed=0):
    return SamplingParams(max_completion_length=8, seed=seed, max_turns=4, max_episode_tokens=96)


def test_vllm_episodes_have_the_layout_and_the_logprobs_of_their_stream(setup):
    model, tokenizer, engine = setup
    r = engine.generate(["37+48=", "5+5=", "12+30="], 8, params())
    counts = [len(t) for t in r.turns]
    assert all(len(set(counts[g * 8 : (g + 1) * 8])) > 1 for g in range(3)), counts
    P = r.prompt_length
    tool = tokenizer("<tool_response>probe 1</tool_response>", add_special_tokens=False)
    for i, turns in enumerate(r.turns):
        mask = torch.zeros(r.input_ids.shape[1] - P, dtype=torch.long)
        for t in turns:
            if t.role == "assistant":
                mask[t.start : t.end] = 1
            elif t.text == "probe 1":
                assert r.input_ids[i, P + t.start : P + t.end].tolist() == tool["input_ids"]
        assert torch.equal(r.completion_mask[i, P:], mask)
    logp, mask = core.sequence_logprobs(model, r.input_ids, r.attention_mask, r.completion_mask)
    torch.testing.assert_close(
        r.engine_logprobs, logp * mask, atol=logprob_tolerance(model), rtol=0
    )
    again = engine.generate(["37+48=", "5+5=", "12+30="], 8, params())
    assert torch.equal(again.input_ids, r.input_ids)  # seeded per episode and turn


def test_vllm_episodes_pass_the_episode_checks(setup):
    model, _, engine = setup
    batch = probe_episodes(engine, ["37+48=", "5+5=", "12+30=", "99+1="], 4, params(seed=3))
    failed = [(r.id, r.measured) for r in run_episode_checks(model, batch) if not r.passed]
    assert not failed
