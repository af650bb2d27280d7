"""A reward computed by an HTTP endpoint (a judge or a served reward model):

    rewards = [grpolab.rewards.remote("http://localhost:8000/score", timeout=10)]

Each call POSTs one JSON object, {"completions": [...], "prompts": [...], <column>: [...]}
(one value per completion, TRL's keyword arguments), and reads back either a list of numbers
(or nulls) or {"rewards": [...]}. A refused connection, an HTTP error, a timeout or a malformed
answer raises, so the caller's reward accounting counts it (reward_errors/<name>, the
fallback value, the stop after rewards.max_consecutive_reward_failures steps)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from typing import Any


def remote(url: str, timeout: float = 30.0, name: str | None = None) -> Callable[..., list]:
    """A reward function that asks `url`; `name` names it in metrics (default "remote")."""

    def remote_reward(completions: list[str], **columns: Any) -> list:
        body = json.dumps({"completions": completions, **_jsonable(columns)}).encode()
        request = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
        values = answer.get("rewards") if isinstance(answer, dict) else answer
        if not isinstance(values, list):
            raise ValueError(f"{url} answered {str(answer)[:80]!r}: expected a list of rewards")
        return values

    remote_reward.__name__ = remote_reward.__qualname__ = name or "remote"
    remote_reward.url = url  # what the run directory can name
    return remote_reward


def _jsonable(columns: dict[str, Any]) -> dict[str, Any]:
    """The columns JSON can carry (token ids and plain values); the rest are left out."""
    out = {}
    for key, values in columns.items():
        try:
            json.dumps(values)
        except (TypeError, ValueError):
            continue
        out[key] = values
    return out
