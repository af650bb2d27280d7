"""Rollout: sample G completions per prompt from the current policy."""

from __future__ import annotations

import torch

from grpolab.model.precision import FP32, Precision
from grpolab.rollout.base import Rollout, SamplingParams, Turn
from grpolab.rollout.common import SAMPLERS
from grpolab.rollout.config import RolloutConfig
from grpolab.rollout.engine import ENGINES, RolloutEngine, engine_class
from grpolab.rollout.episodes import EpisodeFunctions, EpisodeSetup
from grpolab.rollout.tools import environment_factory, load_tools


def build_engine(
    cfg: RolloutConfig,
    model: torch.nn.Module,
    tokenizer,
    chat_template: bool = False,
    system_prompt: str | None = None,
    model_path: str | None = None,
    precision: Precision = FP32,
) -> RolloutEngine:
    """The engine `cfg.engine` names (ENGINES). "hf" samples with `model` itself; "vllm"
    starts an engine from `model_path` (a Hugging Face directory; the trainer's model is
    saved to one when None) and is kept in sync through `engine.sync_weights(model)`.
    `precision`: what both engines sample in (hf: bf16 copies of the weights under autocast;
    vLLM: its weights in bfloat16)."""
    return engine_class(cfg.engine).from_model(
        model,
        tokenizer,
        cfg,
        model_path=model_path,
        chat_template=chat_template,
        system_prompt=system_prompt,
        episodes=episode_setup(cfg, tokenizer, chat_template),
        precision=precision,
    )


def episode_setup(cfg: RolloutConfig, tokenizer, chat_template: bool) -> EpisodeSetup | None:
    """Multi-turn episodes of `rollout.tools` / `rollout.environment`, or None (single-turn)."""
    if not cfg.episodic:
        return None
    factory = environment_factory(cfg.tools, cfg.environment, cfg.tool_timeout)
    tools = load_tools(cfg.tools) if cfg.tools and not cfg.environment else []
    return EpisodeSetup(
        factory,
        tokenizer,
        chat_template,
        tools,
        max_turns=cfg.max_turns,
        max_tokens=max(cfg.episode_budget(), cfg.max_completion_length),
    )


__all__ = [
    "ENGINES",
    "SAMPLERS",
    "EpisodeFunctions",
    "EpisodeSetup",
    "Rollout",
    "RolloutConfig",
    "RolloutEngine",
    "SamplingParams",
    "Turn",
    "build_engine",
    "engine_class",
    "episode_setup",
]
