"""load_policy's checks on what it loads: tokenizer against embedding, the pad token."""

import pytest

from grpolab.model.policy import build_char_tokenizer, build_tiny_model, load_policy, save_policy


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_load(tmp_path):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer)
    rows = model.get_input_embeddings().weight.shape[0]
    tokenizer.add_tokens(["<tool>", "</tool>"])  # ids rows, rows + 1: no embedding row
    save_policy(model, tokenizer, tmp_path)
    with pytest.raises(ValueError) as e:
        load_policy(tmp_path)
    message = str(e.value)
    assert "\n" not in message
    assert f"tokenizer has {rows + 2} tokens" in message and f"embedding has {rows} rows" in message


def test_a_padded_embedding_and_a_missing_pad_token_are_fine(tmp_path):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer)
    model.resize_token_embeddings(len(tokenizer) + 64)  # vocabularies padded to a multiple
    tokenizer.pad_token = None
    save_policy(model, tokenizer, tmp_path)
    loaded, loaded_tokenizer = load_policy(tmp_path)
    assert loaded.get_input_embeddings().weight.shape[0] == len(tokenizer) + 64
    assert loaded_tokenizer.pad_token == loaded_tokenizer.eos_token
