"""fp32 against bf16 on this machine: the hardware floor, the kernels, and a real-model step.

    python bench/precision.py                 # everything, 2 threads
    python bench/precision.py --json out.json --threads 1
    python bench/precision.py --rates-only    # the floor's rates alone (a minute)

rates: what every floor is computed from, each the best of many short trials after a
warm-up, with its spread (the median trial against the best): the matmul peak (the best
over a few shapes, `PEAK_SHAPES`, and the step's own: the floor's rate), the matmul rate at
the step's own shapes (the decode's
[64, 576] x [576, 1536], the update's [positions, 576] x [576, 1536]) and the memory
bandwidth (the best of a 128 MB copy and a 128 MB read). On a shared machine the best trial
is the one that had the cores: two runs agree on it where a median follows the load.
attention: scaled-dot-product attention forward + backward at several key lengths (why short
attention on the CPU stays float32 under bf16).

steps: `examples/smollm2-arithmetic.yaml` (SmolLM2-135M-Instruct, LoRA r16, 8 prompts x G=8,
16 tokens), `--steps` trainer steps per setting, each setting in its own process with the heap
set as `grpolab train` sets it (`memory.fix_malloc_thresholds`), side by side in one run;
the table shows the median of the steps after the first (warm-up) per phase (rollout, old
log-probs, update). Every row is run (runtime.skip_zero_advantage=false), so
the update's work is the same in both precisions; the rollout differs by what it samples
(the completion tokens are in the table). `*_floor_s` is the step's matmul FLOPs at the
matmul peak (the rollout: or the decode's weight bytes at the bandwidth, the larger);
`*_floor_at_shape_s` the same FLOPs at the rate of the step's own shapes; `*_x_shapes` is
their ratio (the part of the gap the shapes explain) and `*_x_overhead` the time over the
floor at the step's shapes (the rest: per-op overhead, elementwise passes, attention).
The last line is the whole record as JSON (`--json FILE` writes it too).
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


def trial_seconds(fn, budget_s: float, warmup: int = 3, least: int = 10) -> list[float]:
    """Seconds of single calls of fn after `warmup` untimed ones, as many as fit in
    `budget_s` (at least `least`). On a shared machine the fastest call is the one that had
    the cores to itself: the machine's rate is the best of many short trials, never a mean."""
    for _ in range(warmup):
        fn()
    times, start = [], time.perf_counter()
    while len(times) < least or time.perf_counter() - start < budget_s:
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return times


def rate(work: float, times: list[float]) -> dict:
    """work per second at the best trial, with the spread: the median trial's rate and the
    best over the median (1.0: every trial alike; large: the machine was shared)."""
    best, median = min(times), statistics.median(times)
    return {"best": work / best, "median": work / median, "spread": median / best,
            "trials": len(times)}  # fmt: skip


def matmul_rate(dtype: torch.dtype, m: int, k: int, n: int, budget_s: float) -> dict:
    """GFLOP/s of F.linear([m, k], weight [n, k]) -- a model's linear -- into a reused output."""
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    times = trial_seconds(lambda: torch.mm(x, w.t(), out=out), budget_s)
    return rate(2 * m * k * n / 1e9, times)


# Shapes the machine's matmul peak is sought at (the best of them is the peak): the example's
# MLP projection at a whole batch and at twice that, and a square one: short enough calls
# (milliseconds) that some trials have the cores to themselves on a shared machine.
PEAK_SHAPES = ((512, 576, 1536), (1024, 576, 1536), (1024, 1024, 1024))
HIDDEN, INTERMEDIATE = 576, 1536


def peak_rate(dtype: torch.dtype, budget_s: float) -> dict:
    """The best GFLOP/s over PEAK_SHAPES, each the best of its trials."""
    found = {f"{m}x{k}x{n}": matmul_rate(dtype, m, k, n, budget_s) for m, k, n in PEAK_SHAPES}
    shape = max(found, key=lambda s: found[s]["best"])
    return {**found[shape], "shape": shape}


def bandwidth(budget_s: float) -> dict:
    """GB/s of memory traffic, the best of a 128 MB copy (read + write) and a 128 MB read
    (a sum), each the best of its trials: four times a large L3 cache, and short enough
    (milliseconds) that some trials have the memory to themselves on a shared machine."""
    src = torch.ones(32 * 2**20)  # 128 MB of float32
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4 / 1e9
    copy = rate(2 * nbytes, trial_seconds(lambda: dst.copy_(src), budget_s, warmup=2, least=5))
    read = rate(nbytes, trial_seconds(lambda: src.sum(), budget_s, warmup=2, least=5))
    best = copy if copy["best"] >= read["best"] else read
    return {**best, "kind": "copy" if best is copy else "read", "copy": copy["best"],
            "read": read["best"]}  # fmt: skip


