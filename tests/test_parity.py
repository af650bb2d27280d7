"""bench/parity.py: grpolab's objective under each profile equals the peer's own code (TRL's
GRPOTrainer, verl's core_algos, OpenRLHF's loss code) to 1e-6 on a real model's batch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "parity.py"

pytestmark = pytest.mark.slow  # the peers' own code


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_parity", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


parity = load_bench()


def test_every_profile_matches_its_peer_to_1e_6(tmp_path):
    assert (parity.peers_path() / "verl").is_dir(), (
        f"verl and OpenRLHF are not installed in {parity.peers_path()}: run scripts/setup.sh "
        "with GRPOLAB_EXTRAS=test"
    )
    out = tmp_path / "parity.json"
    # Its own process: the peers import Ray and DeepSpeed, which this one should not hold.
    done = subprocess.run(
        [sys.executable, str(BENCH), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    over = [r for r in rows if not r["max_abs_diff"] <= 1e-6]
    assert not over, over
    assert done.returncode == 0
    covered = {(r["profile"], r["quantity"]) for r in rows}
    for profile in ("trl", "verl", "openrlhf"):
        assert {(profile, q) for q in ("advantages", "loss", "grad")} <= covered
    assert {("seed", "loss"), ("seed", "grad")} <= covered
    assert all({"profile", "peer", "quantity", "max_abs_diff"} <= set(r) for r in rows)


@pytest.fixture(scope="module")
def batch():
    return parity.build_batch(0)


def test_the_comparison_can_fail(batch):
    # The seed's conventions against TRL's own advantages and loss: they differ, so a
    # matching row is evidence, not an artefact of comparing a thing with itself.
    ours = parity.grpolab_side(batch, [])
    theirs = parity.trl_side(batch)
    assert float((ours[0] - theirs[0]).abs().max()) > 1e-2  # population vs sample std
    assert abs(ours[1] - theirs[1]) > 1e-4


def test_verl_dual_clip_acts_on_the_batch(batch):
    # The batch's ratios reach past verl's dual-clip bound, so the verl row covers it.
    with_dual = parity.grpolab_side(batch, ["objective.profile=verl"])
    without = parity.grpolab_side(batch, ["objective.profile=verl", "objective.dual_clip=null"])
    assert abs(with_dual[1] - without[1]) > 1e-5
