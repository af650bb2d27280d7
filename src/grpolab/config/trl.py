"""TRL's GRPOConfig names, the one home of what each means in grpolab, and the one
did-you-mean for a name that is no key (the command line's overrides and files, and the Python
API's GRPOConfig both ask `suggest`).

Every TRL name grpolab knows is in exactly one table:

    TRL_KEYS       the same meaning as one grpolab key (learning_rate -> optim.learning_rate)
    TRL_CONVERTED  a value converted into grpolab keys (bf16=True -> runtime.precision=bf16),
                   or refused, named, where grpolab cannot honour that value
    TRL_DEFAULT    grpolab's behaviour is TRL's default: that value is accepted, another is
                   refused with the reason
    TRL_IGNORED    no effect in grpolab (no data loader, no hub): accepted with a warning
    TRL_DATA       what needs the run's rows or model (epochs, warmup_ratio, a strategy of
                   "epoch", model_init_kwargs): the Python API's GRPOTrainer resolves them
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpolab.config.tree import Config, ConfigError
from grpolab.objective import TRL_NAMES

# TRL name -> grpolab's dotted key, where the two mean the same thing (the objective's: each
# unit declares its own, grpolab.objective.TRL_NAMES).
TRL_KEYS = TRL_NAMES | {
    "output_dir": "output_dir",
    "max_steps": "max_steps",
    "seed": "seed",
    "learning_rate": "optim.learning_rate",
    "adam_beta1": "optim.adam_beta1",
    "adam_beta2": "optim.adam_beta2",
    "weight_decay": "optim.weight_decay",
    "max_grad_norm": "optim.max_grad_norm",
    "warmup_steps": "schedule.warmup_steps",
    "num_generations": "batch.num_generations",
    "vllm_gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
    "vllm_max_model_length": "rollout.vllm.max_model_len",
    "save_steps": "checkpoints.save_steps",
    "save_total_limit": "checkpoints.save_total_limit",
    "eval_steps": "eval.eval_steps",
    "per_device_eval_batch_size": "eval.eval_batch_size",
    "logging_steps": "logging.logging_steps",
    "num_completions_to_print": "logging.log_completions_count",
    "gradient_checkpointing": "runtime.gradient_checkpointing",
    "torch_compile": "runtime.torch_compile",
    "max_completion_length": "rollout.max_completion_length",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "reward_weights": "rewards.weights",
}

# The batch: TRL's per-device micro-batch, accumulation and generation size (`batch_values`).
TRL_BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps",
             "steps_per_generation", "generation_batch_size")  # fmt: skip

SAMPLES_AS_GIVEN = "grpolab samples the model's own distribution (only temperature, top_p, top_k)"
NO_HUB = (
    "grpolab does not push to the Hugging Face Hub: trainer.save_model(DIR) writes a "
    "transformers directory, which huggingface_hub's upload_folder pushes"
)
ONE_OPTIMIZER = "grpolab's optimizer is torch's AdamW (eps 1e-8)"

# TRL name -> (TRL's default, which grpolab does; why another value is refused).
TRL_DEFAULT = {
    "fp16": (
        False,
        "grpolab runs bf16 autocast over float32 weights, or fp32 (fp16 needs a "
        "loss scaler): bf16=True",
    ),
    "push_to_hub": (False, NO_HUB),
    "hub_model_id": (None, NO_HUB),
    "hub_token": (None, NO_HUB),
    "hub_strategy": ("every_save", NO_HUB),
    "hub_private_repo": (None, NO_HUB),
    "log_completions_hub_repo": (None, NO_HUB),
    "repetition_penalty": (
        1.0,
        f"{SAMPLES_AS_GIVEN}; a penalty would sample another "
        "distribution than the one the loss's log-probs are of",
    ),
    "min_p": (None, f"{SAMPLES_AS_GIVEN}; min_p would truncate it further"),
    "generation_kwargs": (None, f"{SAMPLES_AS_GIVEN}: set them by name"),
    "cache_implementation": (None, "grpolab's engines keep their own KV cache"),
    "adam_epsilon": (1e-8, ONE_OPTIMIZER),
    "optim_args": (None, ONE_OPTIMIZER),
    "lr_scheduler_kwargs": (None, "grpolab's schedules (constant, cosine) take no arguments"),
    "multi_objective_aggregation": (
        "sum_then_normalize",
        "grpolab sums the weighted rewards, then normalises the total (TRL's default)",
    ),
    "sync_ref_model": (False, "grpolab's reference is the start model, never synced"),
    "use_adaptive_entropy": (False, "no adaptive entropy coefficient"),
    "entropy_coef": (
        0.0,
        "TRL adds the plain mean token entropy whatever the loss type; "
        "grpolab's objective.entropy_coef aggregates it like the loss: set that "
        "key to mean it",
    ),
    "off_policy_mask_threshold": (None, "no off-policy sequence mask"),
    "vllm_importance_sampling_clip_min": (
        None,
        "the correction's lower bound is not implemented (objective.tis_cap is its upper one)",
    ),
    "vllm_mode": ("colocate", "grpolab's vLLM engine runs in the trainer's process (colocate)"),
    "vllm_tensor_parallel_size": (1, "grpolab's vLLM engine runs on one device per rank"),
    "max_tool_calling_iterations": (
        None,
        "tools run through rollout.tools; the turns are rollout.max_turns",
    ),
    "cast_lm_head_to_fp32": (False, "grpolab computes every log-softmax in float32 already"),
    "router_aux_loss_coef": (None, "no MoE auxiliary loss"),
    "shuffle_dataset": (True, "grpolab draws each step's prompts at random"),
    "remove_unused_columns": (False, "every column of a row reaches the reward functions"),
    "trust_remote_code": (False, "grpolab loads transformers' own model classes only"),
    "use_liger_kernel": (False, "grpolab's fused log-probs are its own (runtime.logprobs)"),
    "use_transformers_paged": (False, "grpolab's engines are hf and vllm (rollout.engine)"),
    "use_transformers_continuous_batching": (
        False,
        "grpolab's engines are hf and vllm (rollout.engine)",
    ),
    "auto_find_batch_size": (False, "a batch holds whole groups; set its size"),
    "neftune_noise_alpha": (None, "no embedding noise"),
    "label_smoothing_factor": (0.0, "a GRPO loss has no labels"),
    "load_best_model_at_end": (False, "grpolab keeps the last checkpoints (save_total_limit)"),
    "logging_strategy": ("steps", "grpolab logs by steps (logging_steps)"),
    "deepspeed": (None, "grpolab's data parallel is torchrun with parallel.strategy=ddp or fsdp"),
    "fsdp": (None, "grpolab shards with parallel.strategy=fsdp under torchrun"),
    "use_cpu": (False, "the device is model.device (auto: a GPU when there is one)"),
    "tf32": (None, "grpolab's precision is runtime.precision"),
    "max_prompt_length": (None, "prompts are never cut; the preflight checks the context fits"),
}

# TRL names that change nothing in grpolab (no data loader, no hub, no distributed setup to
# tune): accepted, with a warning saying so.
TRL_IGNORED = {
    **dict.fromkeys(
        ("dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
         "dataloader_prefetch_factor", "dataloader_drop_last", "dataloader_in_order",
         "dataloader_multiprocessing_context", "train_sampling_strategy", "pad_to_multiple_of",
         "length_column_name", "data_seed", "eval_accumulation_steps"),
        "no data loader: each step draws its prompts from the rows in memory (seed)"),
    **dict.fromkeys(
        ("do_train", "do_eval", "do_predict", "run_name", "project", "log_level",
         "log_level_replica", "log_on_each_node", "save_on_each_node", "logging_first_step",
         "logging_nan_inf_filter", "skip_memory_metrics", "include_num_input_tokens_seen",
         "disable_dropout", "ddp_find_unused_parameters", "ddp_timeout", "ddp_backend",
         "ddp_broadcast_buffers", "ddp_static_graph", "save_only_model",
         "log_unique_prompts", "log_multimodal", "ds3_gather_for_generation",
         "vllm_enable_sleep_mode", "vllm_model_impl", "bf16_full_eval", "fp16_full_eval",
         "average_tokens_across_devices", "batch_eval_metrics", "eval_do_concat_batches",
         "eval_use_gather_object", "prediction_loss_only", "include_for_metrics",
         "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "use_cache",
         "label_names", "chat_template_kwargs", "torch_empty_cache_steps"),
        "no counterpart in grpolab"),
}  # fmt: skip

# What the Python API resolves with the run's rows or model (`epoch_values`, GRPOTrainer).
TRL_DATA = {
    "num_train_epochs": "epochs over train_dataset: max_steps = epochs x rows / prompts per step",
    "warmup_ratio": "a share of the optimizer steps: schedule.warmup_steps",
    "model_init_kwargs": "dtype (torch_dtype) -> model.dtype, for a model given by name",
    "gradient_checkpointing_kwargs": "grpolab checkpoints with use_reentrant=False",
    "num_generations_eval": "completions per prompt of trainer.evaluate()",
    "eval_strategy": "no / steps / epoch -> eval.eval_steps",
    "save_strategy": "no / steps / epoch -> checkpoints.save_steps",
}


def _precision(value: Any) -> dict[str, Any]:
    """TRL's bf16: True -> bf16 autocast, False -> fp32, None (TRL's "bf16 unless fp16") ->
    grpolab's own default."""
    return {} if value is None else {"runtime.precision": "bf16" if value else "fp32"}


