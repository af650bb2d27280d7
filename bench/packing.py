"""Padded against packed micro-batches for long, uneven completions: the update's time and
peak memory side by side, and the padding packing removes.

    python bench/packing.py                                  # SmolLM2-135M, LoRA, bf16 where native
    python bench/packing.py --model demo --min-len 4 --max-len 48 --median 12 --budgets 128,256
    python bench/packing.py --device cuda --json out.json    # the same on a GPU

The batch: `--prompts` chat-template prompts of the example's task (examples/smollm2-
arithmetic.yaml), `--generations` completions each whose lengths are drawn from a long-tailed,
reasoning-like distribution (log-normal, median `--median` tokens, clipped to [32, 512]),
each ending in the model's EOS; the tokens are drawn at random (an update's work does not
depend on them; decoding 512-token completions would dwarf what is measured). Every setting
is one update (`train.step.update`: forward, loss, backward and AdamW over the whole batch)
of the example's run (LoRA r 16, every row run), in its own process:

    padded, 1 micro-batch        the whole batch in one padded forward (the example's)
    padded, G micro-batches      one group per micro-batch (gradient_accumulation_steps)
    packed, <= N tokens          batch.max_tokens_per_microbatch=N, for each of `--budgets`

Time: the median of `--repeats` updates after a first (warm-up) one. Peak: the rise of the
process's resident set during the first update (VmHWM reset through /proc/self/clear_refs) on
CPU, torch.cuda.max_memory_allocated's rise on CUDA. Positions: what the forward runs; for the
padded path one forward per prompt and its completions in length buckets (`prefix.py`), for
the packed one each micro-batch's packed length. `padding_removed`: 1 - packed positions /
the padded layout's B x T. The last line is the whole record as JSON.
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

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "smollm2-arithmetic.yaml"
MIN_LEN, MAX_LEN = 32, 512  # completion lengths (--min-len, --max-len)

CHILD = r"""
import json, math, statistics, sys, time
import torch
from grpolab.config import load_config
from grpolab.model.memory import fix_malloc_thresholds
from grpolab.rollout.common import checked_prompt_ids
from grpolab.rollout.hf import left_padded
from grpolab.train.setup import build_run, load_start_model
from grpolab.train import step as step_module

spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
fix_malloc_thresholds()
cfg = load_config(spec["config"], spec["overrides"])
device = torch.device(spec["device"])
model, tokenizer = load_start_model(cfg, device)
run = build_run(cfg, model, tokenizer)

def rss_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")

def reset_peak():
    if device.type == "cuda":
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated(device) / 2**20
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return rss_mb("VmHWM")
    return rss_mb("VmRSS")

def peak():
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) / 2**20
    return rss_mb("VmHWM")

