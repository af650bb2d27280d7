"""What every rollout engine returns (`Rollout`, its `Turn`s) and is asked (`SamplingParams`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_completion_length: int = 32
    seed: int = 0
    sampler: str = "multinomial"  # hf engine: how a token is drawn (common.SAMPLERS)
    # Multi-turn episodes: assistant turns per episode, and every token after the prompt
    # (assistant and tool turns); max_completion_length is then per assistant turn.
    # None: the engine's own (rollout.max_turns, rollout.max_episode_tokens).
    max_turns: int | None = None
    max_episode_tokens: int | None = None


@dataclass
class Turn:
    """One turn of a multi-turn episode: tokens [start, end) counted from the completion's
    first column (P), and their text."""

    role: str  # "assistant" (sampled, trained) | "tool" (context, zero gradient)
    start: int
    end: int
    text: str  # assistant: the decoded turn; tool: the tool's result as returned
    name: str | None = None  # tool turns: the tool called
    error: bool = False  # tool turns: the call failed (raised, timed out, non-text, unknown)

    @property
    def trained(self) -> bool:
        return self.role == "assistant"


@dataclass
class Rollout:
    """G samples per prompt, the G samples of a prompt contiguous (sample i is in group i // G).

    Rows are prompt + completion: the prompt left-padded to a common length P, the completion
    starting at column P and right-padded after its EOS.
    """

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] 1 on real tokens (prompt and completion)
    completion_mask: torch.Tensor  # [B, T] 1 on completion tokens, EOS included; 0 elsewhere
    group_ids: torch.Tensor  # [B] long, index of the prompt each sample answers
    prompts: list[str]  # [B] the prompt text of each sample (as given, before templating)
    completions: list[str]  # [B] decoded completion text, special tokens removed
    truncated: torch.Tensor  # [B] bool: hit max_completion_length without EOS
    prompt_length: int  # P: the column where completions start
    # The engine's own log-probs of the sampled tokens, aligned like sequence_logprobs:
    # [B, T-1], entry t is the log-prob of input_ids[:, t+1]; 0 where completion_mask[:, 1:] is 0.
    engine_logprobs: torch.Tensor | None = None
    # Multi-turn episodes (rollout.tools / rollout.environment): each sample's turns, and
    # the environment's reward at the end (None where it gives none). None: single-turn.
    turns: list[list[Turn]] | None = None
    episode_rewards: list[float | None] | None = None

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, rows: slice) -> Rollout:
        """The rows `rows` (whole groups), every per-sample field cut alike."""
        return dataclasses.replace(
            self,
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            completion_mask=self.completion_mask[rows],
            group_ids=self.group_ids[rows] - self.group_ids[rows][0],
            prompts=self.prompts[rows],
            completions=self.completions[rows],
            truncated=self.truncated[rows],
            engine_logprobs=None if self.engine_logprobs is None else self.engine_logprobs[rows],
            turns=None if self.turns is None else self.turns[rows],
            episode_rewards=None if self.episode_rewards is None else self.episode_rewards[rows],
        )
