"""Comparing finished training runs on disk."""

import json
from pathlib import Path

import torch

from grpolab.model.policy import load_policy
from grpolab.train.checkpoint import latest_checkpoint
from grpolab.train.loop import train

TIME_KEYS = ("time/", "tokens_per_s")  # wall-clock metrics: never equal between two runs


def metric_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl of a run, without the wall-clock metrics."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(r).items() if not k.startswith(TIME_KEYS)} for r in lines]


def assert_same_run(a: Path, b: Path, steps: int) -> None:
    """Two runs ended with bit-identical weights after the same logged metrics, step by step."""
    model_a, _ = load_policy(latest_checkpoint(a))
    model_b, _ = load_policy(latest_checkpoint(b))
    pairs = zip(model_a.state_dict().items(), model_b.state_dict().values(), strict=True)
    for (name, pa), pb in pairs:
        assert torch.equal(pa, pb), name
    rows_a, rows_b = metric_rows(a), metric_rows(b)
    assert rows_a == rows_b and len(rows_b) == steps


def assert_resumed_is_straight(make_config, tmp_path: Path, *extra: str, stop_at: int, steps: int):
    """A run stopped after step `stop_at` and resumed from its checkpoint ends as the straight
    run in tmp_path / "straight" (the same config, `steps` steps) ended, bit for bit.
    make_config(tmp_path, *overrides, name=...) builds the config of a run in tmp_path / name.
    No preflight: it samples with its own generators, so the run is the same without it."""
    stopped = make_config(tmp_path, *extra, f"max_steps={stop_at}", name="resumed")
    train(stopped, skip_preflight=True)
    resumed = make_config(tmp_path, *extra, f"max_steps={steps}", name="resumed")
    train(resumed, resume=True, skip_preflight=True)
    assert_same_run(tmp_path / "straight", tmp_path / "resumed", steps=steps)
