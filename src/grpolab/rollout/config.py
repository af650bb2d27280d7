"""The `rollout` config section: which engine samples, and how. What every engine reads is
here; what one engine alone reads is that engine's own section (`rollout.hf`, `rollout.vllm`),
declared beside it (grpolab.rollout.hf, grpolab.rollout.vllm) with its memory model."""

from __future__ import annotations

from dataclasses import dataclass, field

from grpolab.rollout.base import SamplingParams
from grpolab.rollout.engine import ENGINES
from grpolab.rollout.hf import HFEngineConfig
from grpolab.rollout.vllm import VLLMEngineConfig
from grpolab.schema import SchemaError, above, key


@dataclass(frozen=True)
class RolloutConfig:
    """The `rollout` config section."""

    engine: str = key("hf", choices=tuple(ENGINES))  # hf (the training model) | vllm
    # Training samples at temperature > 0 (0 is greedy: no spread within a group).
    temperature: float = key(1.0, **above(0))
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_completion_length: int = key(32, check=lambda v: v >= 1, expected="an integer >= 1")
    # After every weight sync the engine's weights are checked against the trainer's (vLLM: a
    # canary sequence's log-probs; hf under bf16: its bf16 copies against copies made afresh);
    # a larger max gap is an error. None: 1e-3 in float32, 0.1 in 16-bit; 0: off.
    sync_tolerance: float | None = key(
        None, check=lambda v: v is None or v >= 0, expected="a number >= 0 (0: off), or null",
        legacy="rollout.vllm_sync_tolerance",
    )  # fmt: skip
    # Multi-turn episodes. Tools: plain functions with type hints and a docstring, as
    # "package.module:function" or "path/file.py:function"; or an environment class
    # (reset / step / reward) for stateful episodes. Without either: single-turn.
    tools: list[str] = field(default_factory=list)
    environment: str | None = None
    # Assistant turns per episode (each at most max_completion_length).
    max_turns: int = key(4, check=lambda v: v >= 1, expected="an integer >= 1")
    # Every token after the prompt, assistant and tool turns together; None: max_turns x
    # max_completion_length x 2 (room for a tool turn as long as each assistant turn).
    max_episode_tokens: int | None = None
    # Seconds per tool call; past it the call is a tool error.
    tool_timeout: float = key(10.0, **above(0))
    # The engines' own sections.
    hf: HFEngineConfig = field(default_factory=HFEngineConfig)
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)

    @property
    def episodic(self) -> bool:
        return bool(self.tools) or bool(self.environment)

    @property
    def engine_section(self):
        """The configured engine's own section (its keys and its memory model)."""
        return getattr(self, self.engine)

    def rules(self) -> None:
        budget, mcl = self.max_episode_tokens, self.max_completion_length
        if budget is not None and budget < mcl:
            raise SchemaError(
                "max_episode_tokens",
                budget,
                f"an integer >= rollout.max_completion_length ({mcl}), or null",
            )

    def episode_budget(self) -> int:
        """Every token after the prompt an episode may hold (single-turn: one completion)."""
        if not self.episodic:
            return self.max_completion_length
        if self.max_episode_tokens is not None:
            return self.max_episode_tokens
        return self.max_turns * self.max_completion_length * 2

    def sampling(self, seed: int) -> SamplingParams:
        """The SamplingParams of one rollout call; pass a different seed each step."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_completion_length=self.max_completion_length,
            seed=seed,
            sampler=self.hf.sampler,
            max_turns=self.max_turns if self.episodic else 1,
            max_episode_tokens=self.episode_budget() if self.episodic else None,
        )
