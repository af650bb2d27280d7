"""Checkpoints: Hugging Face weights + optimizer, scheduler, RNG and data position, written
atomically (temporary directory, then rename), so a crash never leaves a half checkpoint
as the latest one. A LoRA (peft) policy is saved merged, so transformers and vLLM load the
checkpoint as a plain model, with its adapter in adapter/ for resuming."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from grpolab.models import load_policy, save_policy

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
            raise FileNotFoundError(f"--resume {str(path)!r}: no such checkpoint directory")
        why = damage(path)
        if why is None:
            return path, []
        older = [p for p in list_checkpoints(path.parent) if p != path and damage(p) is None]
        offer = f"; the newest intact one is {older[-1]}: --resume {older[-1]}" if older else ""
        raise DamagedCheckpoint(f"checkpoint {str(path)!r} is damaged: {why}{offer}")
    damaged = []
    for path in reversed(list_checkpoints(output_dir)):
        why = damage(path)
        if why is None:
            return path, damaged
        damaged.append((path, why))
    listed = "; ".join(f"{p.name}: {why}" for p, why in damaged)
    raise FileNotFoundError(
        f"--resume: no intact checkpoint in output_dir={str(output_dir)!r}"
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
        model, tokenizer = load_policy(path, dtype=dtype, device=device)
        extra = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
        state = json.loads((path / STATE_JSON).read_text())
    except Exception as e:  # whatever a damaged file raises (safetensors, pickle, JSON, OS)
        raise DamagedCheckpoint(
            f"checkpoint {str(path)!r} cannot be read ({type(e).__name__}: {e}); resume from "
            "an earlier one with --resume PATH"
        ) from None
    return model, tokenizer, extra, state


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
