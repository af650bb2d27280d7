"""grpolab's former hand-written gradient reducer against torch's DistributedDataParallel, on
2 ranks (`torchrun --nproc_per_node 2`, gloo on the CPU), side by side in one run:

- **update**: inside one pair of rank processes (this tree), the same two micro-batches'
  forward and backward with their gradients summed over the ranks, by the reducer (loaded
  from the base commit's src/grpolab/dist.py, on the plain model) and by DDP
  (`Run.train_forward`, no_sync then a synced micro-batch), and with no communication at
  all (the floor), each followed by the global norm, clipping and AdamW's step, the three
  taking turns `--reps` times; the median of each.
- **training**: the same `grpolab train` run from a checkout of the base commit and from
  this tree, the launches interleaved (reducer, DDP, DDP, reducer, ...); the medians of
  `time/step` (rollout, rewards, log-probs, update) and `time/update` (the micro-batches,
  the gradient sums, clipping, AdamW) over `--steps` steps per launch after `--warmup`.

    python bench/ddp.py                          # the demo model, full fine-tuning
    python bench/ddp.py --model smollm2 --reps 6 --steps 3 --rounds 2   # 134.5M parameters
    python bench/ddp.py --json out.json

`--base` defaults to the parent of the commit that removed `GradientReducer`. Both sides run
the same config, seed and threads (OMP_NUM_THREADS=1 and trainer.num_threads=1 per rank: 2
ranks on 2 cores) with gradient_accumulation_steps=2, so that each optimizer step has a
micro-batch without communication and one whose backward sums the gradients.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THREADS = 1
# The keys by their older names (trainer.<key>), which both trees compared read.
COMMON = ["trainer.gradient_accumulation_steps=2", f"trainer.num_threads={THREADS}"]

# name -> (config file or None, overrides, what the model is)
MODELS: dict[str, tuple[Path | None, list[str], str]] = {
    "demo": (
        None,
        ["trainer.prompts_per_step=16", "trainer.num_generations=8"],
        "the demo model (2 layers, hidden 128, 0.5M parameters), 128 rows a step",
    ),
    "smollm2": (
        ROOT / "examples" / "smollm2-arithmetic.yaml",
        [
            "trainer.lora_r=0",
            "trainer.precision=fp32",
            "trainer.prompts_per_step=2",
            "trainer.num_generations=4",
            "rollout.max_completion_length=8",
        ],
        "SmolLM2-135M-Instruct, full fine-tuning in fp32 (538 MB of gradients), 8 rows a step",
    ),
}


def base_revision() -> str:
    """The parent of the commit that removed the reducer from src/grpolab/dist.py (HEAD
    while its removal is not committed)."""
    path = "src/grpolab/dist.py"
    if "class GradientReducer" in (ROOT / path).read_text():
        raise SystemExit("this tree still has GradientReducer: pass --base")
    head = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    if "class GradientReducer" in head:
        return "HEAD"
    found = subprocess.run(
        ["git", "log", "-1", "--format=%H", "-S", "class GradientReducer", "--", path],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    return f"{found}^"


def torchrun(tree: Path, args: list[str], port: int) -> str:
    """`torchrun --nproc_per_node 2 ARGS` with `tree`'s package; its stdout."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": str(THREADS)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(port), *args]
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed in {tree}:\n{done.stderr[-3000:]}")
    return done.stdout


# --- update: one pair of rank processes ----------------------------------------------------------


