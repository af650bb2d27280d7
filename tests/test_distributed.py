"""Data parallel on CPU: real `torchrun --nproc_per_node 2` processes (gloo), DDP and FSDP2.

One launch per mode (~15 s each) runs tests/dist_worker.py: a GRPO step per aggregation
mode with the global batch split over 2 ranks x 2 micro-batches, (ddp) each rank's own
gradients without and with DDP's sync, then a 2-step demo run with a checkpoint per step.
Here, one process redoes the same on the whole batch in one pass; gradients must agree to
float32 tolerance, parameters to what Adam makes of it (tests/tolerances.py), and the
2-rank checkpoint must resume on 1 rank."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerances import (
    adam_first_step_tolerance,
    assert_gradients_close,
    assert_same_trajectory,
    float32_tolerance,
    gradient_norm_tolerance,
    logprob_tolerance,
    reduction_terms,
)

from grpolab.config import ConfigError, load_config, validate_world
from grpolab.train.checkpoint import load_checkpoint
from grpolab.train.loop import train
from grpolab.train.setup import build_run, load_start_model
from grpolab.train.step import grpo_step

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import MODES, demo_overrides, full_grads, split_config, vllm_overrides, vllm_steps

WORKER = Path(__file__).parent / "dist_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(WORKER),
        mode,
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = out / "split.pt"
    return torch.load(results, weights_only=False) if results.exists() else {}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def weights(path: Path) -> dict[str, torch.Tensor]:
    model, *_ = load_checkpoint(path)
    return model.state_dict()


def start_model(overrides: list[str]) -> torch.nn.Module:
    """The model a run of these overrides starts from."""
    model, _ = load_start_model(load_config(None, overrides), torch.device("cpu"))
    return model


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The single-process references: one pass per aggregation mode, and the demo run."""
    out = tmp_path_factory.mktemp("one")
    torch.set_num_threads(1)
    split = {}
    for loss_type in MODES:
        cfg = split_config("ddp", loss_type, out / "unused", accumulation=1)
        model, tokenizer = load_start_model(cfg, torch.device("cpu"))
        start = {k: v.clone() for k, v in model.state_dict().items()}
        run = build_run(cfg, model, tokenizer)
        metrics, batch = grpo_step(run, 1)
        split[loss_type] = {
            "params": model.state_dict(),
            "grads": full_grads(model),
            "grad_norm": metrics["grad_norm"],
            "loss": metrics["loss"],
            "start": start,
            "lr": cfg.optim.learning_rate,
            "terms": reduction_terms(model, tokens=batch.attention_mask.numel()),
            "tokens": batch.attention_mask.numel(),
            "max_adv": float(batch.advantages.abs().max()),
        }
    train(load_config(None, demo_overrides(out / "demo", "ddp")), skip_preflight=True)
    return out, split


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_equal_one_process(tmp_path, one_process, mode):
    one_dir, one = one_process
    two = launch(mode, tmp_path)
    for loss_type in MODES:
        got, want = two[loss_type], one[loss_type]
        assert got["rows"] == 8  # each rank held half of the 16 sequences
        moved = max_diff(want["params"], want["start"])
        diff = max_diff(got["params"], want["params"])
        print(f"{mode} {loss_type}: max |param diff| {diff:.2e} (step moved them {moved:.2e})")
        assert moved > 1e-4  # the step did something the comparison can see
        grad_diff = max_diff(got["grads"], want["grads"])
        print(f"{mode} {loss_type}: max |grad diff| {grad_diff:.2e}")
        # The gradient (after clipping by the global norm) is the one-process gradient: a
        # per-rank normaliser or a mean instead of a sum would be off by a factor of 2 here.
        # The ranks' reductions round differently from one pass, and so does the global norm
        # that scales every entry in the clipping.
        terms = want["terms"]
        norm_rel = gradient_norm_tolerance(want["grads"], terms)
        assert_gradients_close(got["grads"], want["grads"], terms, rtol=norm_rel)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=norm_rel)
        # One AdamW step from a fresh state on those gradients.
        for name, grad in want["grads"].items():
            grad_tol = float32_tolerance(float(grad.abs().max()), terms) + norm_rel * grad.abs()
            bound = adam_first_step_tolerance(grad, grad_tol, want["lr"], want["params"][name])
            gap = (got["params"][name] - want["params"][name]).abs()
            assert (gap <= bound).all(), f"{mode} {loss_type} {name}: {(gap - bound).max():.2e}"
        # On policy the ratio is exactly 1: the loss sums -A (|A| <= max_adv) over the tokens,
        # plus beta * k3 of rounding-sized log-prob gaps (~1e-8).
        loss_tol = float32_tolerance(want["max_adv"], want["tokens"])
        assert got["loss"] == pytest.approx(want["loss"], abs=loss_tol)

    # rollout_split=local: the ranks sampled different prompts; ddp replicas stay identical.
    first, second = two["local_prompts_per_rank"]
    assert len(first) == len(second) == 8 and set(first).isdisjoint(second)
    if mode == "ddp":
        a, b = two["local_params_per_rank"]
        assert a == b
        check_ddp_sync(two["sync"])
        # Compiled layer parts under DDP: the fused path, the eager step's gradients.
        compiled, eager = two["compiled"], two["token"]
        assert compiled["fell_back"] == []
        terms = one["token"]["terms"]
        rtol = gradient_norm_tolerance(eager["grads"], terms)
        assert_gradients_close(compiled["grads"], eager["grads"], terms, rtol=rtol)

    # The 2-rank demo run ends where the 1-process run ends (two Adam steps along two paths).
    start = start_model(demo_overrides(tmp_path / "unused", "ddp")).state_dict()
    two_final = weights(tmp_path / "demo" / "checkpoint-2")
    one_final = weights(one_dir / "demo" / "checkpoint-2")
    print(f"{mode} demo, 2 steps: max |param diff| {max_diff(two_final, one_final):.2e}")
    assert_same_trajectory(two_final, one_final, start)

    # Its step-1 checkpoint resumes on one process and reaches the same step-2 weights.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "demo" / "checkpoint-1", resumed / "checkpoint-1")
    cfg = load_config(None, demo_overrides(resumed, "ddp"))
    train(cfg, resume=True, skip_preflight=True)
    resumed_final = weights(resumed / "checkpoint-2")
    diff = max_diff(resumed_final, two_final)
    print(f"{mode} 2-rank checkpoint resumed on 1 rank: max |param diff| {diff:.2e}")
    assert_same_trajectory(resumed_final, two_final, weights(resumed / "checkpoint-1"))


