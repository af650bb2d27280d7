"""A Python API with TRL's names, over grpolab's own trainer:

    from grpolab import GRPOConfig, GRPOTrainer
    trainer = GRPOTrainer(model="demo", reward_funcs=my_reward, train_dataset=rows,
                          args=GRPOConfig(learning_rate=3e-4, num_generations=8, max_steps=20))
    summary = trainer.train()   # preflight, then grpolab.train.loop.train

GRPOConfig takes TRL's field names (TRL_KEYS maps each onto grpolab's config tree) and any
grpolab key by its dotted name (`GRPOConfig(**{"task.answer_kind": "string"})`); a name that is
neither is refused, named. Reward callables stay in this process: the config holds them, and
the run directory records each by its qualified name (config.to_dict). A dataset given as rows
(a list of dicts or a `datasets.Dataset`) is read by the `jsonl` task, from a JSON-lines copy
in a temporary directory (task.path names it). So is a model given as a loaded transformers
causal LM, or with its own `processing_class`: saved there (save_policy) and loaded back from
there, as a path would be; a `peft.LoraConfig` becomes grpolab's trainer.lora_* keys."""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.pytorch_utils import Conv1D

from grpolab.config import (
    Config,
    ConfigError,
    canonical,
    check_overrides,
    load_config,
    replaced,
)
from grpolab.model.policy import load_tokenizer, save_policy
from grpolab.rewards import RewardModel
from grpolab.train.loop import run_eval, train
from grpolab.train.preflight import preflight
from grpolab.train.setup import load_start_model, model_source
from grpolab.ways import from_python

# TRL's GRPOConfig field -> grpolab's dotted key, where the two mean the same thing. The one
# home of this mapping. Batch sizes are derived (`_batch_overrides`), not mapped one to one.
TRL_KEYS = {
    "output_dir": "output_dir",
    "max_steps": "max_steps",
    "seed": "seed",
    "learning_rate": "optim.learning_rate",
    "num_generations": "batch.num_generations",
    "generation_batch_size": "batch.generation_batch_size",
    "epsilon": "objective.epsilon",
    "epsilon_high": "objective.epsilon_high",
    "delta": "objective.delta",
    "beta": "objective.beta",
    "loss_type": "objective.loss_type",
    "num_iterations": "objective.num_iterations",
    "scale_rewards": "objective.scale_rewards",
    "importance_sampling_level": "objective.importance_sampling_level",
    "mask_truncated_completions": "objective.mask_truncated_completions",
    "use_bias_correction_kl": "objective.use_bias_correction_kl",
    "vllm_importance_sampling_cap": "objective.tis_cap",
    "gradient_accumulation_steps": "batch.gradient_accumulation_steps",
    "lr_scheduler_type": "schedule.lr_scheduler",
    "warmup_steps": "schedule.warmup_steps",
    "adam_beta1": "optim.adam_beta1",
    "adam_beta2": "optim.adam_beta2",
    "weight_decay": "optim.weight_decay",
    "max_grad_norm": "optim.max_grad_norm",
    "save_steps": "checkpoints.save_steps",
    "save_total_limit": "checkpoints.save_total_limit",
    "eval_steps": "eval.eval_steps",
    "report_to": "logging.report_to",
    "logging_steps": "logging.logging_steps",
    "gradient_checkpointing": "runtime.gradient_checkpointing",
    "max_completion_length": "rollout.max_completion_length",
    "temperature": "rollout.temperature",
    "reward_weights": "rewards.weights",
}
# TRL names whose meaning grpolab does not have; each says what to use instead.
TRL_UNSUPPORTED = {
    "num_train_epochs": "grpolab counts steps: set max_steps",
    "steps_per_generation": "one generation per optimizer round: set generation_batch_size",
    "top_p": "grpolab samples the full distribution (top-p would bias the ratio)",
    "top_k": "grpolab samples the full distribution (top-k would bias the ratio)",
    "max_prompt_length": "prompts are never cut; the preflight checks the context fits",
}
# TRL's scale_rewards also takes booleans (True: per group, False: none).
_SCALE_REWARDS = {True: "group", False: "none"}