def _scale_rewards(value: Any) -> dict[str, Any]:
    return {"objective.scale_rewards": {True: "group", False: "none"}.get(value, value)}


def _report_to(value: Any) -> dict[str, Any]:
    """ "none" / None -> nothing; "all" would mean every installed integration: name them."""
    names = [value] if isinstance(value, str) else list(value or [])
    names = [n for n in names if n != "none"]
    if "all" in names:
        raise ConfigError("GRPOConfig(report_to='all'): name the trackers (tensorboard, wandb, "
                          "trackio), or 'none'")  # fmt: skip
    return {"logging.report_to": names}


def _lr_scheduler(value: Any) -> dict[str, Any]:
    schedules = {"constant": "constant", "constant_with_warmup": "constant", "cosine": "cosine"}
    if value not in schedules:
        raise ConfigError(
            f"GRPOConfig(lr_scheduler_type={value!r}): grpolab's schedules are constant and "
            "cosine, each with warmup_steps (schedule.lr_scheduler)"
        )
    return {"schedule.lr_scheduler": schedules[value]}


def _optim(value: Any) -> dict[str, Any]:
    if str(value) not in ("adamw_torch", "adamw_torch_fused", "OptimizerNames.ADAMW_TORCH",
                          "OptimizerNames.ADAMW_TORCH_FUSED"):  # fmt: skip
        raise ConfigError(f"GRPOConfig(optim={value!r}): {ONE_OPTIMIZER} (optim='adamw_torch')")
    return {}


