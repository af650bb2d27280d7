"""Bug: the loss mask covers every token after the prompt, tool results included: the model
is trained to predict what the tool wrote."""


def episode_mask(episode, length):
    mask = [0.0] * length
    for turn in episode.turns:  # should keep only role == "assistant"
        mask[turn.start : turn.end] = [1.0] * (turn.end - turn.start)
    return mask