def attention_ms(keys: int, queries: int, dtype: torch.dtype, rows=8, heads=9) -> float:
    """Milliseconds of one SDPA forward + backward, [rows, heads, queries|keys, 64]."""
    shape = (rows, heads)
    q = torch.randn(*shape, queries, 64, dtype=dtype, requires_grad=True)
    k = torch.randn(*shape, keys, 64, dtype=dtype, requires_grad=True)
    v = torch.randn(*shape, keys, 64, dtype=dtype, requires_grad=True)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=queries == keys).sum().backward()

    return min(trial_seconds(step, 0.5)) * 1e3


def bench_rates(budget_s: float, decode_rows: int) -> dict:
    """The floor's rates: per precision the matmul peak and the rate at the decode's own
    shape ([decode_rows, 576] x [576, 1536]); the memory bandwidth."""
    rates = {"bandwidth": bandwidth(budget_s)}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        rates[name] = {
            "peak": peak_rate(dtype, budget_s),
            "decode": matmul_rate(dtype, decode_rows, HIDDEN, INTERMEDIATE, budget_s),
        }
    rates["amx"] = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return rates


def bench_attention() -> list[dict]:
    attention = []
    for queries, keys in ((15, 61), (128, 128), (256, 256), (512, 512), (1024, 1024)):
        fp32 = attention_ms(keys, queries, torch.float32)
        bf16 = attention_ms(keys, queries, torch.bfloat16)
        attention.append(
            {"queries": queries, "keys": keys, "fp32_ms": fp32, "bf16_ms": bf16,
             "bf16_over_fp32": bf16 / fp32}
        )  # fmt: skip
    return attention


def rate_rows(rates: dict) -> list[dict]:
    """The rates as table rows: what, best, median, spread, trials."""
    rows = []
    for name in ("fp32", "bf16"):
        for what, r in rates[name].items():
            label = f"{name} matmul {what}" + (f" ({r['shape']})" if "shape" in r else "")
            rows.append({"rate": label, "unit": "GFLOP/s", **_rate_cols(r)})
    bw = rates["bandwidth"]
    rows.append({"rate": f"bandwidth ({bw['kind']})", "unit": "GB/s", **_rate_cols(bw)})
    return rows


def _rate_cols(r: dict) -> dict:
    return {"best": r["best"], "median": r["median"], "spread": r["spread"], "trials": r["trials"]}


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


