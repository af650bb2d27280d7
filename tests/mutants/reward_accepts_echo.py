"""Bug: an accuracy reward that evaluates the last expression of the completion.

math-verify parses "88 + 22 =" as 110, so a completion that restates the question scores as
a right answer: GRPO learns to restate the question (seen on a real instruct model). This is
grpolab's own math-mode accuracy as it was before it compared the final answer as written."""

from math_verify import parse, verify


def evaluated_accuracy(completions, answer, **_):
    out = []
    for completion, reference in zip(completions, answer, strict=True):
        # No SIGALRM timeouts: user rewards run in a worker thread.
        gold = parse(f"${reference}$", parsing_timeout=None)
        predicted = parse(completion, parsing_timeout=None)
        same = bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=None)
        out.append(float(same))
    return out