def _use_vllm(value: Any) -> dict[str, Any]:
    return {"rollout.engine": "vllm"} if value else {}


def _is_correction(value: Any) -> dict[str, Any]:
    return {} if value else {"objective.tis_cap": None}


# TRL name -> (the grpolab keys its value sets, the conversion: ConfigError for a value
# grpolab cannot honour).
TRL_CONVERTED: dict[str, tuple[str, Callable[[Any], dict[str, Any]]]] = {
    "bf16": ("runtime.precision", _precision),
    "scale_rewards": ("objective.scale_rewards", _scale_rewards),
    "report_to": ("logging.report_to", _report_to),
    "disable_tqdm": ("logging.progress",
                     lambda v: {} if v is None else {"logging.progress": not v}),
    "log_completions": ("logging.log_completions_steps",
                        lambda v: {} if v else {"logging.log_completions_steps": 0}),
    "lr_scheduler_type": ("schedule.lr_scheduler", _lr_scheduler),
    "optim": ("optim (AdamW)", _optim),
    "use_vllm": ("rollout.engine", _use_vllm),
    "vllm_importance_sampling_correction": ("objective.tis_cap", _is_correction),
}  # fmt: skip


def trl_names() -> tuple[str, ...]:
    """Every TRL name grpolab knows."""
    tables = (TRL_KEYS, TRL_BATCH, TRL_DEFAULT, TRL_IGNORED, TRL_DATA, TRL_CONVERTED)
    return tuple(sorted({name for table in tables for name in table}))


