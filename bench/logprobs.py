"""The log-prob step, forward + backward, against its peers and against the matmul floor.

One step: token log-probs of N tokens from hidden states [N, H] and an lm-head weight [V, H]
(both requiring grad), loss = sum(logp * g) with a fixed random g, backward. Variants:

  naive        the seed: logits = h @ W^T, log_softmax(logits.float() / T), gather
  rowloop      TRL's selective_log_softmax on the same logits (a loop over sequences of 512
               tokens; TRL's own function when trl is installed, its idea otherwise)
  trl_chunked  TRL's fused chunked lm-head (trl.kernels.ChunkedLogProbFunction, chunk 32768
               as its trainer uses it), when trl is installed
  fused        grpolab.model.logprobs.fused_token_logprobs
  floor        the three unavoidable matmuls alone: h @ W^T, then grad @ W and grad^T @ h

Each (shape, variant) runs in its own process so that peak memory is its own. Peak memory is
the step's rise above the inputs: on CPU the peak resident set of the process during the
first step (VmHWM, reset through /proc/self/clear_refs) minus the resident set before it;
on CUDA torch.cuda.max_memory_allocated minus the allocated memory before it. Time is the
median of --repeats steps after that first one, pooled over --rounds processes per variant
(rounds interleave the variants, so a change of machine load hits all of them).

    python bench/logprobs.py                         # default CPU shapes, a few minutes
    python bench/logprobs.py --shapes 4096x128x151936 --json out.json
    python bench/logprobs.py --device cuda --dtype bfloat16 --shapes qwen0.5b
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

VARIANTS = ("naive", "rowloop", "trl_chunked", "fused", "floor")
# A tiny model's head, Qwen's vocabulary with a narrow and with Qwen2.5-0.5B's hidden size,
# SmolLM2-135M's head (H = 576, V = 49,152) at fewer and at more tokens than hidden units.
DEFAULT_SHAPES = (
    "512x64x32768",
    "1024x128x151936",
    "256x896x151936",
    "256x576x49152",
    "1024x576x49152",
)
# Qwen2.5-0.5B's lm-head (H = 896, V = 151,936) at 16 x 512 and 64 x 512 completion tokens.
PRESETS = {"qwen0.5b": ("8192x896x151936", "32768x896x151936")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SEQUENCE = 512  # tokens per sequence for the row loop


@dataclass
class Shape:
    tokens: int
    hidden: int
    vocab: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        parts = text.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"shape {text!r} is not TOKENSxHIDDENxVOCAB, e.g. 2048x128x151936")
        return cls(*map(int, parts))

    def __str__(self) -> str:
        return f"{self.tokens}x{self.hidden}x{self.vocab}"


def has_trl() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


# --- The variants (each returns logp [N] float32 from hidden [N, H], weight [V, H]) ----------


def naive(hidden, weight, targets, temperature):
    logits = hidden @ weight.t()  # [N, V]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)  # [N, V]
    return logprobs.gather(-1, targets[:, None]).squeeze(-1)


def rowloop(hidden, weight, targets, temperature):
    logits = hidden @ weight.t()  # [N, V]
    n = targets.shape[0]
    rows = SEQUENCE if n % SEQUENCE == 0 else n
    logits, index = logits.view(n // rows, rows, -1), targets.view(n // rows, rows)
    if has_trl():
        from trl.trainer.utils import selective_log_softmax

        return selective_log_softmax(logits, index, temperature).reshape(n).float()
    # Its idea: one sequence's log-softmax at a time, never the whole batch's.
    out = []
    for row_logits, row_index in zip(logits, index, strict=True):
        row = torch.log_softmax(row_logits.float() / temperature, dim=-1)
        out.append(row.gather(-1, row_index[:, None]).squeeze(-1))
    return torch.stack(out).reshape(n)


def trl_chunked(hidden, weight, targets, temperature):
    from trl.kernels import ChunkedLogProbFunction

    logp, *_ = ChunkedLogProbFunction.apply(
        hidden, weight, None, targets, temperature, 32768, None, 1.0, ()
    )
    return logp


def fused(hidden, weight, targets, temperature):
    from grpolab.model.logprobs import fused_token_logprobs

    return fused_token_logprobs(hidden, weight, targets, temperature)


STEPS = {"naive": naive, "rowloop": rowloop, "trl_chunked": trl_chunked, "fused": fused}


def floor_step(hidden, weight, grad_logits_like):
    logits = hidden.detach() @ weight.detach().t()  # [N, V]
    torch.mm(logits, weight.detach())  # grad_h = grad_logits @ W   [N, H]
    torch.mm(logits.t(), hidden.detach())  # grad_W = grad_logits^T @ h   [V, H]


# --- One variant in this process -------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rss_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def reset_peak_rss() -> float:
    """Reset the peak resident set to the current one (Linux >= 4.0); the baseline."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return rss_mb("VmHWM")  # no reset: the rise of the high-water mark
    return rss_mb("VmRSS")