# The batch: real prompts, completions of drawn lengths (random tokens, EOS last).
G, n = spec["generations"], spec["prompts"]
examples = run.task.sample(n, torch.Generator().manual_seed(0))
ids = checked_prompt_ids(run.engine, [e.prompt for e in examples], G, cfg.rollout.sampling(0))
prompts, prompt_mask = left_padded(ids, run.engine.pad_id)
gen = torch.Generator().manual_seed(1)
lengths = spec["lengths"]
C = max(lengths)
B, P = n * G, prompts.shape[1]
vocab = len(tokenizer)
completion = torch.randint(vocab // 10, vocab - vocab // 10, (B, C), generator=gen)
eos = run.engine.stop_ids[0]
cols = torch.arange(C)[None]
real = cols < torch.tensor(lengths)[:, None]
completion = torch.where(real, completion, run.engine.pad_id)
completion[torch.arange(B), torch.tensor(lengths) - 1] = eos
input_ids = torch.cat([prompts.repeat_interleave(G, 0), completion], 1).to(device)
attention = torch.cat([prompt_mask.repeat_interleave(G, 0), real.long()], 1).to(device)
comp_mask = torch.cat([torch.zeros(B, P, dtype=torch.long), real.long()], 1).to(device)
advantages = torch.tensor([1.0, -1.0] * (B // 2)).to(device)
batch = step_module.StepBatch(
    step=1, examples=examples, rollout=None, input_ids=input_ids, attention_mask=attention,
    completion_mask=comp_mask, scores=None, correct=None, strict=None, advantages=advantages,
    adv_group_sum=0.0, engine_logprobs=None,
)

def update():
    tic = time.perf_counter()
    step_module.update(run, batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - tic

base = reset_peak()
first = update()
peak_mb = peak() - base
times = [update() for _ in range(spec["repeats"])]

# What the forward runs.
from grpolab.model.packed import pack_rows, token_budget_parts
from grpolab.model.prefix import plan_shared_prefix, suffix_buckets
fields = (input_ids.cpu(), attention.cpu(), comp_mask.cpu())
budget = cfg.batch.max_tokens_per_microbatch
if budget is not None:
    parts = token_budget_parts(*fields, budget)
    packs = [pack_rows(*(f[torch.tensor(p)] for f in fields)) for p in parts]
    positions = sum(packed.input_ids.shape[1] for packed in packs)
    micro = len(parts)
else:
    micro = cfg.batch.gradient_accumulation_steps
    rows = B // micro
    positions = 0
    for m in range(micro):
        f = tuple(x[m * rows:(m + 1) * rows] for x in fields)
        plan = plan_shared_prefix(*f)
        if plan is None:
            positions += f[0].numel()
            continue
        real = f[1][:, plan.length:].bool()
        columns = torch.arange(1, f[0].shape[1] - plan.length + 1)
        needed = ((real * columns).amax(1) - 1).clamp(min=0)
        positions += len(plan.firsts) * plan.length
        positions += sum(len(b) * int(needed[b].max()) for b in suffix_buckets(needed))
print(json.dumps({
    "precision": run.precision.name, "update_s": statistics.median(times or [first]),
    "first_s": first, "peak_mb": peak_mb, "micro_batches": micro, "positions": positions,
    "layout_positions": B * (P + C), "loss_tokens": int(comp_mask.sum()),
}))
"""


def draw_lengths(rows: int, median: float, sigma: float, bounds: tuple[int, int]) -> list[int]:
    """Completion lengths from a log-normal (median, sigma), clipped to bounds, seeded."""
    import random

    rng = random.Random(0)
    low, high = bounds
    return [min(high, max(low, round(rng.lognormvariate(0, sigma) * median))) for _ in range(rows)]


def run_child(spec: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"child failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def settings(prompts: int, budgets: list[int]) -> list[tuple[str, list[str]]]:
    rows = [
        ("padded, 1 micro-batch", ["batch.gradient_accumulation_steps=1"]),
        (f"padded, {prompts} micro-batches", [f"batch.gradient_accumulation_steps={prompts}"]),
    ]
    for budget in budgets:
        rows.append((f"packed, <= {budget} tokens", [f"batch.max_tokens_per_microbatch={budget}"]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("smollm2", "demo"), default="smollm2")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--median", type=float, default=96.0, help="median completion tokens")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal spread (long tail)")
    p.add_argument("--min-len", type=int, default=MIN_LEN)
    p.add_argument("--max-len", type=int, default=MAX_LEN)
    p.add_argument("--budgets", default="2048,4096", help="packed token budgets")
    p.add_argument("--precision", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    B = args.prompts * args.generations
    lengths = draw_lengths(B, args.median, args.sigma, (args.min_len, args.max_len))
    config = str(EXAMPLE) if args.model == "smollm2" else None
    common = [
        f"batch.prompts_per_step={args.prompts}", f"batch.num_generations={args.generations}",
        f"rollout.max_completion_length={args.max_len}", f"runtime.precision={args.precision}",
        "runtime.skip_zero_advantage=false", f"runtime.num_threads={args.threads}",
        f"model.device={args.device}", "task.num_eval=0",
    ]  # fmt: skip
    load = os.getloadavg()
    print(
        f"{args.model}, {B} rows ({args.prompts} prompts x {args.generations}), completions "
        f"{min(lengths)}-{max(lengths)} tokens (median {statistics.median(lengths):g}, mean "
        f"{statistics.mean(lengths):.0f}), {args.device}, {args.threads} threads, load "
        + ", ".join(f"{x:.2f}" for x in load)
    )
    rows = []
    for name, overrides in settings(args.prompts, [int(b) for b in args.budgets.split(",")]):
        spec = {
            "config": config, "overrides": common + overrides, "device": args.device,
            "threads": args.threads, "repeats": args.repeats, "prompts": args.prompts,
            "generations": args.generations, "lengths": lengths,
        }  # fmt: skip
        tic = time.perf_counter()
        result = run_child(spec)
        result["padding_removed"] = 1 - result["positions"] / result["layout_positions"]
        rows.append({"setting": name, **result, "wall_s": time.perf_counter() - tic})
        print(f"  {name}: {result['update_s']:.2f} s", flush=True)
    base = rows[0]
    for row in rows:
        row["update_vs_padded_1"] = row["update_s"] / base["update_s"]
        row["peak_vs_padded_1"] = row["peak_mb"] / base["peak_mb"] if base["peak_mb"] else None
    keys = ["setting", "precision", "micro_batches", "update_s", "peak_mb", "positions",
            "layout_positions", "padding_removed", "update_vs_padded_1",
            "peak_vs_padded_1"]  # fmt: skip
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys))
    blob = {"model": args.model, "lengths": lengths, "load": list(load),
            "load_after": list(os.getloadavg()), "threads": args.threads, "rows": rows}  # fmt: skip
    print(json.dumps(blob))
    if args.json:
        Path(args.json).write_text(json.dumps(blob, indent=2) + "\n")


if __name__ == "__main__":
    main()
