"""Keys without effect. `INERT` lists, for every key that some setting of others turns into a
no-op, when it has none and why: the config-wide rules here, and each unit of the objective's
own (grpolab.objective). A given key that has no effect is refused, or yields with a note when
a later layer made it so. The keys not listed act in every setup (docs/ARCHITECTURE.md, "Keys
without effect", names the ones left out and why)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from grpolab.config.sections import LoraConfig, MonitorsConfig
from grpolab.config.tree import Config, ConfigError, ModelConfig, get, with_values
from grpolab.model.policy import PACKAGED_MODELS
from grpolab.objective import PROFILE_YIELDS, PROFILES, UNITS, row_readers
from grpolab.rewards import BUILTIN_REWARDS
from grpolab.rollout.vllm import VLLMEngineConfig
from grpolab.schema import Inert
from grpolab.tasks import GENERATED_TASKS
from grpolab.ways import way


def _local_file(path: str | None) -> bool:
    return bool(path) and (Path(path).suffix.lower() in (".jsonl", ".json", ".csv", ".parquet")
                           or Path(path).expanduser().exists())  # fmt: skip


def _gguf_source(m: ModelConfig) -> bool:
    name = m.name_or_path if isinstance(m.name_or_path, str) else ""  # or a model object
    return name in PACKAGED_MODELS or bool(m.gguf_file) or name.lower().endswith(".gguf")


def _keys(section: str, cls: type, but: tuple[str, ...] = ()) -> tuple[str, ...]:
    return tuple(f"{section}.{f.name}" for f in dataclasses.fields(cls) if f.name not in but)


HF_KEYS = ("rollout.hf.shared_prefill", "rollout.hf.sampler")
ARITHMETIC_KEYS = ("task.min_operand", "task.max_operand", "task.operators")
FILE_TASK_KEYS = ("task.path", "task.eval_path", "task.subset", "task.split", "task.eval_split",
                  "task.prompt_field", "task.answer_field", "task.eval_fraction", "task.rows",
                  "task.eval_rows")  # fmt: skip
GYM_KEYS = ("task.dataset", "task.dataset_config")
EVAL_KEYS = ("eval.eval_steps", "eval.eval_examples", "eval.eval_max_completion_length")

# The objective keys whose loss term reads every row (the units' reads_every_row).
ROW_READER_KEYS = tuple(u.reads_every_row for u in UNITS if u.reads_every_row)

CONFIG_INERT = (
    Inert(("runtime.skip_zero_advantage",), tuple(f"objective.{k}" for k in ROW_READER_KEYS),
          lambda c: bool(row_readers(c.objective)),
          "with " + ", ".join(f"objective.{k}={{c.objective.{k}:g}}" for k in ROW_READER_KEYS)
          + ": a loss term that reads every row (the KL term, the entropy bonus) is on, so "
          "none is skipped"),
    Inert(_keys("rollout.vllm", VLLMEngineConfig), ("rollout.engine",),
          lambda c: c.rollout.engine != "vllm",
          "with rollout.engine={c.rollout.engine}: it configures the vLLM engine"),
    Inert(("rollout.sync_tolerance",), ("rollout.engine", "runtime.precision"),
          lambda c: c.rollout.engine != "vllm" and c.runtime.precision == "fp32",
          "with rollout.engine={c.rollout.engine} and runtime.precision=fp32: the engine "
          "samples with the trainer's own weights, there is no copy to check"),
    Inert(HF_KEYS, ("rollout.engine",), lambda c: c.rollout.engine != "hf",
          "with rollout.engine={c.rollout.engine}: it configures the hf engine's decode loop"),
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
    Inert(FILE_TASK_KEYS, ("task.name",), lambda c: c.task.name in GENERATED_TASKS,
          "with task.name={c.task.name}: its problems are generated, not read from rows"),
    Inert(GYM_KEYS, ("task.name",), lambda c: c.task.name != "reasoning_gym",
          "with task.name={c.task.name}: it picks reasoning-gym's generators"),
    Inert(("task.dataset_config",), ("task.dataset",),
          lambda c: c.task.name == "reasoning_gym" and isinstance(c.task.dataset, list | tuple),
          "with a list as task.dataset: each listed generator takes its own config"),
    Inert(("task.subset", "task.split", "task.eval_split"), ("task.path",),
          lambda c: c.task.name not in GENERATED_TASKS and _local_file(c.task.path),
          "with a local file as task.path: it picks a Hugging Face dataset's config or split "
          "(a local held-out file is task.eval_path)"),
    Inert(("task.subset", "task.split"), ("task.rows",),
          lambda c: c.task.name not in GENERATED_TASKS and isinstance(c.task.rows, list),
          "with rows given in Python (task.rows): it picks a Hugging Face dataset's config or "
          "split"),
    Inert(("task.eval_fraction",), ("task.eval_path", "task.eval_split", "task.eval_rows"),
          lambda c: bool(c.task.eval_path or c.task.eval_split or c.task.eval_rows),
          "with a separate held-out set (task.eval_path / task.eval_split / task.eval_rows)"),
    Inert(("task.system_prompt",), ("task.chat_template",), lambda c: not c.task.chat_template,
          "with task.chat_template=false: a plain prompt has no system turn"),
    Inert(("runtime.shared_prefix",), ("runtime.logprobs",),
          lambda c: c.runtime.logprobs == "naive",
          "with runtime.logprobs=naive: it is the fused path's (one forward per row here)"),
    Inert(_keys("lora", LoraConfig, but=("r",)), ("lora.r",), lambda c: c.lora.r == 0,
          "with lora.r=0 (full fine-tuning, no adapters)"),
    Inert(("eval.eval_steps", "eval.eval_max_completion_length"),
          ("eval.eval_examples",), lambda c: c.eval.eval_examples == 0,
          "with eval.eval_examples=0: no held-out evaluation runs"),
    Inert(EVAL_KEYS, ("task.num_eval", "task.eval_path", "task.eval_split", "task.eval_fraction",
                      "task.eval_rows"),
          lambda c: c.task.num_eval == 0 and not (c.task.eval_path or c.task.eval_split
                                                  or c.task.eval_fraction or c.task.eval_rows),
          "with task.num_eval=0: the task holds no held-out problems"),
    Inert(("logging.log_completions_count",), ("logging.log_completions_steps",),
          lambda c: c.logging.log_completions_steps == 0,
          "with logging.log_completions_steps=0: no completions are logged"),
    Inert(_keys("monitors", MonitorsConfig, but=("action", "max_consecutive_nonfinite",
                                                 "max_consecutive_reward_failures")),
          ("monitors.action",), lambda c: c.monitors.action == "off",
          "with monitors.action=off"),
    Inert(("parallel.ddp_bucket_mb",), ("parallel.strategy",),
          lambda c: c.parallel.strategy == "fsdp",
          "with parallel.strategy=fsdp: it sizes DDP's gradient buckets"),
)  # fmt: skip
# Every key that some setting of others turns into a no-op: the config's and the units'.
INERT = CONFIG_INERT + tuple(rule for unit in UNITS for rule in unit.inert)

DEFAULTS = Config()


def baseline(cfg: Config, key: str) -> Any:
    """What `key` holds when no file or override gives it: the profile's convention (unless
    it yielded, PROFILE_YIELDS), else the default."""
    section, _, name = key.partition(".")
    o = cfg.objective
    if section == "objective" and name in PROFILES.get(o.profile, {}):
        yields = any(k == name and when(o) for k, when, _ in PROFILE_YIELDS)
        if not yields:
            return PROFILES[o.profile][name]
    return get(DEFAULTS, key)


def yield_or_refuse_inert(
    cfg: Config, given: dict[str, int]
) -> tuple[Config, list[str], list[str]]:
    """Each given key that `INERT` says has no effect is set back to its baseline (which
    changes nothing, by definition): with a note when a later layer made it inert (a file's
    key under an override's choice), else with a warning, or refused (ConfigError) under
    `strict`. Values equal to the baseline are never flagged. Returns (cfg, notes, warnings)."""
    notes, warnings, values = [], [], {}
    for rule in INERT:
        if not rule.when(cfg):
            continue
        for key in rule.keys:
            value = get(cfg, key)
            if key not in given or value == baseline(cfg, key):
                continue
            why = "has no effect " + rule.why.format(c=cfg)
            later = [c for c in rule.causes if given.get(c, -1) > given[key]]
            if not later and cfg.strict:
                raise ConfigError(f"{key}={value!r} {why}; remove it (strict refuses it)")
            values[key] = baseline(cfg, key)
            if later:
                notes.append(f"{key}={value!r} not applied: it {why} ({later[0]} given after it)")
            else:
                warnings.append(f"{key}={value!r} {why}: ignored ({way('strict')} refuses it)")
    return with_values(cfg, values), notes, warnings
