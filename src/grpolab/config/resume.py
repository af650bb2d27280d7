"""A run's config written down (`to_dict`, `to_yaml`: config.yaml) and compared with the one a
resumed run brings (`run_changes`): the keys whose fields say a resume may change them
(`resume_free`: how the same maths is computed, what is logged and kept) change freely; any
other change is named."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import yaml

from grpolab.config.load import AUTOCAST, OBJECT_KEYS, canonical, flatten, load_config
from grpolab.config.tree import Config, ConfigError, get, with_values


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain data; a reward function given as a callable (the Python API) is
    recorded by its qualified name, "module:qualname", the syntax rewards.functions reads, a
    reward model by its directory or hub id, rows and a loaded model given in Python by a line
    saying so (their `record`: read back, it says they are not on disk)."""
    if isinstance(cfg, Config):
        recorded = {k: get(cfg, k).record() for k in OBJECT_KEYS
                    if hasattr(get(cfg, k), "record")}  # fmt: skip
        cfg = with_values(cfg, recorded)
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


@functools.cache
def default_config() -> Config:
    """The defaults as a run resolves them (load_config with nothing given)."""
    return load_config()


def differences_from_defaults(cfg: Config) -> list[tuple[str, Any]]:
    """(dotted key, value) of every key whose value is not the default: what a run's console
    shows (config.yaml holds them all)."""
    default = flatten(to_dict(default_config()))
    return [(k, v) for k, v in flatten(to_dict(cfg)).items() if default.get(k, v) != v
            or k not in default]  # fmt: skip


def resume_free_keys(tp: Any = Config, prefix: str = "") -> set[str]:
    """Every dotted key whose field says a resumed run may change it."""
    free = set()
    for f in dataclasses.fields(tp):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            free |= resume_free_keys(type(default), f"{prefix}{f.name}.")
        elif f.metadata.get("resume_free"):
            free.add(f"{prefix}{f.name}")
    return free


def _current(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config's keys under their current names (a run saved before the sections)."""
    out = {}
    for key, value in flatten(saved).items():
        try:
            out[canonical(key) if key != AUTOCAST[0] else AUTOCAST[1]] = value
        except ConfigError:  # a key since removed: nothing now to compare it with
            continue
    return out


def run_changes(saved: dict[str, Any], cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) for every key of `cfg` that differs from the config a
    checkpoint was trained with (`saved`, as to_dict wrote it) and changes what the training
    steps compute. max_steps counts as such only when the LR schedule depends on it."""
    new = flatten(to_dict(cfg))
    old = _current(saved)
    free = resume_free_keys()
    if cfg.schedule.lr_scheduler == "constant" and old.get("schedule.lr_scheduler") == "constant":
        free.add("max_steps")
    return [
        (key, old.get(key), value)
        for key, value in new.items()
        if key not in free and key in old and old[key] != value
    ]
