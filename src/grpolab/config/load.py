"""Loading a config: defaults <- a run's config <- a YAML file <- `section.key=value`
overrides, merged key by key with OmegaConf's typed merge; the older names read as the new
ones; the profile applied and the keys without effect refused or yielded; then checked and
frozen. Every error is one line naming the key.

    grpolab train --config examples/demo.yaml optim.learning_rate=1e-6 max_steps=50
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from grpolab.config.inert import yield_or_refuse_inert
from grpolab.config.tree import SECTIONS, Config, ConfigError, check, with_values
from grpolab.config.trl import NO_VALUE, not_a_name, suggest
from grpolab.objective import PROFILE_YIELDS, PROFILES
from grpolab.tasks import GENERATED_NUM_EVAL, GENERATED_TASKS, GivenRows

NULLS = ("null", "none", "~", "")
LEGACY_SECTION = "trainer"  # every key of the training loop lived here before its section
# trainer.autocast, precision's older name, with its own values: off | bf16.
AUTOCAST = ("trainer.autocast", "runtime.precision", {"off": "fp32", "bf16": "bf16"})


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: str | Path | None = None,
    values: dict[str, Any] | None = None,
) -> Config:
    """Defaults (the demo's) <- a run's config at `base` (`grpolab eval` of a checkpoint) <-
    the YAML file at `path` <- `section.key=value` overrides <- `values` ({dotted key: a
    Python value}: the Python API's), merged key by key with OmegaConf's typed merge (a key
    left out keeps the value below it: rollout.max_completion_length stays 6 when only
    rollout.temperature is given); then normalised once (`normalise`) and checked. The
    result is frozen. `values` may hold objects for OBJECT_KEYS (reward callables, rows, a
    loaded model), set as they are after the merge.

    A key that would have no effect in the configured setup is refused (`INERT`), unless a
    later layer made it so (a file's vLLM key under an override rollout.engine=hf): then it
    yields to that choice, as a profile's convention yields to a key it conflicts with, and
    `load_notes(cfg)` says so."""
    schema = OmegaConf.structured(Config)
    layers: list[tuple[str, dict[str, Any]]] = []
    for file in (base, path):
        if file is not None:
            layers.append((f"config file {str(file)!r}", _file_layer(Path(file))))
    layers.append(("overrides", _overrides_layer(overrides or [], schema)))
    objects: dict[str, Any] = {}
    if values:
        layer, objects = _values_layer(values, schema)
        layers.append(("values", layer))
    notes = renamed_note(layers)
    merged: Any = schema
    for where, layer in layers:  # one at a time: an error names the file it came from
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(_literal(_nest(layer))))
        except OmegaConfBaseException as e:
            message = _describe(e, schema)
            given = where in ("overrides", "values")
            raise ConfigError(message if given else f"{where}: {message}") from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e, schema)) from None
    given = _given_keys(layers) | dict.fromkeys(objects, len(layers) - 1)
    cfg, more, warnings = normalise(with_values(cfg, objects), given)
    return with_notes(cfg, notes + more, warnings)


def normalise(cfg: Config, given: dict[str, int]) -> tuple[Config, list[str], list[str]]:
    """The profile applied, the batch keys reconciled, the keys without effect ignored with a
    warning, yielded with a note or (strict) refused, then every key checked: once, at load.
    Returns (cfg, notes, warnings)."""
    cfg, notes = apply_profile(cfg, given)
    cfg, batch = reconcile_batch(cfg, given)
    if cfg.task.num_eval is None and cfg.task.name in GENERATED_TASKS:  # recorded as used
        cfg = with_values(cfg, {"task.num_eval": GENERATED_NUM_EVAL})
    check(cfg, objective=False)  # each key; the objective's rules after the inert ones yield
    cfg, inert, warnings = yield_or_refuse_inert(cfg, given)
    check(cfg)
    return cfg, notes + batch + inert, warnings


def check_values(values: dict[str, Any]) -> None:
    """Each of load_config's `values` names a key and has a value of its type (an object
    where OBJECT_KEYS takes one), ConfigError naming it; the checks between keys wait for
    load_config, when the whole config is known."""
    schema = OmegaConf.structured(Config)
    layer, _ = _values_layer(values, schema)
    try:
        OmegaConf.merge(schema, OmegaConf.create(_literal(_nest(layer))))
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e, schema)) from None


# Keys a Python caller may give objects for (load_config's `values`), set as they are after
# the typed merge; config.yaml records each object by one line (config.resume.to_dict): a
# reward callable by its qualified name, rows (GivenRows) and a loaded model (GivenModel) by
# what they are. Rows never go through the merge, whatever they hold.
OBJECT_KEYS = ("rewards.functions", "model.name_or_path", "task.rows", "task.eval_rows")
ROW_KEYS = ("task.rows", "task.eval_rows")


def _values_layer(values: dict[str, Any], schema: DictConfig) -> tuple[dict, dict]:
    """(the layer of plain values, the objects of OBJECT_KEYS), under the keys' current
    names; an unknown key is refused with the did-you-mean."""
    layer: dict[str, Any] = {"__renamed__": []}
    objects: dict[str, Any] = {}
    for given, value in values.items():
        if given == AUTOCAST[0]:
            key, value = AUTOCAST[1], _autocast_value(value, "")
        else:
            key = canonical(given)
        if key != given:
            layer["__renamed__"].append(given if given != AUTOCAST[0] else f"{given} -> {key}")
        _check_known(key, value)
        if isinstance(value, Path):
            value = str(value)
        if key in ROW_KEYS and value is not None and not isinstance(value, str):
            objects[key] = value if hasattr(value, "label") else GivenRows(value, key)
        elif key in OBJECT_KEYS and not _plain(value):
            objects[key] = value
        else:
            if isinstance(OmegaConf.select(schema, key, throw_on_missing=False), DictConfig):
                raise ConfigError(f"{key} is a section, not a value: set its keys ({key}.<key>)")
            layer[key] = value
    return layer, objects


def _plain(value: Any) -> bool:
    """Data the typed merge can hold: scalars, and lists and dicts of them."""
    if value is None or isinstance(value, str | int | float | bool):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _check_known(key: str, value: Any = NO_VALUE) -> None:
    """A key no field declares is refused in one line, with the likeliest key it means."""
    tp: Any = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(tp):
            return  # below a free-form field: the merge decides
        hints = typing.get_type_hints(tp)
        if part not in hints:
            raise ConfigError(unknown_key(key, value))
        tp = hints[part]


def unknown_key(key: str, value: Any = NO_VALUE) -> str:
    """The one line for a key no field declares, with the did-you-mean the Python API's
    GRPOConfig also gives (config.trl.suggest): a close key of its section, the full name of
    a leaf (learning_rate -> optim.learning_rate), a misspelt one, a TRL name's key (bf16=true
    -> runtime.precision=bf16)."""
    section, _, name = key.rpartition(".")
    if not section:
        return f"unknown key {key}: {not_a_name(key, value=value)}"
    node = _field_type(section)
    valid = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    if close:
        return f"unknown key {key}: did you mean {section}.{close[0]}?"
    elsewhere = suggest(name, value)
    if elsewhere is not None and not elsewhere.why:
        return f"unknown key {key}: did you mean {elsewhere.key}?"
    return f"unknown key {key}; valid keys in {section}: {valid}"


# --- What loading noted --------------------------------------------------------------------------

NOTES = "_load_notes"  # what loading set aside, kept on the instance (not a config key)
WARNINGS = "_load_warnings"  # what loading ignored: keys given that have no effect


def with_notes(cfg: Config, notes: list[str], warnings: list[str] | None = None) -> Config:
    object.__setattr__(cfg, NOTES, tuple(notes))
    object.__setattr__(cfg, WARNINGS, tuple(warnings or ()))
    return cfg


def load_warnings(cfg: Config) -> list[str]:
    """The keys the user gave that have no effect under the rest of the config (ignored; a
    strict config refuses them), one line each: printed at start, on the objective card and
    in preflight.json."""
    return list(getattr(cfg, WARNINGS, ()))


def load_notes(cfg: Config) -> list[str]:
    """What load_config set aside: the older names read as the new ones, a profile's
    convention or a file's key that yielded to a key given later, one line each (the run's
    log and the objective card print them)."""
    return list(getattr(cfg, NOTES, ()))


def replaced(cfg: Config, values: dict[str, Any]) -> Config:
    """`with_values`, the notes and warnings kept."""
    return with_notes(with_values(cfg, values), load_notes(cfg), load_warnings(cfg))


# --- The older names -----------------------------------------------------------------------------


@functools.cache
def aliases() -> dict[str, str]:
    """{older dotted key: its key now}: each field's declared `legacy` name, and for the
    sections that were one `trainer` section before, trainer.<name> for the rest."""
    out: dict[str, str] = {}

    def walk(tp: Any, prefix: str, section: str) -> None:
        for f in dataclasses.fields(tp):
            sub = _default(f)
            if dataclasses.is_dataclass(sub):
                walk(type(sub), f"{prefix}{f.name}.", section)
                continue
            legacy = f.metadata.get("legacy")
            if legacy is None and section in TRAINER_SECTIONS_NOW:
                legacy = f"{LEGACY_SECTION}.{f.name}"
            if legacy is not None:
                out[legacy] = f"{prefix}{f.name}"

    for f in dataclasses.fields(Config):
        sub = _default(f)
        if dataclasses.is_dataclass(sub):
            walk(type(sub), f"{f.name}.", f.name)
    return out


# The sections the training loop's keys moved to (their older names: trainer.<name>).
TRAINER_SECTIONS_NOW = ("batch", "objective", "optim", "schedule", "logging", "checkpoints",
                        "eval", "monitors", "runtime", "parallel", "lora")  # fmt: skip


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def canonical(key: str) -> str:
    """The key `key` names now: itself, or its new name when it is an older one (an older
    name that is no key at all is refused with the closest key)."""
    if key in aliases():
        return aliases()[key]
    if key == AUTOCAST[0]:
        return key
    if key.startswith(f"{LEGACY_SECTION}."):
        name = key.partition(".")[2]
        names = [k.partition(".")[2] for k in aliases() if k.startswith(f"{LEGACY_SECTION}.")]
        close = difflib.get_close_matches(name, names, n=1)
        if close:
            raise ConfigError(
                f"unknown key {key}: did you mean {aliases()[f'{LEGACY_SECTION}.{close[0]}']}?"
            )
        raise ConfigError(
            f"unknown key {key}; the {LEGACY_SECTION} section's keys are now in "
            f"{', '.join(TRAINER_SECTIONS_NOW)}"
        )
    return key


def renamed_note(layers: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """One note naming the older keys the layers used (read as their new names)."""
    old = sorted({k for _, layer in layers for k in layer.get("__renamed__", ())})
    for _, layer in layers:
        layer.pop("__renamed__", None)
    if not old:
        return []
    said = [k if " -> " in k else f"{k} -> {canonical(k)}" for k in old]
    return ["older key names read as their new ones: " + ", ".join(said)]


def _autocast_renamed(given: Any, where: str) -> tuple[str, str]:
    """(runtime.precision's value, the note's entry) of trainer.autocast=given."""
    value = _autocast_value(given, where)
    return value, f"{AUTOCAST[0]}={given} -> {AUTOCAST[1]}={value}"


def _renamed(flat: dict[str, Any], where: str) -> dict[str, Any]:
    """`flat` with every older key under its new name (`__renamed__`: the older ones used);
    an older and a new name of one key in the same layer must agree."""
    out: dict[str, Any] = {}
    renamed: list[str] = []
    given_as: dict[str, tuple[str, str]] = {}
    for key, value in flat.items():
        new, entry, shown = canonical(key), key, f"{key}={value!r}"
        if key == AUTOCAST[0]:
            new = AUTOCAST[1]
            value, entry = _autocast_renamed({False: "off"}.get(value, value), where)
        if new != key:
            renamed.append(entry)
        if new in out and out[new] != value:
            _disagree(given_as[new], (key, shown), new, f"{where}: ")
        out[new], given_as[new] = value, (key, shown)
    out["__renamed__"] = renamed
    return out


def _autocast_value(value: Any, where: str) -> str:
    value = {False: "off"}.get(value, value)  # YAML reads a bare off as false
    if value not in AUTOCAST[2]:
        place = f"{where}: " if where else ""
        raise ConfigError(f"{place}{AUTOCAST[0]}={value!r}: expected off or bf16")
    return AUTOCAST[2][value]


# --- The profile and the batch ----------------------------------------------------------------


def apply_profile(cfg: Config, given: dict[str, int]) -> tuple[Config, list[str]]:
    """Each convention of objective.profile onto the objective keys no layer gave, except
    those a given key conflicts with (PROFILE_YIELDS); a note for each of those."""
    o = cfg.objective
    if o.profile not in PROFILES:
        raise ConfigError(f"objective.profile={o.profile!r}: expected one of {list(PROFILES)}")
    notes, values = [], {}
    default = type(o)()
    for name, value in PROFILES[o.profile].items():
        if f"objective.{name}" in given:
            continue
        why = next((why(o) for k, when, why in PROFILE_YIELDS if k == name and when(o)), None)
        if why is not None:
            if value != getattr(default, name):
                notes.append(
                    f"profile {o.profile}'s {name}={value!r} not applied: objective.loss_type="
                    f"{o.loss_type} ({why})"
                )
            continue
        values[f"objective.{name}"] = value
    return with_values(cfg, values), notes


def reconcile_batch(cfg: Config, given: dict[str, int]) -> tuple[Config, list[str]]:
    """batch.generation_batch_size sets prompts_per_step: both given, they must agree, unless
    prompts_per_step came from an earlier layer (a file's, under an override
    generation_batch_size): then it yields, and the note says so."""
    b = cfg.batch
    gbs, pps = "batch.generation_batch_size", "batch.prompts_per_step"
    if b.generation_batch_size is None:
        return cfg, []
    G = b.num_generations
    values = {pps: b.generation_batch_size // G} if b.generation_batch_size % G == 0 else {}
    if pps not in given or b.generation_batch_size == b.size:
        return with_values(cfg, values), []
    why = (
        f"{gbs}={b.generation_batch_size} and {pps}={b.prompts_per_step} disagree (with "
        f"num_generations={G} that batch is {b.size})"
    )
    if given[pps] >= given.get(gbs, -1):
        raise ConfigError(f"{why}: give one of them")
    return with_values(cfg, values), [f"{why}: {pps} not applied ({gbs} set afterwards)"]


# --- Layers -------------------------------------------------------------------------------------


def _given_keys(layers: list[tuple[str, dict[str, Any]]]) -> dict[str, int]:
    """{dotted key: the level of the last layer that gave it}."""
    given: dict[str, int] = {}
    for level, (_, layer) in enumerate(layers):
        for key in layer:
            if key != "__renamed__":
                given[key] = level
                given[_field_key(key)] = level  # task.dataset_config.min_terms: its field
    return given


def _field_key(key: str) -> str:
    """The declared field a dotted key is (or lies below: a key inside a mapping field such
    as task.dataset_config)."""
    tp: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(tp):
            return ".".join(parts[:i])
        tp = typing.get_type_hints(tp).get(part)
    return key


def _file_layer(path: Path) -> dict[str, Any]:
    """A YAML file's keys, flat and under their current names."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    sections = (*SECTIONS, LEGACY_SECTION)
    # A section whose keys are all commented out reads as null: it keeps its defaults.
    tree = {k: v for k, v in (loaded or {}).items() if not (v is None and k in sections)}
    for section in sections:
        if not isinstance(tree.get(section, {}), dict):
            raise ConfigError(f"{section} must be a mapping of keys, got {tree[section]!r}")
    layer = _renamed(flatten(tree), f"config file {str(path)!r}")
    for key, value in layer.items():
        if key != "__renamed__":
            try:
                _check_known(key, value)
            except ConfigError as e:
                raise ConfigError(f"config file {str(path)!r}: {e}") from None
    for key, value in layer.items():  # a YAML scalar where a list goes: say how to write it
        scalar = value is not None and not isinstance(value, list | dict)
        if key != "__renamed__" and scalar and _accepts(_field_type(key), list):
            raise ConfigError(f"config file {str(path)!r}: {key} is a list: write [{value}]")
    return layer


