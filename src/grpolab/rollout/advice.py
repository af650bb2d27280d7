"""What a sampled batch says about the settings: completions that are mostly empty, or rewards
that are all 0 from a chat model whose template the task does not apply, point at the setting
a newcomer is most likely missing. Said by `grpolab rollout` and the preflight, as warnings."""

from __future__ import annotations

from collections.abc import Sequence

import torch

EMPTY_SHARE = 0.5  # at least this share of empty completions is worth a warning


def sampling_advice(
    completions: Sequence[str],
    totals: torch.Tensor | None,
    has_chat_template: bool,
    chat_template_on: bool,
) -> list[str]:
    """Warnings about a scored batch ([B] completions' text, [B] total rewards or None):
    mostly empty completions, or every reward 0 while the tokenizer's chat template is not
    applied; each with the likely setting."""
    warnings = []
    template = (
        "the tokenizer has a chat template that the task does not apply: a chat model "
        "answers its own format (task.chat_template=true)"
        if has_chat_template and not chat_template_on
        else ""
    )
    empty = sum(not c.strip() for c in completions)
    if completions and empty >= EMPTY_SHARE * len(completions):
        because = template or (
            "the model ends them at once: word the prompt so that it asks for an answer "
            "(task.prompt_template)"
        )
        warnings.append(f"{empty} of {len(completions)} completions are empty; {because}")
    if totals is not None and totals.numel() and bool((totals == 0).all()) and template:
        warnings.append(f"every reward is 0; {template}")
    return warnings
