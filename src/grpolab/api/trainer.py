"""GRPOTrainer: TRL's trainer, its arguments turned into one grpolab config (load_config's
values: objects as they are), trained by grpolab.train.loop.train, preflight first."""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, TrainerState

from grpolab.api.args import GRPOConfig
from grpolab.api.events import TrainerEvents, callback_instances, trl_metrics
from grpolab.api.objects import (
    RewardFuncs,
    given_model,
    given_rows,
    lora_settings,
    lora_targets,
    reward_list,
    skeleton,
    tokenizer_of,
)
from grpolab.config import (
    Config,
    ConfigError,
    canonical,
    load_config,
    load_notes,
    load_warnings,
    replaced,
)
from grpolab.config.load import with_notes
from grpolab.config.trl import NO_HUB, epoch_steps, epoch_values, model_init_values
from grpolab.model.policy import GivenModel, load_tokenizer, save_policy
from grpolab.rewards import load_rewards
from grpolab.tasks import load_task
from grpolab.train.evaluate import accuracy_rewards, evaluate_greedy, evaluate_rewards
from grpolab.train.loop import train
from grpolab.train.preflight import preflight
from grpolab.train.setup import (
    BatchPlan,
    check_context_fits,
    load_start_model,
    model_source,
    resolve_device,
    task_engine,
)
from grpolab.ways import from_python

TRL_EPOCHS = 3  # TRL's num_train_epochs when neither it nor max_steps is given
GRADIENT_CHECKPOINTING = (None, {}, {"use_reentrant": False})  # what grpolab does


