"""The config: one frozen tree of small typed sections, loaded once from defaults, a YAML file
and `section.key=value` overrides, normalised (the profile, the batch keys, the keys without
effect) and checked at load, never changed after.

    tree.py      Config and its sections' places; objective_of (the Objective record, built
                 once per run); check; with_values; the data-parallel and skipping rules
    sections.py  the training loop's sections: batch, optim, schedule, logging, checkpoints,
                 eval, monitors, runtime, parallel, lora (objective: grpolab.objective; model
                 here; task, rewards, rollout: their modules)
    load.py      layers, overrides, the older names (trainer.<key>, rollout.vllm_<key>, ...),
                 the profile, notes
    inert.py     keys without effect: refused, or yielding to a later layer
    trl.py       TRL's GRPOConfig names: what each means here; the one did-you-mean
    resume.py    config.yaml, and what a resumed run may change
"""

from grpolab.config.inert import INERT, baseline
from grpolab.config.load import (
    aliases,
    canonical,
    check_values,
    flatten,
    load_config,
    load_notes,
    load_warnings,
    replaced,
)
from grpolab.config.resume import (
    differences_from_defaults,
    resume_free_keys,
    run_changes,
    to_dict,
    to_yaml,
)
from grpolab.config.sections import (
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
from grpolab.config.tree import (
    SECTIONS,
    Config,
    ConfigError,
    ModelConfig,
    check,
    get,
    objective_of,
    skips_zero_advantage,
    validate_world,
    with_values,
)

__all__ = [
    "INERT",
    "SECTIONS",
    "BatchConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "EvalConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "MonitorsConfig",
    "OptimConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "ScheduleConfig",
    "aliases",
    "baseline",
    "canonical",
    "check",
    "check_values",
    "differences_from_defaults",
    "flatten",
    "get",
    "load_config",
    "load_notes",
    "load_warnings",
    "objective_of",
    "replaced",
    "resume_free_keys",
    "run_changes",
    "skips_zero_advantage",
    "to_dict",
    "to_yaml",
    "validate_world",
    "with_values",
]
