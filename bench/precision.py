"""fp32 against bf16 on this machine: the hardware floor, the kernels, and a real-model step.

    python bench/precision.py                 # everything, 2 threads
    python bench/precision.py --json out.json --threads 1

kernels: one matmul of the example's MLP shape (the matmul rate both precisions reach here),
a copy of 512 MB (the memory bandwidth), scaled-dot-product attention forward + backward at
several key lengths (why short attention on the CPU stays float32 under bf16).

steps: `examples/smollm2-arithmetic.yaml` (SmolLM2-135M-Instruct, LoRA r16, 8 prompts x G=8,
16 tokens), `--steps` trainer steps per setting, each setting in its own process with the heap
set as `grpolab train` sets it (`memory.fix_malloc_thresholds`), side by side in one run;
the table shows the median of the steps after the first (warm-up) per phase (rollout, old
log-probs, update). Every row is run (runtime.skip_zero_advantage=false), so
the update's work is the same in both precisions; the rollout differs by what it samples
(the completion tokens are in the table). `floor` is the step's matmul FLOPs at the matmul
rate measured above and the decode's weight bytes at the measured bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "smollm2-arithmetic.yaml"


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def matmul_rate(dtype: torch.dtype, m=512, k=576, n=1536) -> float:
    """GFLOP/s of one [m, k] @ [k, n] matmul."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    return 2 * m * k * n / timed(lambda: a @ b, 20) / 1e9


def bandwidth() -> float:
    """GB/s of a 512 MB copy (read + write)."""
    src = torch.empty(128 * 2**20)  # 512 MB of float32
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), 5) / 1e9


def attention_ms(keys: int, queries: int, dtype: torch.dtype, rows=8, heads=9) -> float:
    """Milliseconds of one SDPA forward + backward, [rows, heads, queries|keys, 64]."""
    shape = (rows, heads)
    q = torch.randn(*shape, queries, 64, dtype=dtype, requires_grad=True)
    k = torch.randn(*shape, keys, 64, dtype=dtype, requires_grad=True)
    v = torch.randn(*shape, keys, 64, dtype=dtype, requires_grad=True)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=queries == keys).sum().backward()

    return timed(step, 5) * 1e3


def bench_kernels() -> tuple[dict, list[dict]]:
    rates = {
        "fp32_gflops": matmul_rate(torch.float32),
        "bf16_gflops": matmul_rate(torch.bfloat16),
        "bandwidth_gbs": bandwidth(),
        "amx": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
    }
    attention = []
    for queries, keys in ((15, 61), (128, 128), (256, 256), (512, 512), (1024, 1024)):
        fp32 = attention_ms(keys, queries, torch.float32)
        bf16 = attention_ms(keys, queries, torch.bfloat16)
        attention.append(
            {"queries": queries, "keys": keys, "fp32_ms": fp32, "bf16_ms": bf16,
             "bf16_over_fp32": bf16 / fp32}
        )  # fmt: skip
    return rates, attention


STEP_CHILD = """
import json, sys, time, torch
from grpolab.config import load_config
from grpolab.model.memory import fix_malloc_thresholds
from grpolab.train.setup import build_run, load_start_model
from grpolab.train.step import grpo_step
threads, steps, overrides = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
torch.set_num_threads(threads)
fix_malloc_thresholds()  # as `grpolab train` runs its steps
cfg = load_config(%r, overrides)
model, tokenizer = load_start_model(cfg, torch.device("cpu"))
run = build_run(cfg, model, tokenizer)
def prompt_positions(batch, cfg):
    return (batch.attention_mask.sum() - batch.completion_mask.sum()) / cfg.batch.num_generations
rows = []
for step in range(1, steps + 1):
    tic = time.perf_counter()
    metrics, batch = grpo_step(run, step)
    rows.append({
        "step_s": time.perf_counter() - tic,
        "rollout_s": batch.timings["time/rollout"],
        "logprobs_s": batch.timings["time/logprobs"],
        "update_s": batch.timings["time/update"],
        "completion_tokens": int(batch.completion_mask.sum()),
        # The positions the loss forward runs: a group's prompt once, then its completions.
        "tokens": int(prompt_positions(batch, cfg) + batch.completion_mask.sum()),
        "rows": batch.rows,
    })
print(json.dumps({"precision": run.precision.name, "steps": rows}))
"""


