"""Bug: the loss mask of assistant turn k is put on the span of the turn after it (an
off-by-one in the turn index): the model's own tokens after a tool turn go untrained and the
tool's tokens are trained on."""


def episode_mask(episode, length):
    mask = [0.0] * length
    turns = episode.turns
    for k, turn in enumerate(turns):
        if turn.role == "assistant":
            span = turns[k + 1] if k + 1 < len(turns) else turn  # should be `turn`
            mask[span.start : span.end] = [1.0] * (span.end - span.start)
    return mask