def floor_seconds(row: dict, rates: dict, precision: str, params: dict, update_rate: dict) -> dict:
    """The step's matmul FLOPs at the machine's best matmul rate (the best of PEAK_SHAPES and
    the step's own shapes), the decode's weight bytes at its best bandwidth; and the same
    FLOPs at the rate of the step's own shapes (the decode's [rows, 576] x [576, 1536], the
    update's [positions, 576] x [576, 1536]: `update_rate`), which says how much of a gap
    the shapes explain. Forward: 2 x body weights x positions
    run (a group's prompt once) + 2 x head x completion tokens; LoRA's backward (frozen
    weights: activation gradients only) about as much again. Attention and the adapters' own
    matmuls are left out."""
    # The machine's best: over every shape measured, the step's own included (on a shared
    # machine the short calls are the ones that get the cores to themselves).
    peak = max(rates[precision]["peak"]["best"], rates[precision]["decode"]["best"],
               update_rate["best"]) * 1e9  # fmt: skip
    at_decode = rates[precision]["decode"]["best"] * 1e9
    at_update = update_rate["best"] * 1e9
    body, head = params["body"], params["head"]
    tokens, completions = row["tokens"], row["completion_tokens"]
    forward = 2 * body * tokens + 2 * head * completions
    update = 2 * forward  # forward + the activation-gradient backward
    # Decode: every generated position reads the body and the head once per step for all
    # rows at once; 16 steps of 64 rows here.
    weight_bytes = (body + head) * (2 if precision == "bf16" else 4)
    decode_steps = max(1, completions // max(1, row["rows"]))
    weights_s = decode_steps * weight_bytes / (rates["bandwidth"]["best"] * 1e9)
    return {
        "rollout_floor_s": max(forward / peak, weights_s),
        "rollout_floor_at_shape_s": max(forward / at_decode, weights_s),
        "update_floor_s": update / peak,
        "update_floor_at_shape_s": update / at_update,
    }


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


# (precision, rows per micro-batch, sampler, decode, update): first the example as it was
# (the baseline every ratio is against), then one change at a time, last the example as it
# is. decode "forward": the hf engine through the model's forward (rollout.hf.fast_decode=
# false), "step": its own decode step; update "padded": micro-batches of rows, padded,
# "packed": batch.max_tokens_per_microbatch=4096 (one packed micro-batch here).
SETTINGS = [
    ("fp32", 8, "multinomial", "forward", "padded"),
    ("fp32", 64, "inverse_cdf", "forward", "padded"),
    ("fp32", 64, "inverse_cdf", "step", "packed"),
    ("bf16", 64, "inverse_cdf", "forward", "padded"),
    ("bf16", 64, "inverse_cdf", "step", "packed"),
]


def bench_steps(threads: int, steps: int, rates: dict, budget_s: float) -> list[dict]:
    params = model_params()
    out = []
    for precision, micro_batch, sampler, decode, update in SETTINGS:
        budget = 4096 if update == "packed" else "null"
        overrides = [
            f"runtime.precision={precision}",
            f"batch.gradient_accumulation_steps={64 // micro_batch}",
            f"batch.max_tokens_per_microbatch={budget}",
            f"rollout.hf.sampler={sampler}",
            f"rollout.hf.fast_decode={decode == 'step'}",
            "runtime.skip_zero_advantage=false",
            "task.num_eval=0",
            f"runtime.num_threads={threads}",
        ]
        result = run_steps(threads, steps, overrides)
        later = result["steps"][1:] or result["steps"]
        row = {"precision": result["precision"], "micro_batch": micro_batch, "sampler": sampler,
               "decode": decode, "update": update}  # fmt: skip
        for key in ("rollout_s", "logprobs_s", "update_s", "step_s", "completion_tokens"):
            row[key] = statistics.median(r[key] for r in later)
        row["rollout_tokens_per_s"] = row["completion_tokens"] / row["rollout_s"]
        tokens = int(statistics.median(r["tokens"] for r in later))
        dtype = torch.bfloat16 if row["precision"] == "bf16" else torch.float32
        # The rate at the update's own shape, measured after the child has left the cores.
        update_rate = matmul_rate(dtype, tokens, HIDDEN, INTERMEDIATE, budget_s)
        row["update_gflops"] = update_rate["best"]
        row.update(floor_seconds({**later[-1], "tokens": tokens}, rates, row["precision"],
                                 params, update_rate))  # fmt: skip
        out.append(row)
    base = out[0]
    for row in out:
        row["rollout_x_floor"] = row["rollout_s"] / row["rollout_floor_s"]
        row["update_x_floor"] = row["update_s"] / row["update_floor_s"]
        # The gap split: shapes (the floor at the step's shapes over the floor at the peak)
        # times overhead (the time over the floor at the step's shapes).
        row["update_x_shapes"] = row["update_floor_at_shape_s"] / row["update_floor_s"]
        row["update_x_overhead"] = row["update_s"] / row["update_floor_at_shape_s"]
        row["rollout_x_shapes"] = row["rollout_floor_at_shape_s"] / row["rollout_floor_s"]
        row["rollout_x_overhead"] = row["rollout_s"] / row["rollout_floor_at_shape_s"]
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


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def machine(threads: int) -> dict:
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": threads,
            "load": list(os.getloadavg())}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--budget", type=float, default=3.0, help="seconds of trials per rate")
    p.add_argument("--rates-only", action="store_true", help="the rates, no attention, no steps")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    start = machine(args.threads)
    print(f"{start['cpu']}, {start['cpus']} CPUs, {args.threads} threads, load average "
          + ", ".join(f"{x:.2f}" for x in start["load"]))  # fmt: skip
    rates = bench_rates(args.budget, decode_rows=64)
    print_table(rate_rows(rates))
    for name in ("fp32", "bf16"):  # what the floors use (the update's shape joins later)
        best = max(rates[name]["peak"]["best"], rates[name]["decode"]["best"])
        print(f"{name} floor rate: {best:.4g} GFLOP/s (the best of the shapes above)")
    blob = {"machine": start, "rates": rates}
    if not args.rates_only:
        blob["attention"] = bench_attention()
        print_table(blob["attention"])
        blob["steps"] = bench_steps(args.threads, args.steps, rates, args.budget)
        print_table(blob["steps"])
    blob["load_after"] = list(os.getloadavg())
    print("load average after: " + ", ".join(f"{x:.2f}" for x in blob["load_after"]))
    print(json.dumps(blob))
    if args.json:
        Path(args.json).write_text(json.dumps(blob, indent=2) + "\n")


if __name__ == "__main__":
    main()
