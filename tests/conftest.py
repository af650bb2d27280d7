"""What many tests would otherwise build again, built once per session: the shipped demo model
and its tokenizer; the tiny model (seed 0) with the character tokenizer, its rollout and the
checks' scored batch on that rollout.

A session fixture is shared by every test that asks for it, so no test may change it: each is
compared with a snapshot taken when it was built after every test (`Shared`), and a test that
changed it fails at its teardown, naming the fixture. A test that trains or edits the demo
model takes its own copy (`demo_model`)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from grpolab.checks.context import PreflightBatch
from grpolab.checks.episodes import probe_episodes
from grpolab.model.policy import build_char_tokenizer, build_tiny_model, load_policy
from grpolab.rollout.base import Rollout, SamplingParams
from grpolab.rollout.episodes import EpisodeSetup, ProbeEnvironment
from grpolab.rollout.hf import HFEngine
from grpolab.train.setup import DEMO_MODEL_DIR

# The checks' batch: 4 prompts x G=4 samples of the tiny model, with rewards that vary in
# three groups and are flat in the last.
PROMPTS = ["37+48=", "5+5=", "12+30=", "99+1="]
G = 4
REWARDS = [1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0.5, 0, 0, 0, 0, 0, 0]


def tiny_policy() -> tuple[torch.nn.Module, object]:
    """The tiny random Llama (seed 0) and the character tokenizer it was built for."""
    tokenizer = build_char_tokenizer()
    return build_tiny_model(tokenizer, seed=0), tokenizer


def tiny_rollout(model, tokenizer) -> Rollout:
    """A real rollout of the tiny model: PROMPTS x G samples of up to 8 tokens, seed 0."""
    params = SamplingParams(max_completion_length=8, seed=0)
    return HFEngine(model, tokenizer).generate(PROMPTS, G, params)


def scored_batch(rollout: Rollout) -> PreflightBatch:
    """The rollout as the checks read it, with REWARDS."""
    return PreflightBatch(
        rollout.input_ids,
        rollout.attention_mask,
        rollout.completion_mask,
        torch.tensor(REWARDS),
        G,
        rollout.engine_logprobs,
    )


# --- Shared, never changed ------------------------------------------------------------------


def _state(value, name: str = "") -> dict[str, object]:
    """Everything a test could change in `value`, by name: tensors (cloned), a module's
    weights, buffers, mode and gradients, a dataclass's fields, a tokenizer's settings."""
    if isinstance(value, torch.Tensor):
        return {name: value.detach().clone()}
    if isinstance(value, torch.nn.Module):
        state = {f"{name}.{k}": v.detach().clone() for k, v in value.state_dict().items()}
        state[f"{name}.training"] = value.training
        state[f"{name} gradients"] = [p.grad is None for p in value.parameters()]
        state[f"{name} requires_grad"] = [p.requires_grad for p in value.parameters()]
        return state
    if dataclasses.is_dataclass(value):
        parts = [
            _state(getattr(value, f.name), f"{name}.{f.name}") for f in dataclasses.fields(value)
        ]
        return {k: v for part in parts for k, v in part.items()}
    if isinstance(value, tuple | list):
        return {
            k: v for i, item in enumerate(value) for k, v in _state(item, f"{name}[{i}]").items()
        }
    if hasattr(value, "get_vocab"):  # a tokenizer
        return {name: (value.get_vocab(), value.padding_side, repr(value.special_tokens_map))}
    return {name: copy.deepcopy(value)}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


class Shared:
    """A session fixture's value and the snapshot it must still match after every test."""

    def __init__(self, name: str, value):
        self.name, self.value, self.saved = name, value, _state(value, name)

    def changed(self) -> list[str]:
        now, saved = _state(self.value, self.name), self.saved
        keys = sorted(saved.keys() | now.keys())
        return [k for k in keys if k not in saved or k not in now or not _same(saved[k], now[k])]


SHARED: list[Shared] = []


def shared(name: str, value):
    SHARED.append(Shared(name, value))
    return value


@pytest.fixture(autouse=True)
def _session_fixtures_unchanged(request):
    """Fails the test that changed a session fixture, at its teardown."""
    yield
    for s in SHARED:
        changed = s.changed()
        assert not changed, (
            f"{request.node.nodeid} changed the session fixture {s.name}: {changed[:5]}"
        )


# --- The fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def demo_policy():
    """The shipped demo model (a tiny warm-started Llama) and its 18-symbol tokenizer, loaded
    once; read-only (a test that trains or edits it takes `demo_model`)."""
    return shared("demo_policy", load_policy(DEMO_MODEL_DIR))


@pytest.fixture(scope="session")
def demo_tokenizer(demo_policy):
    return demo_policy[1]


@pytest.fixture
def demo_model(demo_policy):
    """A copy of the demo model of this test's own, to train or edit."""
    return copy.deepcopy(demo_policy[0])


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer): the tiny model of seed 0 and the character tokenizer; read-only."""
    return shared("tiny", tiny_policy())


@pytest.fixture(scope="session")
def rollout(tiny):
    """A real rollout of the tiny model (PROMPTS x G); read-only."""
    return shared("rollout", tiny_rollout(*tiny))


@pytest.fixture(scope="session")
def model_and_batch(tiny, rollout):
    """The tiny model and the checks' scored batch on its rollout; read-only."""
    return tiny[0], shared("scored batch", scored_batch(rollout))


@pytest.fixture(scope="session")
def probe_batch(tiny):
    """Probe episodes of the tiny model (grpolab.rollout.episodes.ProbeEnvironment's tool
    turns) for PROMPTS x G, as the episode checks read them; read-only."""
    model, tokenizer = tiny
    setup = EpisodeSetup(ProbeEnvironment, tokenizer, False, ())
    engine = HFEngine(model, tokenizer, chat_template=False, episodes=setup)
    params = SamplingParams(max_completion_length=8, seed=0, max_turns=3, max_episode_tokens=80)
    return shared("probe episodes", probe_episodes(engine, PROMPTS, G, params))


@pytest.fixture(autouse=True)
def own_preflight_cache(tmp_path_factory, monkeypatch):
    """Each test remembers passing preflights in a directory of its own (the commands it
    starts inherit it), so no test reuses another's pass or the user's."""
    monkeypatch.setenv("GRPOLAB_PREFLIGHT_CACHE", str(tmp_path_factory.mktemp("preflight-cache")))