def _overrides_layer(items: list[str], schema: DictConfig) -> dict[str, Any]:
    """The overrides, one layer (given in any order), under the keys' current names; an older
    and a new name of one key must agree."""
    layer: dict[str, Any] = {"__renamed__": []}
    given_as: dict[str, tuple[str, str]] = {}  # key -> (the name given, the item as given)
    for item in items:
        old, key, value = _override(item, schema)
        if key in layer and layer[key] != value and given_as[key][0] != old:  # one name: last
            _disagree(given_as[key], (old, item.strip()), key, "")
        layer[key], given_as[key] = value, (old, item.strip())
        if old == AUTOCAST[0]:
            layer["__renamed__"].append(_autocast_renamed(item.partition("=")[2].strip(), "")[1])
        elif old != key:
            layer["__renamed__"].append(old)
    return layer


def _disagree(first: tuple[str, str], second: tuple[str, str], key: str, where: str) -> None:
    """One key given twice in one layer, under its older and its new name, two values:
    each (the name given, the key=value as given)."""
    said = [shown + (f" (now {key})" if name != key else "") for name, shown in (first, second)]
    raise ConfigError(f"{where}{said[0]} and {said[1]} disagree: give {key} alone")


def _override(item: str, schema: DictConfig) -> tuple[str, str, Any]:
    """(the key as given, its current name, the value) of one `section.key=value` override. A
    string field takes the text as it is; any other field reads it as YAML; a list field also
    takes comma-separated items or a single one (logging.report_to=tensorboard,wandb)."""
    given, sep, raw = item.partition("=")
    given = given.strip()
    if not sep or not given or any(not part for part in given.split(".")):
        raise ConfigError(f"override {item!r} must look like section.key=value")
    if given == AUTOCAST[0]:
        return given, AUTOCAST[1], _autocast_value(raw.strip(), "")
    key = canonical(given)
    _check_known(key, _yaml_or_text(raw))
    try:
        node = OmegaConf.select(schema, key, throw_on_missing=False)
    except OmegaConfBaseException:
        node = None
    if isinstance(node, DictConfig):
        raise ConfigError(f"{key} is a section, not a value: set its keys ({key}.<key>=...)")
    field_type, bare = _field_type(key), raw.strip()
    if bare.lower() in NULLS and _optional(field_type):
        return given, key, None
    if _accepts(field_type, str):
        return given, key, raw
    if _accepts(field_type, list) and not bare.startswith("["):
        bare = f"[{bare}]"  # a, b, c or a single item: the list of them
    try:
        return given, key, yaml.safe_load(bare)
    except yaml.YAMLError:
        raise ConfigError(f"{key}={raw!r} is not a valid value") from None


def _yaml_or_text(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


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


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"objective": {"beta": 0}} -> {"objective.beta": 0}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{"objective.beta": 0} -> {"objective": {"beta": 0}}."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        if key == "__renamed__":
            continue
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


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
    """OmegaConf's error on one line, naming the key (an unknown one with `unknown_key`)."""
    key = getattr(error, "full_key", None) or ""
    message = (getattr(error, "msg", None) or str(error)).strip().splitlines()[0]
    if isinstance(error, ConfigKeyError) and schema is not None and key:
        return unknown_key(key)
    return f"{key}: {message}" if key else message
