"""Episodes on the real model (SmolLM2-135M-Instruct, a real BPE tokenizer and the ChatML
template): the template's own tool-turn glue, the tools listed in a system turn (its
template ignores `tools=`), and the episode checks, which a re-tokenised conversation fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from grpolab.checks.episodes import probe_episodes
from grpolab.checks.runner import run_episode_checks
from grpolab.functions import load_episode_impl
from grpolab.model.policy import load_policy, resolve_model_source
from grpolab.rollout import SamplingParams
from grpolab.rollout.episodes import EpisodeSetup, ProbeEnvironment, template_glue
from grpolab.rollout.hf import HFEngine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from calculator import calculator  # noqa: E402

PROMPTS = ["What is 37 + 48?", "What is 12 * 3?"]

pytestmark = pytest.mark.slow  # the real SmolLM2


@pytest.fixture(scope="module")
def real():
    model, tokenizer = load_policy(resolve_model_source("smollm2-135m-instruct"))
    setup = EpisodeSetup(ProbeEnvironment, tokenizer, chat_template=True, tools=[calculator])
    engine = HFEngine(model, tokenizer, chat_template=True, episodes=setup)
    params = SamplingParams(max_completion_length=6, seed=0, max_turns=2, max_episode_tokens=40)
    return model, tokenizer, probe_episodes(engine, PROMPTS, 4, params)


def test_the_chatml_tool_turn_and_the_system_listing(real):
    _, tokenizer, batch = real
    assert template_glue(tokenizer) == (
        "<|im_end|>\n<|im_start|>tool\n",
        "<|im_end|>\n<|im_start|>assistant\n",
    )
    prompt = tokenizer.decode(batch.prompt_ids[0])
    assert prompt.startswith("<|im_start|>system\n")
    assert "You can call these tools:\n- calculator(expression: string)" in prompt
    tools = [t for ep in batch.episodes for t in ep.turns if t.role == "tool"]
    assert tools  # the probe answered some turns
    glue = tokenizer("<|im_end|>\n<|im_start|>tool\nprobe 1<|im_end|>\n<|im_start|>assistant\n")
    for ep in batch.episodes:
        for t in ep.turns:
            if t.role == "tool":
                assert ep.tokens[t.start : t.end] == glue["input_ids"]


def test_the_episode_checks_pass_on_the_real_model_and_catch_re_tokenising(real):
    model, _, batch = real
    results = {r.id: r for r in run_episode_checks(model, batch)}
    assert all(r.passed for r in results.values()), [
        (r.id, r.measured) for r in results.values() if not r.passed
    ]
    mutant = load_episode_impl(ROOT / "tests" / "mutants" / "episode_retokenised.py")
    results = {r.id: r for r in run_episode_checks(model, batch, fns=mutant)}
    assert not results["episode.token_stream"].passed
