"""A conversational prompt: TRL's convention of a prompt given as a list of
{"role", "content"} messages (a system turn, few-shot turns, then the user's question).

A `Conversation` is a `str` — the messages' contents, a paragraph each — so everything that
reads a prompt as text (displays, the tokenizer-coverage check, the echo probe, the run's
files) reads it unchanged, while the rollout renders `.messages` through the chat template
and reward functions receive `.messages`, as TRL passes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")


class Conversation(str):
    messages: tuple[dict[str, str], ...]

    def __new__(cls, messages: Sequence[dict[str, Any]]) -> Conversation:
        turns = tuple(check_message(m, i) for i, m in enumerate(messages))
        if not turns:
            raise ValueError("a conversational prompt has no messages")
        self = super().__new__(cls, "\n\n".join(m["content"] for m in turns))
        self.messages = turns
        return self

    def __getnewargs__(self) -> tuple[list[dict[str, str]]]:
        return (list(self.messages),)

    def as_list(self) -> list[dict[str, str]]:
        """The messages as a fresh list of dicts (what a chat template or a reward reads)."""
        return [dict(m) for m in self.messages]


def check_message(message: Any, index: int) -> dict[str, str]:
    """{"role", "content"} with a known role and text content, or a one-line error."""
    if not isinstance(message, dict) or not {"role", "content"} <= set(message):
        raise ValueError(
            f"message {index} is {str(message)[:60]!r}: expected {{'role': ..., 'content': ...}}"
        )
    role, content = message["role"], message["content"]
    if role not in ROLES:
        raise ValueError(f"message {index} has role {role!r}: expected one of {list(ROLES)}")
    if not isinstance(content, str):
        raise ValueError(f"message {index}'s content is {type(content).__name__}, not text")
    return {"role": role, "content": content}


def is_conversation(value: Any) -> bool:
    """A list of messages, as a dataset row holds a conversational prompt."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)
