"""Bug: the trained sequence is the conversation decoded to text and tokenised again, not
the tokens the engine sampled: special tokens vanish (skip_special_tokens) and a tokenizer
merges characters across turn boundaries, so the trainer scores tokens nobody sampled."""


def episode_tokens(prompt_ids, episode, tokenizer):
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    text = prompt + tokenizer.decode(episode.tokens, skip_special_tokens=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) :] or ids[-1:]
