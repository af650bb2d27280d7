"""The benchmark's parity line: grpolab's loss equals TRL's GRPOTrainer loss on one fixed batch
for each matching loss_type (needs trl, the `bench` extra)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="trl (the bench extra) is not installed")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "vs_trl.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_vs_trl", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


vs_trl = load_bench()


@pytest.mark.parametrize("loss_agg", sorted(vs_trl.LOSS_TYPES))
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_matches_trl(loss_agg: str, beta: float) -> None:
    ours, theirs = vs_trl.loss_parity(loss_agg, beta)
    assert abs(ours) > 1e-4  # off-policy batch: a loss of exactly 0 would prove nothing
    # The losses (~2e-2) differ only through the two paths' log-probs (grpolab's chunked
    # lm-head, TRL's full logits): each token's rounding is of random sign and the loss averages
    # ~50 of them (measured <= 5e-8 with AVX-512, AVX2 and SSE kernels). Every token off by the
    # log-prob tolerance (~2e-4) in the same direction would give ~6e-4, which would also hide
    # a KL convention (~4e-4 of the loss at beta 0.04); loss_parity keeps TRL's log-probs inside
    # compute_loss, so the test cannot bound them tighter.
    assert abs(ours - theirs) <= 1e-5


def test_mismatched_loss_type_is_caught() -> None:
    """The parity check can fail: the same batch under another aggregation differs."""
    seq, _ = vs_trl.loss_parity("sequence", 0.0)
    const, _ = vs_trl.loss_parity("constant", 0.0)
    assert abs(seq - const) > 1e-5