def run_steps(threads: int, steps: int, overrides: list[str]) -> dict:
    code = STEP_CHILD % str(EXAMPLE)
    out = subprocess.run(
        [sys.executable, "-c", code, str(threads), str(steps), *overrides],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"step child failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def floor_seconds(row: dict, rates: dict, precision: str, params: dict) -> dict:
    """The step's matmul FLOPs at the measured rate, the decode's weight bytes at the
    measured bandwidth. Forward: 2 x body weights x positions run (a group's prompt once) +
    2 x head x completion tokens; LoRA's backward (frozen weights: activation gradients
    only) about as much again. Attention and the adapters' own matmuls are left out."""
    rate = rates[f"{precision}_gflops"] * 1e9
    body, head = params["body"], params["head"]
    tokens, completions = row["tokens"], row["completion_tokens"]
    forward = 2 * body * tokens + 2 * head * completions
    update = 2 * forward  # forward + the activation-gradient backward
    # Decode: every generated position reads the body and the head once per step for all
    # rows at once; 16 steps of 64 rows here.
    weight_bytes = (body + head) * (2 if precision == "bf16" else 4)
    decode_steps = max(1, completions // max(1, row["rows"]))
    rollout = max(forward / rate, decode_steps * weight_bytes / (rates["bandwidth_gbs"] * 1e9))
    return {"rollout_floor_s": rollout, "update_floor_s": update / rate}


def model_params() -> dict:
    from grpolab.config import load_config
    from grpolab.train.setup import load_start_model

    cfg = load_config(EXAMPLE, [])
    model, _ = load_start_model(cfg, torch.device("cpu"))
    head = model.get_output_embeddings().weight.numel()
    body = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()
    )
    return {"body": body, "head": head}


# (precision, rows per micro-batch, sampler): first the example as it was (the baseline every
# ratio is against), then one change at a time, last the example as it is.
SETTINGS = [
    ("fp32", 8, "multinomial"),
    ("fp32", 64, "inverse_cdf"),
    ("bf16", 8, "inverse_cdf"),
    ("bf16", 64, "inverse_cdf"),
]


def bench_steps(threads: int, steps: int, rates: dict) -> list[dict]:
    params = model_params()
    out = []
    for precision, micro_batch, sampler in SETTINGS:
        overrides = [
            f"runtime.precision={precision}",
            f"batch.gradient_accumulation_steps={64 // micro_batch}",
            f"rollout.hf.sampler={sampler}",
            "runtime.skip_zero_advantage=false",
            "task.num_eval=0",
            f"runtime.num_threads={threads}",
        ]
        result = run_steps(threads, steps, overrides)
        later = result["steps"][1:] or result["steps"]
        row = {"precision": result["precision"], "micro_batch": micro_batch, "sampler": sampler}
        for key in ("rollout_s", "logprobs_s", "update_s", "step_s", "completion_tokens"):
            row[key] = statistics.median(r[key] for r in later)
        row["rollout_tokens_per_s"] = row["completion_tokens"] / row["rollout_s"]
        row.update(floor_seconds(later[-1], rates, precision, params))
        out.append(row)
    base = out[0]
    for row in out:
        row["step_vs_fp32_micro8"] = row["step_s"] / base["step_s"]
        row["update_speedup"] = base["update_s"] / row["update_s"]
        row["rollout_tokens_speedup"] = row["rollout_tokens_per_s"] / base["rollout_tokens_per_s"]
    return out


def print_table(rows: list[dict]) -> None:
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys))
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs, {args.threads} threads")
    rates, attention = bench_kernels()
    print_table([rates])
    print_table(attention)
    steps = bench_steps(args.threads, args.steps, rates)
    print_table(steps)
    if args.json:
        blob = {"rates": rates, "attention": attention, "steps": steps}
        Path(args.json).write_text(json.dumps(blob, indent=2) + "\n")


if __name__ == "__main__":
    main()
