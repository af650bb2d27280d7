"""The interface every rollout engine implements, and the registry `rollout.engine` picks
from."""

from __future__ import annotations

import abc
import importlib

import torch

from grpolab.model.precision import FP32, Precision
from grpolab.rollout.base import Rollout, SamplingParams
from grpolab.rollout.episodes import Episode, EpisodeSetup


class RolloutEngine(abc.ABC):
    """Everything the trainer, the preflight and the evaluation use of an engine. An engine
    is registered by name in ENGINES and built by its `from_model`."""

    tokenizer: object  # the trainer's tokenizer: prompts are encoded and decoded with it
    chat_template: bool  # prompts rendered through the tokenizer's chat template
    system_prompt: str | None
    context_length: int | None  # prompt + completion tokens the engine holds; None: unknown
    pad_id: int
    stop_ids: list[int]  # token ids that end a completion
    episodes: EpisodeSetup | None  # multi-turn episodes (tools, environments); None: one turn
    # The latest sync check's gap (what check_sync measures); None: not checked yet / fp32 hf.
    last_sync_gap: float | None

    @classmethod
    @abc.abstractmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        tokenizer,
        section,  # the config's rollout section (rollout.config.RolloutConfig)
        model_path: str | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
        episodes: EpisodeSetup | None = None,
        precision: Precision = FP32,
    ) -> RolloutEngine:
        """An engine sampling from `model`'s current weights under the rollout `section`
        (`model_path`: a Hugging Face directory of the same architecture, for engines that
        load their own copy)."""

    @abc.abstractmethod
    def generate(self, prompts: list[str], num_generations: int, params: SamplingParams) -> Rollout:
        """G completions (or episodes) per prompt, grouped: rows [i*G, (i+1)*G) are prompt i's."""

    @abc.abstractmethod
    def sample_episodes(
        self, prompts: list[str], num_generations: int, params: SamplingParams, factory=None
    ) -> tuple[list[list[int]], list[Episode]]:
        """The engine's own record of G episodes per prompt: (prompt token ids, one Episode
        per sample). `factory`: an environment class instead of the configured one."""

    @abc.abstractmethod
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from `model`'s current weights, then check_sync."""

    @abc.abstractmethod
    def check_sync(self, model: torch.nn.Module) -> float:
        """How far the engine's weights are from `model`'s (WeightSyncError beyond its
        tolerance); NaN when the check is off. Sets last_sync_gap."""

    def close(self) -> None:  # noqa: B027 - engines without resources of their own keep it
        """Free what the engine holds (processes, caches); it cannot be used afterwards."""


# name -> "module:class" of each engine, imported when chosen (rollout.engine).
ENGINES = {"hf": "grpolab.rollout.hf:HFEngine", "vllm": "grpolab.rollout.vllm:VLLMEngine"}


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine class registered as `name` (ValueError naming the choices otherwise)."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine={name!r} is not one of {list(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)