class GRPOConfig:
    """TRL's GRPOConfig names (TRL_KEYS) and grpolab's dotted keys, as keyword arguments.

    per_device_train_batch_size (completions per micro-batch, TRL's) with
    gradient_accumulation_steps gives one optimizer step per batch of
    per_device_train_batch_size x gradient_accumulation_steps completions (TRL's default,
    steps_per_generation = gradient_accumulation_steps)."""

    def __init__(self, **values: Any):
        self.values = values
        # A bad name or value is refused here, where it was written; the checks between keys
        # (a file task's keys need task.name=jsonl) run when the trainer has the whole config.
        check_overrides(self.overrides())

    def overrides(self) -> list[str]:
        """The `key=value` overrides for grpolab's load_config."""
        given = dict(self.values)
        out = _batch_overrides(given)
        for name, value in given.items():
            if name in TRL_UNSUPPORTED:
                raise ConfigError(f"GRPOConfig({name}=...) is not supported: "
                                  f"{TRL_UNSUPPORTED[name]}")  # fmt: skip
            if name == "scale_rewards" and isinstance(value, bool):
                value = _SCALE_REWARDS[value]
            key = TRL_KEYS.get(name, name)
            if "." not in key and name not in TRL_KEYS:
                raise ConfigError(
                    f"GRPOConfig({name}=...): not a TRL name grpolab maps "
                    f"({', '.join(sorted(TRL_KEYS))}, per_device_train_batch_size) nor a "
                    f"grpolab key (section.key, e.g. trainer.{name})"
                )
            out.append(f"{key}={_text(value)}")
        return out


def _batch_overrides(given: dict[str, Any]) -> list[str]:
    """per_device_train_batch_size x gradient_accumulation_steps -> generation_batch_size
    (the completions of one step; TRL's default of one generation per optimizer step)."""
    per_device = given.pop("per_device_train_batch_size", None)
    if per_device is None:
        return []
    if "generation_batch_size" in given:
        raise ConfigError(
            "GRPOConfig: give per_device_train_batch_size or generation_batch_size, not both"
        )
    accumulation = given.get("gradient_accumulation_steps", 1)
    return [f"batch.generation_batch_size={int(per_device) * int(accumulation)}"]


def _text(value: Any) -> str:
    """A value as load_config's override parser reads it back (YAML for non-strings)."""
    if isinstance(value, str):
        return value
    if value is None:
        return "null"
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


RewardFuncs = str | Callable[..., Any] | Iterable[str | Callable[..., Any]]


