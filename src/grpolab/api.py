"""A Python API with TRL's names, over grpolab's own trainer:

    from grpolab import GRPOConfig, GRPOTrainer
    trainer = GRPOTrainer(model="demo", reward_funcs=my_reward, train_dataset=rows,
                          args=GRPOConfig(learning_rate=3e-4, num_generations=8, max_steps=20))
    summary = trainer.train()   # preflight, then grpolab.trainer.train

GRPOConfig takes TRL's field names (TRL_KEYS maps each onto grpolab's config tree) and any
grpolab key by its dotted name (`GRPOConfig(**{"task.answer_kind": "string"})`); a name that is
neither is refused, named. Reward callables stay in this process: the config holds them, and
the run directory records each by its qualified name (config.to_dict). A dataset given as rows
(a list of dicts or a `datasets.Dataset`) is read by the `jsonl` task, from a JSON-lines copy
in a temporary directory (task.path names it)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from grpolab.config import Config, ConfigError, check_overrides, load_config
from grpolab.preflight import preflight
from grpolab.trainer import run_eval, train

# TRL's GRPOConfig field -> grpolab's dotted key, where the two mean the same thing. The one
# home of this mapping. Batch sizes are derived (`_batch_overrides`), not mapped one to one.
TRL_KEYS = {
    "output_dir": "output_dir",
    "max_steps": "max_steps",
    "seed": "seed",
    "learning_rate": "trainer.learning_rate",
    "num_generations": "trainer.num_generations",
    "generation_batch_size": "trainer.generation_batch_size",
    "epsilon": "trainer.epsilon",
    "epsilon_high": "trainer.epsilon_high",
    "delta": "trainer.delta",
    "beta": "trainer.beta",
    "loss_type": "trainer.loss_type",
    "num_iterations": "trainer.num_iterations",
    "scale_rewards": "trainer.scale_rewards",
    "importance_sampling_level": "trainer.importance_sampling_level",
    "mask_truncated_completions": "trainer.mask_truncated_completions",
    "use_bias_correction_kl": "trainer.use_bias_correction_kl",
    "vllm_importance_sampling_cap": "trainer.tis_cap",
    "gradient_accumulation_steps": "trainer.gradient_accumulation_steps",
    "lr_scheduler_type": "trainer.lr_scheduler",
    "warmup_steps": "trainer.warmup_steps",
    "adam_beta1": "trainer.adam_beta1",
    "adam_beta2": "trainer.adam_beta2",
    "weight_decay": "trainer.weight_decay",
    "max_grad_norm": "trainer.max_grad_norm",
    "save_steps": "trainer.save_steps",
    "save_total_limit": "trainer.save_total_limit",
    "eval_steps": "trainer.eval_steps",
    "report_to": "trainer.report_to",
    "gradient_checkpointing": "trainer.gradient_checkpointing",
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
    return [f"trainer.generation_batch_size={int(per_device) * int(accumulation)}"]


def _text(value: Any) -> str:
    """A value as load_config's override parser reads it back (YAML for non-strings)."""
    if isinstance(value, str):
        return value
    if value is None:
        return "null"
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


RewardFuncs = str | Callable[..., Any] | Iterable[str | Callable[..., Any]]


class GRPOTrainer:
    """TRL's GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset) over
    grpolab.trainer.train. `model`: a hub id, a local directory, a .gguf file, a packaged
    model's short name, or "demo" / None for the built-in demo model. `args`: a GRPOConfig, a
    dict of the same names, or a grpolab Config. `reward_funcs`: a callable, a built-in name
    ("accuracy", "format", "overlong"), "module:function", or a list of them."""

    def __init__(
        self,
        model: str | None = None,
        reward_funcs: RewardFuncs | None = None,
        args: GRPOConfig | Config | dict[str, Any] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
    ):
        if processing_class is not None:
            raise ConfigError("processing_class: grpolab loads the model's own tokenizer")
        if peft_config is not None:
            raise ConfigError("peft_config: set GRPOConfig(**{'trainer.lora_r': 16, ...})")
        if model is not None and not isinstance(model, str | Path):
            raise ConfigError(
                f"model: a name or path is expected, got {type(model).__name__} (save it "
                "with save_pretrained and pass the directory)"
            )
        self._scratch = tempfile.TemporaryDirectory(prefix="grpolab-data-")
        overrides = []
        if model is not None and str(model) != "demo":
            overrides.append(f"model.name_or_path={model}")
        if train_dataset is not None:
            overrides += ["task.name=jsonl", f"task.path={self._rows_file(train_dataset, 'train')}"]
        if eval_dataset is not None:
            overrides.append(f"task.eval_path={self._rows_file(eval_dataset, 'eval')}")
        self.config = _config(args, overrides)
        if reward_funcs is not None:
            self.config.rewards.functions = _reward_list(reward_funcs)

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

    def train(self, **kwargs: Any) -> dict[str, Any]:
        """The preflight, then training (grpolab.trainer.train's keywords: resume=,
        overwrite=, skip_preflight=, ...); returns the run's summary."""
        return train(self.config, **kwargs)

    def preflight(self, **kwargs: Any):
        """The preflight checks alone, on this model, task and rewards."""
        return preflight(self.config, **kwargs)

    def evaluate(self, **kwargs: Any) -> dict[str, float]:
        """Greedy accuracy of the configured model on the held-out set."""
        return run_eval(self.config, **kwargs)


def _config(args: GRPOConfig | Config | dict[str, Any] | None, overrides: list[str]) -> Config:
    if isinstance(args, Config):
        if overrides:
            raise ConfigError("with a grpolab Config as args, set model and data in it")
        return args
    if isinstance(args, dict):
        args = GRPOConfig(**args)
    return load_config(overrides=[*(args.overrides() if args else []), *overrides])


def _reward_list(reward_funcs: RewardFuncs) -> list:
    if isinstance(reward_funcs, str) or callable(reward_funcs):
        return [reward_funcs]
    return list(reward_funcs)
