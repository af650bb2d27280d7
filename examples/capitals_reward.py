"""The reward of examples/smollm2-capitals.yaml: 1 for the capital given as the final answer
(after the last "answer is", or the whole completion), 0.2 for naming it anywhere else, 0
otherwise. The partial credit is what makes the task learnable on a small chat model: it
answers "The capital of Spain is Madrid." whatever it is asked, so the final-answer form is
rare in its samples (1 % at T=1), while the capital itself is in about 40 % of them."""

from __future__ import annotations

import re

ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*(.*)", re.IGNORECASE)


def final_answer(text: str) -> str:
    """What follows the last "answer is" / "answer:" on its line, else the whole text,
    without surrounding punctuation, quotes or markdown, case-folded."""
    found = ANSWER_IS.findall(text)
    answer = found[-1].splitlines()[0] if found and found[-1].strip() else text
    return answer.strip().strip(".,;:!?\"'*_` ").casefold()


def capital(completions, answer, **kwargs) -> list[float]:
    rewards = []
    for text, city in zip(completions, answer, strict=True):
        if final_answer(text) == city.casefold():
            rewards.append(1.0)
        elif re.search(rf"\b{re.escape(city)}\b", text, re.IGNORECASE):
            rewards.append(0.2)
        else:
            rewards.append(0.0)
    return rewards