def update_worker(model: str, reps: int, base_dist: Path, out: Path) -> None:
    """Under torchrun: the three ways of running two micro-batches, taking turns."""
    import torch
    import torch.distributed as tdist

    from grpolab.config import load_config
    from grpolab.model import dist as dist_module
    from grpolab.train.setup import build_run, load_start_model
    from grpolab.train.step import collect

    spec = importlib.util.spec_from_file_location("base_dist", base_dist)
    base = sys.modules["base_dist"] = importlib.util.module_from_spec(spec)  # for @dataclass
    spec.loader.exec_module(base)
    torch.set_num_threads(THREADS)
    cpu = torch.device("cpu")
    d = dist_module.init("ddp", cpu)
    path, overrides, _ = MODELS[model]
    cfg = load_config(path, [*overrides, *COMMON, "trainer.progress=false"])
    policy, tokenizer = load_start_model(cfg, cpu)
    run = build_run(cfg, policy, tokenizer, dist=d)
    batch = collect(run, 1)
    trained = [p for p in run.model.parameters() if p.requires_grad]
    reducer = base.GradientReducer(trained, cfg.parallel.ddp_bucket_mb)
    half = batch.rows // 2
    micro = [torch.arange(0, half), torch.arange(half, batch.rows)]

    def two_micro_batches(forward, before_last=None, after=None):
        run.optimizer.zero_grad(set_to_none=True)
        for i, rows in enumerate(micro):
            last = i == len(micro) - 1
            with run.gradient_sync(last):  # DDP's no_sync; nothing to the plain forward
                logp, mask = forward(batch.input_ids[rows], batch.attention_mask[rows],
                                     batch.completion_mask[rows], 1.0)  # fmt: skip
                if before_last is not None and last:
                    before_last()
                (logp * mask).sum().backward()
        if after is not None:
            after()
        norm = dist_module.grad_norm(trained, d)  # then what the update does with the sums
        dist_module.clip_gradients(trained, norm, cfg.optim.max_grad_norm, d)
        run.optimizer.step()

    def plain(*args):
        return run.functions.sequence_logprobs(run.model, *args)

    ways = {
        "reducer": lambda: two_micro_batches(plain, reducer.arm, reducer.wait),
        "DDP": lambda: two_micro_batches(run.train_forward),
        "no communication": lambda: two_micro_batches(plain),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for rep in range(reps + 1):  # the first round warms up
        for name in names[rep % 3 :] + names[: rep % 3]:
            tdist.barrier()
            tic = time.perf_counter()
            ways[name]()
            if rep:
                times[name].append(time.perf_counter() - tic)
    if d.main:
        record = {"times": times, "buckets_reducer": len(reducer.buckets),
                  "buckets_ddp": len(run.ddp._get_ddp_logging_data()["bucket_sizes"].split(",")),
                  "trained_parameters": sum(p.numel() for p in trained)}  # fmt: skip
        out.write_text(json.dumps(record))
    dist_module.shutdown()


def measure_update(args, base_tree: Path, work: Path, port: int) -> dict:
    out = work / "update.json"
    worker = [str(Path(__file__).resolve()), "--worker", str(out), "--model", args.model]
    worker += ["--reps", str(args.reps), "--base-dist", str(base_tree / "src/grpolab/dist.py")]
    torchrun(ROOT, worker, port)
    return json.loads(out.read_text())


# --- training: whole runs from both trees ------------------------------------------------------


def train_args(model: str, steps: int, out: Path) -> list[str]:
    path, overrides, _ = MODELS[model]
    cmd = ["-m", "grpolab", "train", *(["--config", str(path)] if path else []), *overrides]
    cmd += [*COMMON, f"output_dir={out}", f"max_steps={steps}", f"trainer.save_steps={steps + 1}"]
    return [*cmd, "trainer.eval_examples=0", "trainer.progress=false", "--skip-preflight"]


def measure_training(args, base_tree: Path, work: Path, port: int) -> dict:
    times: dict[str, dict[str, list[float]]] = {"reducer": {}, "DDP": {}}
    for r in range(args.rounds):
        sides = (("reducer", base_tree), ("DDP", ROOT))
        for side, tree in sides if r % 2 == 0 else sides[::-1]:
            out = work / f"{side}-{r}"
            torchrun(tree, train_args(args.model, args.warmup + args.steps, out), port)
            port += 1
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            for key in ("step", "update"):
                kept = (row[f"time/{key}"] for row in rows if row["step"] > args.warmup)
                times[side].setdefault(key, []).extend(kept)
            print(f"  training round {r + 1}/{args.rounds} {side}: done", flush=True)
    return times


def report(args, base: str, sync: dict, training: dict) -> None:
    med = statistics.median
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n2 ranks (gloo, CPU), {THREADS} thread per rank | {MODELS[args.model][2]}")
    print(f"gradient_accumulation_steps=2 | load average {load} | reducer from {base}")
    print(f"buckets (trainer.ddp_bucket_mb): reducer {sync['buckets_reducer']}, "
          f"DDP {sync['buckets_ddp']}")  # fmt: skip
    print(f"\nupdate: two micro-batches, the sum, clipping, AdamW; median of {args.reps}, ms")
    floor = med(sync["times"]["no communication"])
    for name, got in sync["times"].items():
        print(f"  {name:<18}{med(got) * 1e3:>10.1f}   x no communication {med(got) / floor:.2f}")
    print(f"\ntraining: median of {args.steps} steps x {args.rounds} launches per side, s")
    print(f"  {'side':<10}{'step':>10}{'update':>10}")
    for side, got in training.items():
        print(f"  {side:<10}{med(got['step']):>10.3f}{med(got['update']):>10.3f}")
    record = {"bench": "ddp", "model": args.model, "ranks": 2, "threads_per_rank": THREADS,
              "base": base, "load_average": os.getloadavg(),
              "update_ms": {k: med(v) * 1e3 for k, v in sync["times"].items()},
              "train_step_s": {k: med(v["step"]) for k, v in training.items()},
              "train_update_s": {k: med(v["update"]) for k, v in training.items()},
              "update": sync, "training": training}  # fmt: skip
    print(json.dumps(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="a commit with the hand-written reducer")
    parser.add_argument("--model", choices=list(MODELS), default="demo")
    parser.add_argument("--reps", type=int, default=20, help="update: turns of each way")
    parser.add_argument("--steps", type=int, default=8, help="training: timed steps a launch")
    parser.add_argument("--warmup", type=int, default=2, help="training: steps dropped")
    parser.add_argument("--rounds", type=int, default=3, help="training: launches per side")
    parser.add_argument("--json", help="write the record here too")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--base-dist", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return update_worker(args.model, args.reps, Path(args.base_dist), Path(args.worker))
    base = args.base or base_revision()
    work = Path(tempfile.mkdtemp(prefix="bench-ddp-"))
    base_tree = work / "base-tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), base],
                   cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    port = 29600 + os.getpid() % 300
    try:
        sync = measure_update(args, base_tree, work, port)
        print("  update: done", flush=True)
        training = measure_training(args, base_tree, work, port + 1)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT)
    report(args, base, sync, training)


if __name__ == "__main__":
    main()