class GRPOTrainer:
    """TRL's GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset,
    processing_class, peft_config) over grpolab.train.loop.train.

    `model`: a hub id, a local directory, a .gguf file, a packaged model's short name, "demo" /
    None for the built-in demo model, or a loaded transformers causal LM (the class
    AutoModelForCausalLM builds for its config). grpolab's trainer loads its policy from a
    path, so a model object is saved as it is now (save_policy: config, safetensors,
    tokenizer) into this trainer's temporary directory (kept while the trainer lives),
    model.name_or_path names that copy, and training loads it back in model.dtype (float32
    unless set); later changes to the object are not seen. A model with peft adapters is
    refused (merge_and_unload() it first).

    `processing_class`: the tokenizer to train with (a processor's `.tokenizer`). grpolab
    reads a model's tokenizer from the model's own directory, so the model is saved with it
    into the temporary directory: a model object directly; a named model is loaded first
    (on the CPU, in model.dtype). Without it, a model object's tokenizer is loaded from the
    object's name_or_path.

    `peft_config`: a peft.LoraConfig, as the lora section's r / alpha / dropout /
    target_modules. target_modules as peft reads it: a list or set of module names, a
    regex over the full module names, "all-linear" (every linear layer but the output head),
    or None (peft's default for the model type); the last three are resolved here against
    the model into module names. Any other LoraConfig field changed from peft's default is
    refused, named (grpolab does not honour it).

    `args`: a GRPOConfig, a dict of the same names, or a grpolab Config (which must then hold
    the model, data and LoRA keys itself). `reward_funcs`: a callable, a built-in name
    ("accuracy", "format", "overlong"), "module:function", or a list of them."""

    def __init__(
        self,
        model: str | PreTrainedModel | None = None,
        reward_funcs: RewardFuncs | None = None,
        args: GRPOConfig | Config | dict[str, Any] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
    ):
        named = model is None or isinstance(model, str | Path)
        if isinstance(args, Config):
            given = {
                "model": model is not None and (not named or str(model) != "demo"),
                "train_dataset": train_dataset is not None,
                "eval_dataset": eval_dataset is not None,
                "processing_class": processing_class is not None,
                "peft_config": peft_config is not None,
            }
            if any(given.values()):
                raise ConfigError(
                    f"with a grpolab Config as args, {', '.join(k for k, v in given.items() if v)}"
                    " cannot be applied: set the model, data and LoRA keys in the Config, or "
                    "pass args as a GRPOConfig"
                )
        tokenizer = None if processing_class is None else _tokenizer(processing_class)
        lora_keys = _lora_settings(peft_config)  # before any model is saved: fail fast
        if not named:
            _check_causal_lm(model)
        self._scratch = tempfile.TemporaryDirectory(prefix="grpolab-data-")
        overrides = []
        if not named:
            source = "processing_class" if tokenizer else f"model {model.name_or_path!r}"
            tokenizer = tokenizer or _own_tokenizer(model)
            overrides.append(f"model.name_or_path={self._save_model(model, tokenizer, source)}")
        elif model is not None and str(model) != "demo":
            overrides.append(f"model.name_or_path={model}")
        if train_dataset is not None:
            overrides += ["task.name=jsonl", f"task.path={self._rows_file(train_dataset, 'train')}"]
        if eval_dataset is not None:
            overrides.append(f"task.eval_path={self._rows_file(eval_dataset, 'eval')}")
        elif train_dataset is not None and not _asks_hold_out(args):
            overrides.append("task.num_eval=0")  # TRL's meaning: train_dataset is all training
        lora = peft_config is not None
        self.config = _config(args, overrides, lora=lora)
        more = []
        if named and tokenizer is not None:
            # The named model, saved again next to the given tokenizer, which setup then loads.
            policy, _ = load_start_model(self.config, torch.device("cpu"))
            path = self._save_model(policy, tokenizer, "processing_class")
            more.append(f"model.name_or_path={path}")
            del policy
        if lora_keys is not None:
            config = self.config  # the model as named (a GGUF file's source included)
            modules = (lambda: model) if not named else (lambda: _skeleton(config))
            lora_keys["lora.target_modules"] = _lora_targets(peft_config.target_modules, modules)
            more += [f"{k}={_text(v)}" for k, v in lora_keys.items()]
        if more:
            self.config = _config(args, [*overrides, *more], lora=lora)
        objects = {}  # what no override can carry: set on the loaded config, kept frozen
        if tokenizer is not None:
            objects["model.gguf_file"] = None  # the saved copy is a plain directory
        if reward_funcs is not None:
            objects["rewards.functions"] = _reward_list(reward_funcs)
        self.config = replaced(self.config, objects)

    def _save_model(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, source: str
    ) -> str:
        """`model` and `tokenizer` in this trainer's temporary directory, where setup's
        load_policy reads both; the vocabulary (`source` names whose) must fit the model."""
        rows = model.get_input_embeddings().weight.shape[0]
        if len(tokenizer) > rows:
            raise ConfigError(
                f"{source}: the tokenizer has {len(tokenizer)} tokens but the model's "
                f"embedding has {rows} rows (ids >= {rows} would fail); pass processing_class="
                "the model's own tokenizer"
            )
        path = Path(self._scratch.name) / "model"
        save_policy(model, tokenizer, path)
        return str(path)

    def _rows_file(self, dataset: Any, split: str) -> str:
        """The dataset's rows as JSON lines in this trainer's temporary directory."""
        rows = dataset.to_list() if hasattr(dataset, "to_list") else list(dataset)
        path = Path(self._scratch.name) / f"{split}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for i, row in enumerate(rows):
                if not isinstance(row, dict):
                    raise ConfigError(f"{split}_dataset row {i}: a dict is expected, "
                                      f"got {type(row).__name__}")  # fmt: skip
                f.write(json.dumps(row) + "\n")
        return str(path)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """The preflight, then training (grpolab.train.loop.train's keywords: resume=,
        overwrite=, skip_preflight=, ...; TRL's resume_from_checkpoint= is resume=); returns
        the run's summary."""
        if resume_from_checkpoint is not None:
            kwargs.setdefault("resume", resume_from_checkpoint)
        with from_python():
            return train(self.config, **kwargs)

    def preflight(self, **kwargs: Any):
        """The preflight checks alone, on this model, task and rewards."""
        with from_python():
            return preflight(self.config, **kwargs)

    def evaluate(self, **kwargs: Any) -> dict[str, float]:
        """Greedy accuracy of the configured model on the held-out set."""
        with from_python():
            return run_eval(self.config, **kwargs)


