"""Checkpoints are atomic: a save killed at any moment leaves the previous one loadable."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model
from grpolab.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

SPEC = TinyModelSpec(hidden_size=64, num_heads=2, num_layers=2)

# Saves checkpoint 1, 2, 3, ... forever; checkpoint k holds weights, optimizer blob and
# state all equal to k, so a loaded checkpoint can be checked for internal consistency.
SAVER = textwrap.dedent(
    """
    import sys, torch
    from grpolab.train.checkpoint import save_checkpoint
    from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model
    tok = build_char_tokenizer("0123456789")
    model = build_tiny_model(tok, TinyModelSpec(hidden_size=64, num_heads=2, num_layers=2))
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        extra = {"optimizer": {"blob": torch.full((300_000,), float(step))}}
        save_checkpoint(sys.argv[1], step, model, tok, extra, {"k": step}, save_total_limit=2)
        print(step, flush=True)
    """
)


def assert_consistent(path) -> int:
    model, _, extra, state = load_checkpoint(path)
    k = state["step"]
    assert state["k"] == k
    assert path.name == f"checkpoint-{k}"
    assert torch.equal(extra["optimizer"]["blob"], torch.full((300_000,), float(k)))
    for name, p in model.named_parameters():
        assert torch.all(p == k), f"{name} of checkpoint-{k} is not all {k}"
    return k


@pytest.mark.slow
def test_kill_during_save_leaves_a_loadable_checkpoint(tmp_path):
    rng = random.Random(0)
    out = tmp_path / "run"
    for attempt in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(out)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            saved = 0
            while saved < 2 + attempt:  # wait for completed saves, then kill mid-stream
                line = proc.stdout.readline()
                assert line, "the saver died on its own"
                saved = int(line)
            time.sleep(rng.uniform(0.0, 0.05))
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait(timeout=30)
        latest = latest_checkpoint(out)
        assert latest is not None
        k = assert_consistent(latest)
        assert k >= saved  # the last save reported complete is never lost
        for path in list_checkpoints(out):
            assert_consistent(path)  # older ones too: a cut-short prune leaves no half
        # save_total_limit=2, plus at most the one a kill between save and prune left
        assert len(list_checkpoints(out)) <= 3
    model = build_tiny_model(build_char_tokenizer("0123456789"), SPEC)
    save_checkpoint(out, k + 1, model, build_char_tokenizer("0123456789"), {}, {}, 2)
    assert len(list_checkpoints(out)) == 2  # the next save prunes back to the limit
    assert not list(out.glob(".deleting-*"))


def test_failed_save_keeps_the_previous_checkpoint_latest(tmp_path):
    tok = build_char_tokenizer("0123456789")
    model = build_tiny_model(tok, SPEC)
    first = save_checkpoint(tmp_path, 1, model, tok, {"optimizer": {}}, {})
    # Fails half-way: the weights are written, then the trainer state cannot be pickled.
    with pytest.raises(Exception):  # noqa: B017 - whatever pickling raises
        save_checkpoint(tmp_path, 2, model, tok, {"optimizer": {"bad": lambda: 0}}, {})
    assert latest_checkpoint(tmp_path) == first
    assert load_checkpoint(first)[3]["step"] == 1


def test_save_total_limit_prunes_the_oldest(tmp_path):
    tok = build_char_tokenizer("0123456789")
    model = build_tiny_model(tok, SPEC)
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, model, tok, {}, {}, save_total_limit=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-4"]


def test_incomplete_directory_is_not_a_checkpoint(tmp_path):
    (tmp_path / "checkpoint-9").mkdir()
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="not a complete grpolab checkpoint"):
        load_checkpoint(tmp_path / "checkpoint-9")