def worker(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    shape = Shape.parse(args.shapes[0])
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(shape.tokens, shape.hidden, generator=gen, dtype=dtype).to(device)
    weight = torch.randn(shape.vocab, shape.hidden, generator=gen, dtype=dtype).to(device)
    weight.div_(math.sqrt(shape.hidden))
    hidden.requires_grad_(), weight.requires_grad_()
    targets = torch.randint(0, shape.vocab, (shape.tokens,), generator=gen).to(device)
    g = (torch.randn(shape.tokens, generator=gen) / shape.tokens).to(device)

    def step():
        if args.worker == "floor":
            floor_step(hidden, weight, None)
            return
        logp = STEPS[args.worker](hidden, weight, targets, args.temperature)
        (logp * g).sum().backward()
        hidden.grad = weight.grad = None

    # Imports and one-time set-up before the baseline, so the peak is the step's own.
    import grpolab.model.logprobs  # noqa: F401

    if has_trl():
        import trl.kernels
        import trl.trainer.utils  # noqa: F401
    gc.collect()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = reset_peak_rss()
    t0 = time.perf_counter()
    step()
    sync(device)
    first = time.perf_counter() - t0
    if device.type == "cuda":
        peak_mb = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        peak_mb = rss_mb("VmHWM") - base
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"times": times or [first], "first_s": first, "peak_mb": peak_mb}


# --- The driver ------------------------------------------------------------------------------


@dataclass
class Row:
    variant: str
    tokens: int
    hidden: int
    vocab: int
    dtype: str
    device: str
    time_s: float | None
    peak_mb: float | None
    times: list[float]
    time_vs_naive: float | None = None
    peak_vs_naive: float | None = None
    time_vs_floor: float | None = None
    note: str = ""


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


def estimate_mb(variant: str, shape: Shape, dtype: torch.dtype) -> float:
    """A rough upper bound of a variant's peak, to skip what would wake the OOM killer."""
    nv = shape.tokens * shape.vocab * 4 / 2**20  # one [N, V] float32 array
    weights = 2 * shape.vocab * shape.hidden * dtype.itemsize / 2**20  # W and its gradient
    full = {"naive": 4.5, "rowloop": 3.5, "floor": 1.5}.get(variant, 0.1)
    return full * nv + weights


