"""Policies: tiny real transformers models built offline, and loading of real checkpoints.

Tests and the CPU demo cannot download anything, so they build a real Qwen2/Llama model
from a config and a character-level tokenizer made here. Real checkpoints (a local
directory or a hub id) go through `load_policy`, the same `from_pretrained` path.
"""

from __future__ import annotations

import contextlib
import json
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Printable ASCII plus newline: enough for arithmetic, GSM8K-style text and chat markup.
DEFAULT_CHARS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_char_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one id per character, ids 0-2 are pad/eos/unk."""
    unique = list(dict.fromkeys(chars))
    vocab = {PAD: 0, EOS: 1, UNK: 2} | {c: i + 3 for i, c in enumerate(unique)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",  # generation appends on the right
    )


@dataclass
class TinyModelSpec:
    """Shape of a tiny decoder. head_dim = hidden_size / num_heads must be >= 32 (vLLM CPU)."""

    # Llama by default: transformers 5 forces its own byte-level tokenizer class on every
    # "qwen2" checkpoint loaded through AutoTokenizer (vLLM included), which would not
    # read a character-level vocabulary; "qwen2" works through `load_policy`.
    arch: str = "llama"  # "llama" | "qwen2"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase, spec: TinyModelSpec | None = None, seed: int = 0
) -> PreTrainedModel:
    """A randomly initialised causal LM of the given shape, in float32, in eval mode."""
    spec = spec or TinyModelSpec()
    if spec.hidden_size % spec.num_heads:
        raise ValueError(
            f"hidden_size={spec.hidden_size} is not divisible by num_heads={spec.num_heads}"
        )
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads or spec.num_heads,
        intermediate_size=spec.intermediate_size or 4 * spec.hidden_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    builders = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }
    if spec.arch not in builders:
        raise ValueError(f"arch={spec.arch!r} is not one of {sorted(builders)}")
    config_cls, model_cls = builders[spec.arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**common))
    return model.float().eval()


def save_policy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path):
    """Hugging Face layout (config, safetensors, tokenizer): loadable by transformers and vLLM."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """AutoTokenizer, except that a tokenizer saved as a generic fast tokenizer is loaded as
    one: transformers 5 would otherwise swap in the model type's own class for some types."""
    config_file = Path(source) / "tokenizer_config.json"
    if config_file.is_file():
        declared = json.loads(config_file.read_text()).get("tokenizer_class")
        if declared in GENERIC_TOKENIZER_CLASSES:
            return PreTrainedTokenizerFast.from_pretrained(source)
    return AutoTokenizer.from_pretrained(source)


def load_policy(
    name_or_path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local directory or a hub id."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    local = Path(name_or_path).expanduser()
    looks_local = str(name_or_path).startswith((".", "/", "~")) or local.exists()
    if looks_local and not (local / "config.json").is_file():
        raise FileNotFoundError(
            f"model path {str(name_or_path)!r}: no config.json there "
            "(expected a Hugging Face model directory or a hub id like 'Qwen/Qwen2.5-0.5B')"
        )
    source = str(local) if looks_local else str(name_or_path)
    tokenizer = load_tokenizer(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype]).to(device)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model itself: inside a peft wrapper, its base model; else `model`."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def plain_kv_cache(cache) -> bool:
    """A cache whose every layer is a plain concatenation of keys and values over positions,
    so rows can be selected or repeated freely (not sliding-window, hybrid or quantised)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return type(cache) is DynamicCache and all(type(x) is DynamicLayer for x in cache.layers)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module, zero_grad: bool = False) -> Iterator[torch.nn.Module]:
    """`model` in eval mode (dropout off) inside the block; its own mode back afterwards,
    whatever happens, and with `zero_grad` no gradient left behind."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        if zero_grad:
            model.zero_grad(set_to_none=True)
        model.train(was_training)
