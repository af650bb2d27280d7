"""Checkpoints: Hugging Face weights + optimizer, scheduler, RNG and data position and the
run's config, written atomically (temporary directory, then rename) with a manifest of
every file, so a crash never leaves a half checkpoint as the latest one and a file damaged
later is found before a resume trusts it. A LoRA (peft) policy is saved merged, so
transformers and vLLM load the checkpoint as a plain model, with its adapter in adapter/
for resuming. `save_run` / `restore` write and read a whole run's state."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers
import yaml

from grpolab.config import Config, run_changes, to_yaml
from grpolab.model import dist as dist_module
from grpolab.model.lora import is_lora, load_lora_adapter
from grpolab.model.policy import load_policy, save_policy
from grpolab.train.setup import Run
from grpolab.ways import way

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# Written last, inside the temporary directory, before the rename: the step and the size and
# SHA-256 of every other file, so a file damaged later (a full disk, a copy cut short) is
# found before a resume trusts it.
COMPLETE = "COMPLETE"
RUN_CONFIG = "config.yaml"  # the config the checkpoint was trained with
TRAINER_STATE = "trainer_state.pt"
STATE_JSON = "trainer_state.json"
ADAPTER_DIR = "adapter"  # a LoRA run's adapter weights and config (peft's layout)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    tokenizer,
    extra: dict[str, Any],
    state: dict[str, Any],
    save_total_limit: int | None = None,
    config_yaml: str | None = None,
) -> Path:
    """Write checkpoint-{step}: weights (safetensors; LoRA: merged, plus adapter/) + tokenizer
    + `extra` (optimizer, scheduler, RNG and data states, torch-saved) + `state` (JSON) + the
    run's config (`config_yaml`). Returns its path. Interrupted (an exception, Ctrl-C), it
    leaves no temporary directory behind."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / f".tmp-checkpoint-{step}"
    try:
        return _save(output_dir, tmp, step, model, tokenizer, extra, state, save_total_limit,
                     config_yaml)  # fmt: skip
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save(output_dir, tmp, step, model, tokenizer, extra, state, save_total_limit, config_yaml):
    final = output_dir / f"checkpoint-{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    if hasattr(model, "merge_and_unload"):  # peft: merge on a copy, the policy keeps training
        save_policy(copy.deepcopy(model).merge_and_unload(), tokenizer, tmp)
        model.save_pretrained(tmp / ADAPTER_DIR, safe_serialization=True)
    else:
        save_policy(model, tokenizer, tmp)
    torch.save(extra, tmp / TRAINER_STATE)
    (tmp / STATE_JSON).write_text(json.dumps({"step": step, **state}, indent=2))
    if config_yaml is not None:
        (tmp / RUN_CONFIG).write_text(config_yaml)
    _write_synced(tmp / COMPLETE, json.dumps({"step": step, "files": _manifest(tmp)}, indent=1))
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (e.g. a final save right after a periodic one)
        old = output_dir / f".old-checkpoint-{step}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(output_dir)
    prune_checkpoints(output_dir, save_total_limit)
    return final


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for p in output_dir.iterdir():
        m = CHECKPOINT_RE.match(p.name)
        if m and p.is_dir() and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def checkpoint_step(path: str | Path) -> int | None:
    """The step a checkpoint holds: its COMPLETE marker's, else its name's (checkpoint-N)."""
    path = Path(path)
    try:
        return int(json.loads((path / COMPLETE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        match = CHECKPOINT_RE.match(path.name)
        return int(match.group(1)) if match else None


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def prune_checkpoints(output_dir: str | Path, keep: int | None) -> None:
    """Delete all but the newest `keep` checkpoints. A process killed between a save and its
    prune leaves one extra, which the next save removes. Each goes out of the listing by an
    atomic rename first, so a deletion cut short never leaves a half-deleted checkpoint
    marked complete."""
    if keep is None:
        return
    output_dir = Path(output_dir)
    for p in list_checkpoints(output_dir)[:-keep]:
        trash = output_dir / f".deleting-{p.name}"
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(p, trash)
        shutil.rmtree(trash)
    for leftover in output_dir.glob(".deleting-checkpoint-*"):  # cut short earlier
        shutil.rmtree(leftover, ignore_errors=True)


def _manifest(directory: Path) -> dict[str, list]:
    """{relative path: [size, sha256]} of every file below `directory`."""
    return {
        str(f.relative_to(directory)): [f.stat().st_size, _sha256(f)]
        for f in sorted(directory.rglob("*"))
        if f.is_file() and f.name != COMPLETE
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def damage(path: str | Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, or None when every file its COMPLETE
    manifest lists is there with its size and hash. (A checkpoint written before manifests
    existed is only checked for its marker.)"""
    path = Path(path)
    marker = path / COMPLETE
    if not marker.is_file():
        return f"no {COMPLETE} marker (a save that did not finish)"
    try:
        files = json.loads(marker.read_text()).get("files", {})
    except (json.JSONDecodeError, AttributeError):
        return None  # a plain step number: the marker of an older grpolab
    for name, (size, digest) in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
        if _sha256(f) != digest:
            return f"{name} differs from what was written (SHA-256 mismatch)"
    return None


class DamagedCheckpoint(ValueError):
    """The checkpoint a resume asked for is damaged; the message names it and what to do."""


def resume_point(
    output_dir: str | Path, given: str | Path | None
) -> tuple[Path, list[tuple[Path, str]]]:
    """The checkpoint to resume from, and the damaged newer ones passed over (path, why).

    given None: the newest intact checkpoint in `output_dir` (a damaged newer one is passed
    over and named, never used). given a path: that checkpoint, or DamagedCheckpoint naming
    what is wrong and the newest intact one to use instead."""
    if given is not None:
        path = Path(given)
        if not path.is_dir():
            raise FileNotFoundError(f"{way('resume')} {str(path)!r}: no such checkpoint directory")
        why = damage(path)
        if why is None:
            return path, []
        older = [p for p in list_checkpoints(path.parent) if p != path and damage(p) is None]
        offer = ""
        if older:
            offer = f"; the newest intact one is {older[-1]}: {way('resume_path', older[-1])}"
        raise DamagedCheckpoint(f"checkpoint {str(path)!r} is damaged: {why}{offer}")
    damaged = []
    for path in reversed(list_checkpoints(output_dir)):
        why = damage(path)
        if why is None:
            return path, damaged
        damaged.append((path, why))
    listed = "; ".join(f"{p.name}: {why}" for p, why in damaged)
    raise FileNotFoundError(
        f"{way('resume')}: no intact checkpoint in output_dir={str(output_dir)!r}"
        + (f" (damaged: {listed})" if damaged else "")
    )


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of the listing (kept for inspection, never pruned or
    resumed from): checkpoint-N -> damaged-checkpoint-N."""
    target = path.with_name(f"damaged-{path.name}")
    if target.exists():
        shutil.rmtree(target)
    os.replace(path, target)
    return target


def load_checkpoint(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer, extra, state) from a complete checkpoint directory."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a complete grpolab checkpoint (no {COMPLETE} marker)"
        )
    try:
        extra = load_trainer_state(path / TRAINER_STATE)
        model, tokenizer = load_policy(path, dtype=dtype, device=device)
        state = json.loads((path / STATE_JSON).read_text())
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # whatever a damaged file raises (safetensors, pickle, JSON, OS)
        raise DamagedCheckpoint(
            f"checkpoint {str(path)!r} cannot be read ({type(e).__name__}: {e}); resume from "
            f"an earlier one with {way('resume_path', 'PATH')}"
        ) from None
    return model, tokenizer, extra, state


class UnsafeCheckpoint(DamagedCheckpoint):
    """A checkpoint file holds objects that loading would have to run code to rebuild."""


def load_trainer_state(path: Path) -> dict[str, Any]:
    """trainer_state.pt as data: tensors, numbers, strings and containers only (what
    `save_run` writes: the optimizer's and scheduler's state dicts, RNG states); a file that
    holds any other object is refused, since unpickling it could run code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))  # torch names the object it refused
        what = f"it asks for {found.group(1)}" if found else "an object that is not data"
        raise UnsafeCheckpoint(
            f"{str(path)!r} holds more than tensors and plain values ({what}): refused, since "
            "loading it could run code; grpolab never writes such a file"
        ) from None


def check_same_model(start: torch.nn.Module, checkpoint_dir: str | Path) -> None:
    """Refuse a checkpoint whose architecture differs from the model the run starts from."""
    saved = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    ours = start.config.to_dict()
    keys = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
    )
    for key in keys:
        if key in saved and key in ours and saved[key] != ours[key]:
            raise ValueError(
                f"checkpoint {str(checkpoint_dir)!r} is from a different model: its {key} is "
                f"{saved[key]!r}, the configured model's is {ours[key]!r}"
            )


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- A whole run's state ----------------------------------------------------------------------


def save_run(run: Run, run_dir: Path, step: int, progress: dict[str, Any]) -> Path:
    """checkpoint-{step} of `run` in `run_dir`; `progress`: the loop's own state (evaluation
    history, wall time, ...), kept in trainer_state.json. Under torchrun every rank takes
    part (whole tensors keyed by name, so the checkpoint loads at any world size) and rank 0
    writes it."""
    model, d = run.model, run.dist
    sharded = dist_module.is_sharded(model)
    weights = dist_module.full_state_dict(model) if sharded else None
    optimizer = (
        dist_module.full_optimizer_state(model, run.optimizer)
        if d.on
        else run.optimizer.state_dict()
    )
    extra = {
        "optimizer": optimizer,
        "scheduler": run.scheduler.state_dict(),
        "data_generator": run.prompt_generator.get_state(),
        "rng": rng_state(),
    }
    state = {
        "skipped_steps": run.skipped_steps,
        "consecutive_nonfinite": run.consecutive_nonfinite,
        **progress,
    }
    path = Path(run_dir) / f"checkpoint-{step}"
    if d.main:
        plain = model if weights is None else unsharded_copy(model, weights)
        limit = run.cfg.checkpoints.save_total_limit
        path = save_checkpoint(
            run_dir, step, plain, run.tokenizer, extra, state, limit, to_yaml(run.cfg)
        )
    dist_module.barrier(d)
    return path


def restore(run: Run, checkpoint_dir: Path) -> tuple[int, dict[str, Any]]:
    """Load a checkpoint's weights, optimizer moments, schedule position, prompt-draw position
    and RNG into `run`; returns (its step, its state). The optimizer's hyperparameters
    (learning rate, betas, weight decay) come from the run's config, so a changed learning
    rate that was allowed reaches the optimizer and the schedule."""
    cfg, model = run.cfg, run.model
    check_same_model(model, checkpoint_dir)
    saved, _, extra, state = load_checkpoint(checkpoint_dir, cfg.model.dtype, str(run.device))
    if is_lora(model):  # the base weights are the start model's; saved holds them merged
        load_lora_adapter(model, checkpoint_dir, ADAPTER_DIR)
    elif (checkpoint_dir / ADAPTER_DIR).is_dir():
        raise ValueError(
            f"{way('resume')} {str(checkpoint_dir)!r}: a LoRA checkpoint; resume it with the "
            "trainer.lora_* settings it was trained with"
        )
    elif dist_module.is_sharded(model):
        dist_module.load_full_model_state(model, saved.state_dict())
    else:
        model.load_state_dict(saved.state_dict())
    del saved
    if dist_module.is_named_optimizer_state(extra["optimizer"]):  # saved by a multi-rank run
        dist_module.load_full_optimizer_state(model, run.optimizer, extra["optimizer"])
    elif dist_module.is_sharded(model):
        raise ValueError(
            f"{way('resume')} {str(checkpoint_dir)!r}: a single-process checkpoint resumes under "
            "parallel.strategy=ddp, not fsdp"
        )
    else:
        run.optimizer.load_state_dict(extra["optimizer"])
    run.scheduler.load_state_dict(extra["scheduler"])
    apply_optimizer_config(run)
    run.prompt_generator.set_state(extra["data_generator"])
    set_rng_state(extra["rng"])
    run.skipped_steps = state.get("skipped_steps", 0)
    run.consecutive_nonfinite = state.get("consecutive_nonfinite", 0)
    run.engine.sync_weights(model)
    return state["step"], state


def apply_optimizer_config(run: Run) -> None:
    """Learning rate, betas and weight decay from the config into the optimizer and the LR
    schedule (a loaded state dict brings the checkpoint's). With an unchanged config this
    rewrites the values they already hold: base_lr * multiplier(step) is the schedule's own
    formula."""
    t = run.cfg.optim
    scheduler = run.scheduler
    scheduler.base_lrs = [t.learning_rate] * len(scheduler.base_lrs)
    for group, multiplier in zip(run.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = t.learning_rate
        group["lr"] = t.learning_rate * multiplier(scheduler.last_epoch)
        group["betas"] = (t.adam_beta1, t.adam_beta2)
        group["weight_decay"] = t.weight_decay
    scheduler._last_lr = [group["lr"] for group in run.optimizer.param_groups]


def unsharded_copy(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain transformers model holding `weights` (a sharded model's full state dict)."""
    plain = transformers.AutoModelForCausalLM.from_config(model.config, dtype=model.dtype)
    plain.load_state_dict(weights)
    plain.generation_config = model.generation_config
    return plain


class ConfigChangedOnResume(ValueError):
    """The config differs from the checkpoint's in keys that change what is trained."""


def resume_config_changes(
    cfg: Config, checkpoint_dir: Path, run_dir: Path, allow: bool
) -> list[tuple[str, Any, Any]]:
    """The run-changing keys in which `cfg` differs from the config `checkpoint_dir` was
    trained with (its own copy, else the run directory's config.yaml). Raises
    ConfigChangedOnResume naming them unless `allow`."""
    for source in (checkpoint_dir / RUN_CONFIG, run_dir / "config.yaml"):
        if source.is_file():
            break
    else:
        return []
    try:
        saved = yaml.safe_load(source.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{source} is not valid YAML: {e}") from None
    changes = run_changes(saved if isinstance(saved, dict) else {}, cfg)
    if changes and not allow:
        listed = ", ".join(f"{k} (was {old!r}, now {new!r})" for k, old, new in changes)
        raise ConfigChangedOnResume(
            f"{way('resume')}: the config differs from {source}'s in keys that change the run: "
            f"{listed}; restore them, or pass {way('allow_config_change')} to apply the new values "
            "from here on (config.yaml and the checkpoints will record them)"
        )
    return changes
