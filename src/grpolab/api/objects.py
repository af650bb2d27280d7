"""The objects a TRL script passes, as load_config's values: a loaded causal LM and its
tokenizer (GivenModel), rows (GivenRows), reward callables and reward models, peft's
LoraConfig (the lora section); what grpolab cannot honour is refused, named."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.pytorch_utils import Conv1D

from grpolab.config import Config, ConfigError
from grpolab.model.policy import GivenModel, load_tokenizer
from grpolab.rewards import RewardModel
from grpolab.tasks import GivenRows
from grpolab.train.setup import model_source

RewardFuncs = str | Callable[..., Any] | Iterable[str | Callable[..., Any]]


def given_rows(dataset: Any, label: str) -> GivenRows:
    """A dataset's rows (a list of dicts, a `datasets.Dataset` or any iterable of dicts) as
    the task reads them; `label`: the argument that gave them, which errors name."""
    if isinstance(dataset, dict) and not hasattr(dataset, "to_list"):
        raise ConfigError(
            f"{label}: a dict of datasets (several evaluation sets) is not supported; give one "
            "dataset (a list of dicts or a datasets.Dataset)"
        )
    if isinstance(dataset, str):
        raise ConfigError(f"{label}: rows are expected (a list of dicts or a datasets.Dataset), "
                          f"got the text {dataset[:40]!r}")  # fmt: skip
    rows = dataset.to_list() if hasattr(dataset, "to_list") else list(dataset)
    return GivenRows(rows, label)


def given_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None):
    """A loaded causal LM as model.name_or_path holds it: with `tokenizer` (the
    processing_class given), else the one it was loaded with; its vocabulary must fit the
    model's embedding."""
    _check_causal_lm(model)
    source = "processing_class" if tokenizer is not None else f"model {model.name_or_path!r}"
    tokenizer = tokenizer or _own_tokenizer(model)
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise ConfigError(
            f"{source}: the tokenizer has {len(tokenizer)} tokens but the model's embedding "
            f"has {rows} rows (ids >= {rows} would fail); pass processing_class=the model's "
            "own tokenizer"
        )
    return GivenModel(model, tokenizer)


# --- Model objects and tokenizers -------------------------------------------------------------


def tokenizer_of(processing_class: Any) -> PreTrainedTokenizerBase:
    """The tokenizer of a processing_class: itself, or a processor's `.tokenizer`."""
    tokenizer = processing_class
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        tokenizer = getattr(processing_class, "tokenizer", None)
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise ConfigError(
            "processing_class: a transformers tokenizer (or a processor with a .tokenizer) is "
            f"expected, got {type(processing_class).__name__}"
        )
    return tokenizer


def _check_causal_lm(model: Any) -> None:
    """A model object grpolab trains as it is: the class AutoModelForCausalLM builds for its
    config, without adapters or quantisation."""
    if _has_adapters(model):
        raise ConfigError(
            f"model: {type(model).__name__} carries peft adapters, which grpolab does not train; "
            "pass model.merge_and_unload() (and peft_config=LoraConfig(...) for new adapters)"
        )
    if not isinstance(model, PreTrainedModel):
        raise ConfigError(
            "model: a name, a path or a transformers causal LM (AutoModelForCausalLM."
            f"from_pretrained(...)) is expected, got {type(model).__name__}"
        )
    expected = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(model.config), None)
    if type(model) is not expected:
        hint = (
            f"{expected.__name__} for this config"
            if expected
            else f"none exists for model type {model.config.model_type!r}"
        )
        raise ConfigError(
            f"model: {type(model).__name__} is not a causal LM; grpolab trains the class "
            f"AutoModelForCausalLM builds ({hint})"
        )
    if getattr(model, "hf_quantizer", None) or getattr(model.config, "quantization_config", None):
        raise ConfigError(
            f"model: {type(model).__name__} is quantised; grpolab trains unquantised weights "
            "(load it without quantization_config)"
        )


def _has_adapters(model: Any) -> bool:
    try:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    if isinstance(model, PeftModel):
        return True
    return isinstance(model, torch.nn.Module) and any(
        isinstance(m, BaseTunerLayer) for m in model.modules()
    )


def _own_tokenizer(model: PreTrainedModel) -> PreTrainedTokenizerBase:
    """A model object's tokenizer, from where the model came from (its name_or_path)."""
    source = model.name_or_path
    try:
        if not source:
            raise OSError("the model has no name_or_path")
        return load_tokenizer(source)
    except Exception as e:  # whatever from_pretrained raises: one line
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"model: no tokenizer could be loaded from its name_or_path {source!r} ({reason}); "
            "pass processing_class=<its tokenizer>"
        ) from None


def skeleton(cfg: Config) -> torch.nn.Module:
    """The configured model's modules, built from its config on the meta device (no
    weights): what LoRA's target_modules are matched against."""
    source = model_source(cfg)
    try:
        config = AutoConfig.from_pretrained(source)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as e:  # whatever from_pretrained raises: one line
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"peft_config.target_modules: the model's modules could not be read from "
            f"{source!r} ({reason}); give target_modules as a list of module names"
        ) from None


# --- peft's LoraConfig ------------------------------------------------------------------------

