"""Rollout: sample G completions per prompt from the current policy."""

from grpolab.rollout.base import Rollout, RolloutEngine, SamplingParams

__all__ = ["Rollout", "RolloutEngine", "SamplingParams"]
