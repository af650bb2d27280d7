"""The reward of examples/smollm2-capitals.yaml: 1 for the capital given as the final answer
(after the last "answer is", or the whole completion), 0.1 for a final answer in that form
that is another city, 0 otherwise. The small credit for the form is what makes the task
learnable on a small chat model: it answers "The capital of Spain is Madrid." whatever it is
asked, which the strict judge reads as no answer, and a credit for naming the capital in such
a sentence teaches exactly that sentence (tried: held-out 10.7% -> 0% in 30 steps)."""

from __future__ import annotations

import re

ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*(.*)", re.IGNORECASE)


def final_answer(text: str) -> str | None:
    """What follows the last "answer is" / "answer:" on its line, without surrounding
    punctuation, quotes or markdown, case-folded; None when there is no such phrase."""
    found = ANSWER_IS.findall(text)
    if not found or not found[-1].strip():
        return None
    return found[-1].splitlines()[0].strip().strip(".,;:!?\"'*_` ").casefold()


def capital(completions, answer, **kwargs) -> list[float]:
    rewards = []
    for text, city in zip(completions, answer, strict=True):
        final = final_answer(text)
        if final is None:
            final = text.strip().strip(".,;:!?\"'*_` ").casefold()
            rewards.append(1.0 if final == city.casefold() else 0.0)
        else:
            rewards.append(1.0 if final == city.casefold() else 0.1)
    return rewards
