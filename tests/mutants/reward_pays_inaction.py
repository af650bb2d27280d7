"""Bug: a reward that pays inaction (TRL PR #6427).

Right answers get 1 and wrong ones a penalty of -1, but a completion that gives no answer at
all falls through to the default 0: more than any wrong attempt. Under GRPO a group of wrong
answers with one empty completion gives the empty one the only positive advantage, and the
model learns to stop answering."""

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def answer_or_penalty(completions, answer, **_):
    out = []
    for completion, reference in zip(completions, answer, strict=True):
        numbers = _NUMBER.findall(completion)
        if not numbers:
            out.append(0.0)  # nothing to judge: the default
        else:
            out.append(1.0 if float(numbers[-1]) == float(reference) else -1.0)
    return out