class GRPOTrainer:
    """TRL's GRPOTrainer over grpolab.train.loop.train.

    `model`: a hub id, a local directory, a .gguf file, a packaged model's short name, "demo" /
    None for the built-in demo model, or a loaded transformers causal LM (the class
    AutoModelForCausalLM builds for its config), trained as it is, in place (converted to
    model.dtype, float32 unless set). A model with peft adapters is refused
    (merge_and_unload() it first). `processing_class`: the tokenizer to train with (a
    processor's `.tokenizer`); with a named model, that model is loaded here to go with it.

    `peft_config`: a peft.LoraConfig, as the lora section's r / alpha / dropout /
    target_modules (names, a regex, "all-linear" or None, resolved here against the model);
    any other LoraConfig field changed from peft's default is refused, named.

    `args`: a GRPOConfig, a dict of the same names, or a grpolab Config (which must then hold
    the model, data and LoRA keys itself). `reward_funcs`: a callable, a built-in name
    ("accuracy", "format", "overlong"), "module:function", a reward model (loaded, or its
    directory or hub id), or a list of them; `reward_processing_classes`: a reward model's
    tokenizer, one per reward (None where none is meant). `train_dataset` / `eval_dataset`:
    a list of dicts or a `datasets.Dataset` (task.rows / task.eval_rows). `callbacks`:
    transformers TrainerCallbacks (`events.TrainerEvents` says which events they get).

    After train(): `model` is the trained model, `state.log_history` one dict per logged step
    in TRL's metric names, `save_model(dir)` writes it as a transformers directory."""

    def __init__(
        self,
        model: str | PreTrainedModel | None = None,
        reward_funcs: RewardFuncs | None = None,
        args: GRPOConfig | Config | dict[str, Any] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
    ):
        if any(o is not None for o in optimizers):
            raise ConfigError("optimizers: grpolab builds its own AdamW and schedule (optim, "
                              "schedule sections); pass optimizers=(None, None)")  # fmt: skip
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.callbacks = callback_instances(callbacks)
        self._model = self._tokenizer = None
        self.run_dir: Path | None = None  # the run's directory, once training started
        self.steps_per_epoch: int | None = None
        if isinstance(args, Config):
            self.args = args
            refuse_with_config(model, train_dataset, eval_dataset, processing_class, peft_config)
            self.config, self.eval_generations = args, args.batch.num_generations
        else:
            self.args = args if isinstance(args, GRPOConfig) else GRPOConfig(**(args or {}))
            objects = (model, reward_funcs, train_dataset, eval_dataset, processing_class,
                       reward_processing_classes, peft_config)  # fmt: skip
            self.config = self._build(*objects)
            self.args.resolved = self.config
        given = self.config.model.name_or_path
        if isinstance(given, GivenModel):
            self._model, self._tokenizer = given.model, given.tokenizer
        cfg = self.config
        self.state = TrainerState(max_steps=cfg.max_steps, logging_steps=cfg.logging.logging_steps,
                                  eval_steps=cfg.eval.eval_steps,
                                  save_steps=cfg.checkpoints.save_steps,
                                  train_batch_size=cfg.batch_size)  # fmt: skip
        TrainerEvents(self).call("on_init_end")

    # --- The config -------------------------------------------------------------------------

    def _build(self, model, reward_funcs, train_dataset, eval_dataset, processing_class,
               reward_processing_classes, peft_config) -> Config:  # fmt: skip
        """The run's config: the arguments as load_config's values, then what needs them
        loaded (a named model with processing_class, LoRA's modules, the epochs)."""
        args = self.args
        tokenizer = None if processing_class is None else tokenizer_of(processing_class)
        values = dict(args.values)
        values |= model_values(model, tokenizer, args.data)
        values |= lora_values(peft_config, args.values)
        values |= data_values(train_dataset, eval_dataset, values)
        if reward_funcs is not None:
            values["rewards.functions"] = reward_list(reward_funcs, reward_processing_classes)
        elif reward_processing_classes is not None:
            raise ConfigError("reward_processing_classes: give reward_funcs with them")
        with from_python():
            cfg = load_config(values=values)
            more: dict[str, Any] = {}
            if tokenizer is not None and not isinstance(values.get("model.name_or_path"),
                                                        GivenModel):  # fmt: skip
                policy, _ = load_start_model(cfg, torch.device("cpu"))
                more["model.name_or_path"] = given_model(policy, tokenizer)
            if peft_config is not None:
                given = more.get("model.name_or_path", values.get("model.name_or_path"))
                modules = (lambda: given.model) if isinstance(given, GivenModel) else (
                    lambda: skeleton(cfg))  # fmt: skip
                more["lora.target_modules"] = lora_targets(peft_config.target_modules, modules)
            more |= self._counted_values(cfg, train_dataset is not None)
            self.values = values | more
            if more:
                cfg = load_config(values=self.values)
        self.eval_generations = args.data.get("num_generations_eval") or cfg.batch.num_generations
        return self._with_warnings(cfg)

    def _counted_values(self, cfg: Config, rows: bool) -> dict[str, Any]:
        """What TRL counts in epochs or as a share (num_train_epochs, warmup_ratio, a
        strategy of "epoch"), in steps of this config and its rows. Without max_steps and
        num_train_epochs, train_dataset is trained TRL_EPOCHS epochs (TRL's default)."""
        data = dict(self.args.data)
        if rows:
            self.steps_per_epoch = math.ceil(
                len(load_task(cfg.task).train) / cfg.batch.prompts_per_step
            )
            if "max_steps" not in self.args.given:
                data.setdefault("num_train_epochs", TRL_EPOCHS)
        if data.get("gradient_checkpointing_kwargs") not in GRADIENT_CHECKPOINTING:
            raise ConfigError(
                f"GRPOConfig(gradient_checkpointing_kwargs={data['gradient_checkpointing_kwargs']!r})"
                ": grpolab checkpoints with use_reentrant=False and no other option"
            )
        more = {}
        steps = None if "max_steps" in self.args.given else epoch_steps(data, self.steps_per_epoch)
        if steps is not None:
            more["max_steps"] = steps  # TRL: a max_steps given wins over the epochs
        optimizer_steps = BatchPlan.of(cfg).optimizer_steps
        more |= epoch_values(data, self.steps_per_epoch, optimizer_steps,
                             more.get("max_steps", cfg.max_steps))  # fmt: skip
        return more

    def _with_warnings(self, cfg: Config) -> Config:
        """The TRL names given that change nothing: a warning at start, refused under
        strict."""
        if self.args.warnings and cfg.strict:
            raise ConfigError(f"{self.args.warnings[0]}; remove it (strict refuses it)")
        return with_notes(cfg, load_notes(cfg), load_warnings(cfg) + self.args.warnings)

    # --- What a TRL script reads ------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The trained model after train(); before, the model given, or the named one,
        loaded now (and then trained in place, as one model in memory)."""
        if self._model is None:
            with from_python():
                device = resolve_device(self.config.model.device)
                model, tokenizer = load_start_model(self.config, device)
            held = GivenModel(model, tokenizer, name=self.config.model.name_or_path)
            self.config = replaced(self.config, {"model.name_or_path": held})
            self._model, self._tokenizer = model, tokenizer
        return self._model

    @property
    def processing_class(self):
        """The tokenizer the model is trained with."""
        if self._tokenizer is None:
            with from_python():
                self._tokenizer = load_tokenizer(model_source(self.config))
            if self._tokenizer.pad_token is None:
                self._tokenizer.pad_token = self._tokenizer.eos_token
        return self._tokenizer

    def trained(self, model: torch.nn.Module, tokenizer) -> None:
        """The run's model and tokenizer, at its end (TrainerEvents)."""
        self._model, self._tokenizer = model, tokenizer

    def add_callback(self, callback) -> None:
        self.callbacks += callback_instances([callback])

    def pop_callback(self, callback):
        """Remove a callback (an instance, or the first of a class) and return it."""
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                self.callbacks.remove(cb)
                return cb
        return None

    def remove_callback(self, callback) -> None:
        self.pop_callback(callback)

    # --- Training, evaluation, saving -------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """The preflight, then training (grpolab.train.loop.train's keywords: resume=,
        overwrite=, skip_preflight=, ...; TRL's resume_from_checkpoint= is resume=); returns
        the run's summary (summary.json's keys; also global_step, training_loss and metrics,
        as transformers' TrainOutput)."""
        if resume_from_checkpoint is not None:
            kwargs.setdefault("resume", resume_from_checkpoint)
        for name in ("trial", "ignore_keys_for_eval"):
            if kwargs.pop(name, None) is not None:
                raise ConfigError(f"train({name}=...): not supported (no hyperparameter search, "
                                  "no evaluation keys to ignore)")  # fmt: skip
        with from_python():
            summary = train(self.config, listeners=[TrainerEvents(self)], **kwargs)
        return TrainSummary(summary, self.state.log_history[-1] if self.state.log_history else {})

    def preflight(self, **kwargs: Any):
        """The preflight checks alone, on this model, task and rewards."""
        with from_python():
            return preflight(self.config, **kwargs)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:  # fmt: skip
        """TRL's evaluation of the model (trained, after train()) on the evaluation rows
        (`eval_dataset`: these instead of the trainer's): num_generations_eval samples per
        prompt at the training sampling, scored by the reward functions (eval_reward,
        eval_reward_std, eval_rewards/<name>/mean, eval_completions/mean_length, ...), and
        with reference answers the greedy accuracy (eval_accuracy, eval_strict_accuracy, in
        percent). Logged in state.log_history; the callbacks' on_evaluate gets them."""
        tic = time.perf_counter()
        cfg = self._eval_config(eval_dataset)
        with from_python():
            metrics = evaluate_model(cfg, self.model, self.processing_class,
                                     self.eval_generations)  # fmt: skip
        out = {f"{metric_key_prefix}_{k}": v for k, v in trl_metrics(metrics).items()}
        out[f"{metric_key_prefix}_runtime"] = time.perf_counter() - tic
        events = TrainerEvents(self)
        events.log(out)
        events.call("on_evaluate", metrics=out)
        return out

    def _eval_config(self, eval_dataset: Any) -> Config:
        if eval_dataset is None:
            return self.config
        if isinstance(self.args, Config) or self.config.task.name == "arithmetic":
            raise ConfigError(
                "evaluate(eval_dataset=...): the trainer's task reads no rows; give "
                "GRPOTrainer train_dataset= (the rows' fields and template)"
            )
        values = dict(self.values)
        values["task.eval_rows"] = given_rows(eval_dataset, "eval_dataset")
        values.pop("task.num_eval", None)
        with from_python():
            return load_config(values=values)

    def save_model(self, output_dir: str | Path | None = None, _internal_call: bool = False):
        """The model (trained, after train()) and its tokenizer as a transformers directory
        that AutoModelForCausalLM.from_pretrained loads: LoRA adapters merged into the
        weights. `output_dir`: the run's directory when not given."""
        path = Path(output_dir or self.run_dir or self.config.output_dir.replace(
            "{time}", time.strftime("%Y%m%d-%H%M%S")))  # fmt: skip
        model = self.model
        if hasattr(model, "merge_and_unload"):  # peft: merged on a copy, the model unchanged
            model = copy.deepcopy(model).merge_and_unload()
        save_policy(model, self.processing_class, path)

    def save_state(self) -> None:
        """trainer_state.json (transformers' TrainerState, log_history included) in the run's
        directory."""
        path = Path(self.run_dir or self.config.output_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.state.save_to_json(str(path / "trainer_state.json"))

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(f"push_to_hub: {NO_HUB}")


class TrainSummary(dict):
    """grpolab's summary (summary.json's keys), read also as transformers' TrainOutput:
    `global_step`, `training_loss`, `metrics` (train_runtime, train_loss, epoch)."""

    def __init__(self, summary: dict[str, Any], final_log: dict[str, Any]):
        super().__init__(summary)
        self.global_step = summary["steps"]
        self.training_loss = final_log.get("train_loss", math.nan)
        self.metrics = {k: v for k, v in final_log.items() if k != "step"}


def refuse_with_config(model, train_dataset, eval_dataset, processing_class, peft_config):
    """A grpolab Config as args holds the model, data and LoRA keys itself."""
    named = model is None or isinstance(model, str | Path)
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


def model_values(model: Any, tokenizer, data: dict[str, Any]) -> dict[str, Any]:
    """model.name_or_path (a name, or the loaded model with its tokenizer) and model.dtype
    from model_init_kwargs (which a loaded model no longer takes: TRL refuses it too)."""
    if model is None or isinstance(model, str | Path):
        values = model_init_values(data.get("model_init_kwargs"))
        if model is not None and str(model) != "demo":
            values["model.name_or_path"] = str(model)
        return values
    if data.get("model_init_kwargs"):
        raise ConfigError("GRPOConfig(model_init_kwargs=...) applies to a model given by name; "
                          "this one is loaded already (load it with those arguments)")  # fmt: skip
    return {"model.name_or_path": given_model(model, tokenizer)}


def lora_values(peft_config: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The lora section's r, alpha, dropout from a LoraConfig (target_modules need the
    model: `lora_targets`); a LoRA key given too is refused."""
    settings = lora_settings(peft_config)
    if settings is None:
        return {}
    both = [n for n in given if canonical(n).startswith("lora.")]
    if both:
        raise ConfigError(
            f"peft_config and GRPOConfig({', '.join(both)}) both set LoRA: give one of them"
        )
    return settings


def data_values(train_dataset: Any, eval_dataset: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The rows as the jsonl task reads them; train_dataset is all training (TRL's meaning)
    unless the keys given choose a hold-out."""
    values: dict[str, Any] = {}
    if train_dataset is not None:
        values |= {"task.name": "jsonl", "task.rows": given_rows(train_dataset, "train_dataset")}
    if eval_dataset is not None:
        values["task.eval_rows"] = given_rows(eval_dataset, "eval_dataset")
    elif train_dataset is not None and not (
        {canonical(k) for k in given} & {"task.num_eval", "task.eval_fraction"}
    ):
        values["task.num_eval"] = 0
    return values


def evaluate_model(cfg: Config, model, tokenizer, num_generations: int) -> dict[str, float]:
    """The rewards of sampled completions on the task's evaluation rows, and the greedy
    accuracy where they have reference answers (grpolab's metric names)."""
    task = load_task(cfg.task)
    if not task.eval:
        raise ValueError(
            "evaluate(): no evaluation rows: pass eval_dataset (to GRPOTrainer or evaluate), or "
            "hold rows out of train_dataset (GRPOConfig(**{'task.eval_fraction': 0.1}))"
        )
    rewards = load_rewards(cfg.rewards, task=task,
                           max_completion_length=cfg.rollout.max_completion_length)  # fmt: skip
    model, tokenizer = GivenModel(model, tokenizer).load(
        cfg.model.dtype, resolve_device(cfg.model.device)
    )
    engine = task_engine(cfg, model, tokenizer)
    check_context_fits(cfg, engine, task)
    try:
        metrics = evaluate_rewards(engine, task.eval, rewards, num_generations,
                                   cfg.rollout.sampling(cfg.seed), cfg.eval_batch_size)  # fmt: skip
        if task.has_references:
            length = cfg.eval.eval_max_completion_length or cfg.rollout.max_completion_length
            greedy = evaluate_greedy(engine, task.eval, accuracy_rewards(cfg.rewards, task),
                                     length, cfg.eval_batch_size, task.answer_kind,
                                     judge=task.strict_judge)  # fmt: skip
            metrics |= {"accuracy": greedy.accuracy, "strict_accuracy": greedy.strict_accuracy}
    finally:
        engine.close()
    return metrics
