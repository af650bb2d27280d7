"""The tokenizer against the task: can the model read every prompt and write every answer?

A character the tokenizer has no token for becomes <unk>, or vanishes, without an error: the
model reads something else than the prompt, cannot write an answer that holds it, every reward
is flat, and the only symptom is a group without variance. `tokenizer.coverage` encodes every
prompt and reference answer of the task (and the system prompt) and decodes the tokens again:

    ok    no unknown-token id, and the text comes back (whitespace aside: a SentencePiece
          tokenizer may add or drop a leading space)
    else  the row fails, with the characters that did not come back

`round_trip` is also what `grpolab rollout` shows in place of a prompt the model cannot read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grpolab.tasks.base import Task

COVERAGE_ROWS = 20_000  # rows read per split: a sampled arithmetic task holds 100,000
SHOWN = 3  # rows named in a failure
SHOWN_CHARACTERS = 24


@dataclass(frozen=True)
class RoundTrip:
    text: str
    read: str  # decode(encode(text)): what the model reads
    unknown: int  # unknown-token ids among the text's tokens
    lost: str  # the characters of `text` that do not come back, once each, in order

    @property
    def ok(self) -> bool:
        return not self.unknown and _squashed(self.read) == _squashed(self.text)


def round_trip(tokenizer, texts: Sequence[str]) -> dict[str, RoundTrip]:
    """text -> its RoundTrip through `tokenizer` (encoded without special tokens, decoded
    keeping them, with no clean-up of spaces), each distinct text once."""
    unique = [t for t in dict.fromkeys(texts) if isinstance(t, str)]
    if not unique:
        return {}
    ids = tokenizer(unique, add_special_tokens=False)["input_ids"]
    read = tokenizer.batch_decode(
        ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    unk_id, unk = tokenizer.unk_token_id, tokenizer.unk_token
    out = {}
    for text, row_ids, back in zip(unique, ids, read, strict=True):
        # A text that spells the unknown token itself ("<unk>") is not an unknown character.
        unknown = 0 if unk_id is None else row_ids.count(unk_id) - (text.count(unk) if unk else 0)
        out[text] = RoundTrip(text, back, max(0, unknown), _lost(text, back, unk))
    return out


def _lost(text: str, read: str, unk: str | None) -> str:
    """The characters of `text` missing from `read`, whose "<unk>"s give back no letter."""
    if unk:
        read = read.replace(unk, "") if unk not in text else read
    missing = Counter("".join(text.split())) - Counter("".join(read.split()))
    return "".join(c for c in dict.fromkeys(text) if missing[c])


def prompt_texts(prompt: Any) -> list[str]:
    """The texts of a prompt: itself, or a conversation's message contents."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list):
        messages = [m for m in prompt if isinstance(m, dict)]
        return [m["content"] for m in messages if isinstance(m.get("content"), str)]
    return [str(prompt)]


def coverage_measurement(
    task: Task, tokenizer, system_prompt: str | None = None, limit: int = COVERAGE_ROWS
) -> tuple[str, int, str, bool]:
    """(what, measured, expected, passed) of tokenizer.coverage (grpolab.checks.rewards):
    every prompt and reference answer of `task` round-trips."""
    splits = (("train", task.train), ("eval", task.eval))
    rows = [
        (f"{split} row {i}", e)
        for split, examples in splits
        for i, e in enumerate(examples[:limit])
    ]
    fields = [(where, "prompt", t) for where, e in rows for t in prompt_texts(e.prompt)]
    fields += [(where, "answer", e.answer) for where, e in rows]
    if system_prompt:
        fields.append(("task.system_prompt", "system prompt", system_prompt))
    trips = round_trip(tokenizer, [text for _, _, text in fields])
    failed: dict[str, list[tuple[str, RoundTrip]]] = {}
    for where, field, text in fields:
        if not trips[text].ok:
            failed.setdefault(where, []).append((field, trips[text]))
    n_rows = len(rows) + bool(system_prompt)
    first = (
        f", the first {limit} of each split"
        if max(map(len, (task.train, task.eval))) > limit
        else ""
    )
    what = (
        "rows whose prompt or reference answer the tokenizer does not give back (encode, then "
        f"decode, no <unk>; {n_rows} rows{first})"
    )
    if failed:
        what = f"{what}; {_failure(failed)}"
    return what, len(failed), f"0 of {n_rows}", not failed


def _failure(failed: dict[str, list[tuple[str, RoundTrip]]]) -> str:
    """'it cannot write 41 characters: 'a', 'i', ... (1275 <unk> tokens); train row 0's prompt
    'What is...' is read as '<unk><unk>...' and its answer 'Paris' as '<unk>...'; then train
    row 1, train row 2 (and 37 more)'."""
    lost = Counter(c for trips in failed.values() for _, t in trips for c in t.lost)
    unknown = sum(t.unknown for trips in failed.values() for _, t in trips)
    chars = ", ".join(repr(c) for c, _ in lost.most_common(SHOWN_CHARACTERS))
    more = f" (and {len(lost) - SHOWN_CHARACTERS} more)" if len(lost) > SHOWN_CHARACTERS else ""
    parts = [f"it cannot write {_count(len(lost), 'character')}: {chars}{more}"]
    if not lost:  # every character is there, in another spacing or another order
        parts = ["it gives the texts back changed"]
    if unknown:
        parts[0] += f" ({_count(unknown, '<unk> token')})"
    where, trips = next(iter(failed.items()))
    read = " and ".join(
        f"{'its ' if i else ''}{field} {_short(t.text)} {'as' if i else 'is read as'} "
        f"{_short(t.read)}"
        for i, (field, t) in enumerate(trips)
    )
    parts.append(f"{where}'s {read}")
    others = list(failed)[1:]
    if others:
        tail = f" (and {len(others) - SHOWN + 1} more)" if len(others) > SHOWN - 1 else ""
        parts.append(f"then {', '.join(others[: SHOWN - 1])}{tail}")
    return "; ".join(parts)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _squashed(text: str) -> str:
    return " ".join(text.split())


def _short(text: str, width: int = 48) -> str:
    text = _squashed(text)
    return repr(text if len(text) <= width else text[: width - 3] + "...")