# LoraConfig fields grpolab honours (trainer.lora_*), and those that only describe the
# config (where it was saved from, peft's version) and change nothing in training.
LORA_HONOURED = ("r", "lora_alpha", "lora_dropout", "target_modules", "task_type")
LORA_DESCRIPTIVE = ("peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
                    "revision")  # fmt: skip


def lora_settings(peft_config: Any) -> dict[str, Any] | None:
    """lora.r, lora.alpha and lora.dropout of a LoraConfig (target_modules, which may
    need the model, follow in `lora_targets`); None without one."""
    if peft_config is None:
        return None
    try:
        from peft import LoraConfig
    except ImportError:
        raise ConfigError("peft_config needs peft: pip install 'grpolab[lora]'") from None
    if not isinstance(peft_config, LoraConfig):
        raise ConfigError(
            f"peft_config: a peft.LoraConfig is expected, got {type(peft_config).__name__} "
            "(grpolab trains LoRA adapters only)"
        )
    default = LoraConfig()
    changed = [
        f"{f.name}={_short(getattr(peft_config, f.name))}"
        for f in dataclasses.fields(peft_config)
        if f.name not in LORA_HONOURED + LORA_DESCRIPTIVE
        and getattr(peft_config, f.name) != getattr(default, f.name, None)
    ]
    if changed:
        raise ConfigError(
            f"peft_config: {', '.join(changed)} is not supported (grpolab's LoRA honours r, "
            "lora_alpha, lora_dropout and target_modules; leave the rest at peft's defaults)"
        )
    if peft_config.task_type not in (None, "CAUSAL_LM"):
        raise ConfigError(
            f"peft_config: task_type={_short(peft_config.task_type)}; grpolab trains a causal "
            "LM (task_type='CAUSAL_LM' or None)"
        )
    alpha = peft_config.lora_alpha
    return {
        "lora.r": peft_config.r,
        "lora.alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora.dropout": float(peft_config.lora_dropout),
    }


def lora_targets(targets: Any, skeleton: Callable[[], torch.nn.Module]) -> list[str]:
    """LoraConfig.target_modules as the module names lora.target_modules lists (peft
    matches each name against a module's full name or its last dotted parts)."""
    where = f"peft_config.target_modules={_short(targets)}"
    if isinstance(targets, list | tuple | set | frozenset):
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError(f"{where}: module names (strings) are expected")
        return sorted(targets) if isinstance(targets, set | frozenset) else list(targets)
    if targets is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

        model_type = skeleton().config.model_type
        if model_type not in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING:
            raise ConfigError(
                f"{where}: peft has no default target modules for model type {model_type!r}; "
                "give them as a list of module names"
            )
        return list(TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[model_type])
    if not isinstance(targets, str):
        raise ConfigError(
            f"{where}: a list of module names, a regex, 'all-linear' or None is expected"
        )
    model = skeleton()
    names = [n for n, _ in model.named_modules() if n]
    if targets.lower() == "all-linear":
        # peft's meaning: every nn.Linear / Conv1D but the output head.
        head = model.get_output_embeddings()
        chosen = [n for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear | Conv1D) and m is not head]  # fmt: skip
    else:
        try:
            chosen = [n for n in names if re.fullmatch(targets, n)]
        except re.error as e:
            raise ConfigError(f"{where}: not a valid regex ({e})") from None
    if not chosen:
        raise ConfigError(f"{where}: matches no module of the model")
    # The last dotted parts when they pick out the same modules (readable), else full names.
    short = sorted({n.rsplit(".", 1)[-1] for n in chosen})
    picked = {n for n in names if any(n == s or n.endswith(f".{s}") for s in short)}
    return short if picked == set(chosen) else chosen


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reward_list(reward_funcs: RewardFuncs, processing_classes: Any = None) -> list:
    """The rewards as rewards.functions holds them; a loaded reward model becomes a
    RewardModel here, once (the config records it by its name_or_path), with its tokenizer
    from reward_processing_classes (TRL's: one per reward, None where a function needs none
    or the model's own tokenizer is meant)."""
    if isinstance(reward_funcs, str) or callable(reward_funcs):
        reward_funcs = [reward_funcs]
    reward_funcs = list(reward_funcs)
    tokenizers = _reward_tokenizers(processing_classes, len(reward_funcs))
    out = []
    for i, (f, tokenizer) in enumerate(zip(reward_funcs, tokenizers, strict=True)):
        if tokenizer is not None and not isinstance(f, torch.nn.Module | str):
            raise ConfigError(
                f"reward_processing_classes[{i}]: reward_funcs[{i}] is a function, which reads "
                "text; a tokenizer goes with a reward model only (give None there)"
            )
        if isinstance(f, torch.nn.Module):
            f = RewardModel(f, tokenizer=tokenizer)
        elif isinstance(f, str) and tokenizer is not None:
            f = RewardModel(f, tokenizer=tokenizer)  # a reward model's directory or hub id
        out.append(f)
    return out


def _reward_tokenizers(processing_classes: Any, n: int) -> list:
    if processing_classes is None:
        return [None] * n
    given = processing_classes if isinstance(processing_classes, list | tuple) else [
        processing_classes]  # fmt: skip
    if len(given) != n:
        raise ConfigError(
            f"reward_processing_classes: {len(given)} given for {n} reward_funcs (one per "
            "reward, None where none is needed)"
        )
    return [None if p is None else tokenizer_of(p) for p in given]