def trl_values(given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """TRL's names and grpolab's dotted keys as given to GRPOConfig -> (grpolab's values,
    the names TRL_DATA resolves later, warnings for the names TRL_IGNORED). A name that is
    neither, or a value grpolab cannot honour, is a ConfigError naming it."""
    values, data, warnings = batch_values(given), {}, []
    for name, value in given.items():
        if name in TRL_BATCH:
            continue
        if name in TRL_KEYS:
            values[TRL_KEYS[name]] = value
        elif name in TRL_CONVERTED:
            values |= TRL_CONVERTED[name][1](value)
        elif name in TRL_DEFAULT:
            default, why = TRL_DEFAULT[name]
            if value != default and not (default is None and value in ({}, [], "")):
                raise ConfigError(f"GRPOConfig({name}={value!r}) is not supported: {why}")
        elif name in TRL_IGNORED:
            warnings.append(f"GRPOConfig({name}=...) has no effect: {TRL_IGNORED[name]}")
        elif name in TRL_DATA:
            data[name] = value
        elif "." in name or name in grpolab_keys():
            values[name] = value  # a grpolab key (load_config checks it)
        else:
            raise ConfigError(f"GRPOConfig({name}=...): {not_a_name(name, trl=True)}")
    return values, data, warnings


def batch_values(given: dict[str, Any]) -> dict[str, Any]:
    """TRL's batch: per_device_train_batch_size (completions per micro-batch) x
    gradient_accumulation_steps completions per optimizer step, steps_per_generation of them
    (default: one) per generation -> batch.generation_batch_size, and batch.mini_batch_size
    when a generation holds several optimizer steps."""
    per_device = given.get("per_device_train_batch_size")
    accumulation = given.get("gradient_accumulation_steps")
    steps, generation = given.get("steps_per_generation"), given.get("generation_batch_size")
    values: dict[str, Any] = {}
    if accumulation is not None:
        values["batch.gradient_accumulation_steps"] = accumulation
    if steps is not None and generation is not None:
        raise ConfigError("GRPOConfig: give steps_per_generation or generation_batch_size, "
                          "not both")  # fmt: skip
    if per_device is None:
        if steps is not None:
            raise ConfigError("GRPOConfig(steps_per_generation=...) needs "
                              "per_device_train_batch_size (the completions of each)")  # fmt: skip
        return values | ({} if generation is None else {"batch.generation_batch_size": generation})
    step = int(per_device) * int(accumulation or 1)  # completions per optimizer step
    if generation is None:
        generation = int(per_device) * int(steps or accumulation or 1)
    elif generation % int(per_device):
        raise ConfigError(
            f"GRPOConfig: generation_batch_size={generation} must be a multiple of "
            f"per_device_train_batch_size={per_device}"
        )
    values["batch.generation_batch_size"] = generation
    if generation != step:
        values["batch.mini_batch_size"] = step
    return values


def epoch_values(
    data: dict[str, Any], steps_per_epoch: int | None, optimizer_steps: int, max_steps: int
) -> dict[str, Any]:
    """The TRL_DATA names that count epochs or steps, once the rows are known:
    num_train_epochs -> max_steps (unless max_steps was given: TRL's max_steps wins),
    warmup_ratio -> schedule.warmup_steps, a strategy of "epoch" -> that many steps.
    `steps_per_epoch`: steps for each training row to be drawn once on average (None: no
    rows given); `optimizer_steps`: per step; `max_steps`: the run's."""
    values: dict[str, Any] = {}
    for name in ("eval_strategy", "save_strategy"):
        key = "eval.eval_steps" if name == "eval_strategy" else "checkpoints.save_steps"
        value = str(data.get(name, "steps")).removeprefix("IntervalStrategy.").lower()
        value = value.removeprefix("savestrategy.")
        if value == "no":
            values[key] = 0
        elif value == "epoch":
            values[key] = _per_epoch(name, steps_per_epoch)
        elif value != "steps":
            raise ConfigError(f"GRPOConfig({name}={data[name]!r}): expected 'no', 'steps' or "
                              "'epoch'")  # fmt: skip
    ratio = data.get("warmup_ratio")
    if ratio:
        if not 0 <= ratio < 1:
            raise ConfigError(f"GRPOConfig(warmup_ratio={ratio!r}): expected a number in [0, 1)")
        values["schedule.warmup_steps"] = math.ceil(ratio * max_steps * optimizer_steps)
    return values


def epoch_steps(data: dict[str, Any], steps_per_epoch: int | None) -> int | None:
    """max_steps for num_train_epochs (None when not given)."""
    epochs = data.get("num_train_epochs")
    if epochs is None:
        return None
    if not epochs > 0:
        raise ConfigError(f"GRPOConfig(num_train_epochs={epochs!r}): expected a number > 0")
    return math.ceil(epochs * _per_epoch("num_train_epochs", steps_per_epoch))


def _per_epoch(name: str, steps_per_epoch: int | None) -> int:
    if steps_per_epoch is None:
        raise ConfigError(
            f"GRPOConfig({name}=...) counts epochs over train_dataset: pass train_dataset, or "
            "count steps (max_steps, eval_steps, save_steps)"
        )
    return steps_per_epoch


# --- Did you mean ---------------------------------------------------------------------------


@functools.cache
def grpolab_keys() -> tuple[str, ...]:
    """Every dotted key of the config tree."""
    keys: list[str] = []

    def walk(tp: Any, prefix: str) -> None:
        for f in dataclasses.fields(tp):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
            else:
                keys.append(f"{prefix}{f.name}")

    walk(Config, "")
    return tuple(keys)


@dataclass(frozen=True)
class Suggestion:
    """What a name that is no key probably means: `key` as the command line writes it
    (a dotted key, or key=value for a converted TRL value), `trl` as GRPOConfig does (a TRL
    name, else the dotted key), or `why` a TRL name grpolab refuses means nothing here."""

    key: str
    trl: str
    why: str = ""


NO_VALUE = object()


def suggest(name: str, value: Any = NO_VALUE) -> Suggestion | None:
    """The key `name` most likely means: a TRL name's grpolab key (its value converted when
    given: bf16=true -> runtime.precision=bf16), a leaf's full key (learning_rate ->
    optim.learning_rate), or the closest of those and TRL's names (learnig_rate); None when
    nothing is close."""
    exact = _meaning(name, value)
    if exact is not None:
        return exact
    leaves = {k.rsplit(".", 1)[-1] for k in grpolab_keys()}
    close = difflib.get_close_matches(name, [*trl_names(), *leaves], n=1, cutoff=0.75)
    return _meaning(close[0], NO_VALUE) if close else None


def _meaning(name: str, value: Any) -> Suggestion | None:
    if name in TRL_KEYS:
        return Suggestion(TRL_KEYS[name], name)
    if name in TRL_CONVERTED:
        keys, convert = TRL_CONVERTED[name]
        if value is NO_VALUE:
            return Suggestion(keys, name)
        try:
            converted = convert(value)
        except ConfigError as e:
            return Suggestion(name, name, str(e).partition(": ")[2])
        keys = " ".join(f"{k}={_text(v)}" for k, v in converted.items())
        return Suggestion(keys, name) if keys else Suggestion(name, name, "TRL's default")
    if name in TRL_DEFAULT:
        return Suggestion(name, name, TRL_DEFAULT[name][1])
    if name in TRL_IGNORED:
        return Suggestion(name, name, f"it has no effect: {TRL_IGNORED[name]}")
    if name in TRL_DATA or name in TRL_BATCH:
        return Suggestion(name, name, f"the Python API's GRPOConfig reads it ({_data_hint(name)})")
    full = [k for k in grpolab_keys() if k.rsplit(".", 1)[-1] == name and k != name]
    if full:
        return Suggestion(" or ".join(full), full[0])
    return None


def _data_hint(name: str) -> str:
    return TRL_DATA.get(name) or "the batch: batch.generation_batch_size, batch.mini_batch_size"


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    if isinstance(value, bool) or value is None:
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def not_a_name(name: str, trl: bool = False, value: Any = NO_VALUE) -> str:
    """The one-line reason `name` is no key, with the did-you-mean: as GRPOConfig takes
    names (`trl`: TRL's names, grpolab's dotted keys) or as a config file or override
    does (dotted keys)."""
    s = suggest(name, value)
    if s is None:
        if trl:
            return ("not a TRL name grpolab knows nor a grpolab key (section.key, e.g. "
                    "optim.learning_rate)")  # fmt: skip
        return "no such key (section.key, e.g. optim.learning_rate)"
    if s.why:
        said = f"TRL's {s.trl}" if s.trl != name else f"TRL's name {name}"
        return f"{said}: {s.why}"
    return f"did you mean {s.trl if trl else s.key}?"


# --- model_init_kwargs ------------------------------------------------------------------------

DTYPES = {
    **dict.fromkeys(("float32", "fp32", "float"), "float32"),
    **dict.fromkeys(("bfloat16", "bf16"), "bfloat16"),
    **dict.fromkeys(("float16", "fp16", "half"), "float16"),
}


def model_init_values(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """TRL's model_init_kwargs (from_pretrained's keywords for a model given by name):
    dtype / torch_dtype -> model.dtype; any other keyword is refused, named (grpolab loads
    the model itself: load it yourself and pass the model object to use another)."""
    values: dict[str, Any] = {}
    for name, value in (kwargs or {}).items():
        if name not in ("dtype", "torch_dtype"):
            raise ConfigError(
                f"GRPOConfig(model_init_kwargs={{{name!r}: ...}}) is not supported: grpolab "
                "loads a named model in model.dtype only; load the model with "
                "AutoModelForCausalLM.from_pretrained(..., "
                f"{name}=...) and pass it as model="
            )
        text = str(value).removeprefix("torch.")
        if text not in DTYPES:
            raise ConfigError(
                f"GRPOConfig(model_init_kwargs={{{name!r}: {value!r}}}): grpolab trains in "
                "float32, bfloat16 or float16 weights (model.dtype); 'auto' has no meaning here"
            )
        values["model.dtype"] = DTYPES[text]
    return values