def run_variant(variant: str, shape: Shape, args) -> Row:
    row = Row(
        variant, shape.tokens, shape.hidden, shape.vocab, args.dtype, args.device, None, None, []
    )
    if args.device == "cpu":
        need, have = estimate_mb(variant, shape, DTYPES[args.dtype]), mem_available_mb()
        if need > 0.8 * have:
            row.note = f"skipped: needs ~{need / 1024:.1f} GB, {have / 1024:.1f} GB available"
            return row
    cmd = [sys.executable, __file__, "--worker", variant, "--shapes", str(shape)]
    cmd += ["--device", args.device, "--dtype", args.dtype, "--repeats", str(args.repeats)]
    cmd += ["--temperature", str(args.temperature), "--threads", str(args.threads or 0)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        row.note = "out of memory" if proc.returncode == -9 or "out of memory" in last else last
        return row
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    row.times = result["times"]
    row.time_s = statistics.median(row.times)
    row.peak_mb = result["peak_mb"]
    return row


def merge(old: Row | None, new: Row) -> Row:
    """Pool the times of two rounds; the peak is the larger one."""
    if old is None or old.time_s is None:
        return new
    if new.time_s is None:
        return old
    old.times += new.times
    old.time_s = statistics.median(old.times)
    old.peak_mb = max(old.peak_mb, new.peak_mb)
    return old


def add_ratios(rows: list[Row]) -> None:
    ref = {r.variant: r for r in rows}
    for r in rows:
        n, f = ref.get("naive"), ref.get("floor")
        if r.time_s is not None and n is not None and n.time_s:
            r.time_vs_naive = r.time_s / n.time_s
            if r.peak_mb is not None and n.peak_mb:
                r.peak_vs_naive = r.peak_mb / n.peak_mb
        if r.time_s is not None and f is not None and f.time_s:
            r.time_vs_floor = r.time_s / f.time_s


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row], args) -> None:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    threads = args.threads or torch.get_num_threads()
    memory = (
        "peak resident set of the first step minus the resident set before it"
        if args.device == "cpu"
        else "torch.cuda.max_memory_allocated above the inputs"
    )
    print(
        f"\nlog-prob step, forward + backward | device {args.device}, {args.dtype}, "
        f"{threads} thread(s), T = {args.temperature:g} | load average {load}\n"
        f"time: median of {args.repeats} steps x {args.rounds} round(s), each variant in its own "
        f"process; peak: {memory}"
    )
    header = (
        f"{'shape (N x H x V)':<18} {'variant':<12} {'time s':>8} {'x naive':>8} {'x floor':>8} "
        f"{'peak MB':>9} {'x naive':>8}  note"
    )
    print(header)
    print("-" * len(header))
    last = None
    for r in rows:
        shape = f"{r.tokens}x{r.hidden}x{r.vocab}"
        if last is not None and shape != last:
            print()
        last = shape
        print(
            f"{shape:<18} {r.variant:<12} {fmt(r.time_s, '8.3f')} {fmt(r.time_vs_naive, '8.2f')} "
            f"{fmt(r.time_vs_floor, '8.2f')} {fmt(r.peak_mb, '9.1f')} "
            f"{fmt(r.peak_vs_naive, '8.3f')}  {r.note}"
        )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--shapes",
        default=",".join(DEFAULT_SHAPES),
        help=f"comma-separated TOKENSxHIDDENxVOCAB, or a preset: {sorted(PRESETS)}",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=3, help="timed steps after the first")
    p.add_argument("--rounds", type=int, default=1, help="processes per variant, interleaved")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shapes = []
    for item in args.shapes.split(","):
        shapes += PRESETS.get(item.strip(), (item.strip(),))
    args.shapes = [str(Shape.parse(s)) for s in shapes]
    variants = [v.strip() for v in args.variants.split(",")]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    args.variants = variants
    if args.repeats < 0:
        p.error(f"--repeats must be >= 0, got {args.repeats}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch.cuda.is_available() is False")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    variants = [v for v in args.variants if v != "trl_chunked" or has_trl()]
    if "trl_chunked" in args.variants and "trl_chunked" not in variants:
        print("trl is not installed: no trl_chunked rows (pip install -e '.[bench]')")
    rows: list[Row] = []
    for text in args.shapes:
        shape = Shape.parse(text)
        shape_rows: dict[str, Row] = {}
        for _ in range(args.rounds):
            for variant in variants:
                row = run_variant(variant, shape, args)
                print(
                    f"  {shape} {variant:<12} {fmt(row.time_s, '.3f')} s  "
                    f"{fmt(row.peak_mb, '.1f')} MB  {row.note}",
                    flush=True,
                )
                shape_rows[variant] = merge(shape_rows.get(variant), row)
        shape_rows = list(shape_rows.values())
        add_ratios(shape_rows)
        rows += shape_rows
    print_table(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
        print(f"\nwrote {len(rows)} rows to {args.json}")


if __name__ == "__main__":
    main()