def _asks_hold_out(args: GRPOConfig | Config | dict[str, Any] | None) -> bool:
    """Whether the user's own keys choose a hold-out from train_dataset."""
    if isinstance(args, dict):
        args = GRPOConfig(**args)
    if not isinstance(args, GRPOConfig):
        return False
    given = {canonical(o.split("=", 1)[0]) for o in args.overrides()}
    return bool(given & {"task.num_eval", "task.eval_fraction"})


def _config(
    args: GRPOConfig | Config | dict[str, Any] | None, overrides: list[str], lora: bool = False
) -> Config:
    if isinstance(args, Config):
        return args  # GRPOTrainer refused every argument that would change it
    if isinstance(args, dict):
        args = GRPOConfig(**args)
    given = args.overrides() if args else []
    if lora:
        names = [o.split("=", 1)[0] for o in given]
        both = [n for n in names if canonical(n).startswith("lora.")]
        if both:
            raise ConfigError(
                f"peft_config and GRPOConfig({', '.join(both)}) both set LoRA: give one of them"
            )
    return load_config(overrides=[*given, *overrides])


# --- Model objects and tokenizers -------------------------------------------------------------


def _tokenizer(processing_class: Any) -> PreTrainedTokenizerBase:
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
    """A model object grpolab can save and load back unchanged: the class
    AutoModelForCausalLM builds for its config, without adapters or quantisation."""
    if _has_adapters(model):
        raise ConfigError(
            f"model: {type(model).__name__} carries peft adapters, which grpolab does not load; "
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


def _skeleton(cfg: Config) -> torch.nn.Module:
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


def _lora_settings(peft_config: Any) -> dict[str, Any] | None:
    """lora.r, lora.alpha and lora.dropout of a LoraConfig (target_modules, which may
    need the model, follow in `_lora_targets`); None without one."""
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


def _lora_targets(targets: Any, skeleton: Callable[[], torch.nn.Module]) -> list[str]:
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


def _reward_list(reward_funcs: RewardFuncs) -> list:
    """The rewards as rewards.functions holds them; a loaded reward model becomes a
    RewardModel here, once (the config records it by its name_or_path)."""
    if isinstance(reward_funcs, str) or callable(reward_funcs):
        reward_funcs = [reward_funcs]
    return [RewardModel(f) if isinstance(f, torch.nn.Module) else f for f in reward_funcs]