def check_ddp_sync(sync: dict) -> None:
    """The training forward went through DDP: each rank's own gradient (different batches,
    under no_sync) differs between the ranks; synced, both ranks hold exactly their sum (not
    the mean), and a no_sync pass followed by a synced one holds the sum of both passes'
    gradients. DDP's buckets are the configured parallel.ddp_bucket_mb, and the first
    bucket's all-reduce began before backward had finished the last gradient."""
    local = sync["local"]
    assert local[0].keys() == local[1].keys() and len(local[0]) > 10
    assert all(not torch.equal(local[0][k], local[1][k]) for k in local[0])
    for rank in (0, 1):
        synced, accumulated = sync["synced"][rank], sync["accumulated"][rank]
        assert synced.keys() == accumulated.keys() == local[0].keys()
        for k, g in synced.items():
            assert torch.equal(g, local[0][k] + local[1][k]), (rank, k)
            assert torch.equal(accumulated[k], 2 * g), (rank, k)
    log, param_bytes = sync["logging"], sync["param_bytes"]
    cap = int(0.05 * 2**20)  # split_config's parallel.ddp_bucket_mb
    assert log["bucket_cap_bytes"] == cap and log["comm_hook"] == "sum_hook"
    assert log["total_parameter_size_bytes"] == sum(param_bytes)
    # Reverse parameter order, a bucket closed as soon as it reaches the cap (with
    # find_unused_parameters DDP keeps this layout rather than rebuilding it).
    sizes = [int(size) for size in log["bucket_sizes"].split(",")]
    print(f"ddp: {len(sizes)} buckets, largest {max(sizes)} bytes (cap {cap})")
    assert sum(sizes) == sum(param_bytes) and len(sizes) > 10
    assert max(sizes) < cap + max(param_bytes)
    overlap = log["backward_compute_time_end"] - log["backward_comm_time_start"]
    print(f"ddp: all-reduce began {overlap} ns before backward's last gradient")
    assert log["backward_comm_time_start"] < log["backward_compute_time_end"]


@pytest.fixture(scope="module")
def one_process_vllm(tmp_path_factory):
    """One process, one vLLM engine: the same two steps and the same LoRA run as the ranks."""
    from need_vllm import require_vllm

    require_vllm()
    out = tmp_path_factory.mktemp("one-vllm")
    torch.set_num_threads(1)
    steps = vllm_steps(load_config(None, vllm_overrides(out / "unused", "fsdp")))
    train(load_config(None, vllm_overrides(out / "lora", "ddp", "lora.r=4")), skip_preflight=True)
    return out, steps


@pytest.mark.slow
def test_one_vllm_engine_per_rank_synced_from_shards_and_from_lora(tmp_path, one_process_vllm):
    """Each rank samples with its own engine; after every update each engine is loaded from
    the gathered FSDP2 shards (or the merged LoRA weights under DDP) and passes its canary."""
    one_dir, one = one_process_vllm
    two = launch("vllm-fsdp", tmp_path)
    policy = start_model(vllm_overrides(tmp_path / "unused", "fsdp"))
    start = policy.state_dict()
    # The canary: vLLM's log-probs against the trainer's. Two steps move a weight by ~2 lr,
    # the logits' bound by well under the tolerance's factor 2 to spare.
    tol = logprob_tolerance(policy)
    for gaps in two["gaps"]:  # per rank, both syncs
        assert len(gaps) == 2 and max(gaps) <= tol, (gaps, tol)
    # Only rank 1's engine got the corrupted tensor, and only its check failed.
    assert two["caught"] == [False, True] and one["caught"] is True
    diff = max_diff(two["params"], one["params"])
    print(f"fsdp + vLLM, 2 steps: max |param diff| 2 ranks vs 1 process {diff:.2e}")
    assert_same_trajectory(two["params"], one["params"], start)
    launch("vllm-lora", tmp_path)
    two_lora = weights(tmp_path / "lora" / "checkpoint-2")
    one_lora = weights(one_dir / "lora" / "checkpoint-2")
    print(f"ddp + LoRA + vLLM, 2 steps: max |param diff| {max_diff(two_lora, one_lora):.2e}")
    assert_same_trajectory(two_lora, one_lora, start)  # merged: only the adapted weights move


def test_world_size_must_divide_the_groups():
    cfg = load_config(None, ["batch.prompts_per_step=3", "batch.num_generations=4"])
    with pytest.raises(ConfigError, match=r"batch.prompts_per_step=3: .*world size 2"):
        validate_world(cfg, 2)
    cfg = load_config(None, ["batch.prompts_per_step=4", "batch.mini_batch_size=2"])
    with pytest.raises(ConfigError, match=r"batch.mini_batch_size=2: .*world size 4"):
        validate_world(cfg, 4)
