"""Prove that a change moved no number: run the same training runs with this tree and with
another commit's, and compare metrics.jsonl (wall-clock metrics aside; metrics only this
tree logs are listed, not compared) and the final weights bit for bit.

    .venv/bin/python scripts/same_numbers.py BASE_REV [--only demo,lora,...] [--keep DIR]
        [--new-only KEY=VALUE ...]

BASE_REV is checked out into a temporary git worktree; both trees run in this environment
(PYTHONPATH selects the tree); `--new-only` overrides go to this tree's runs alone (a key the
base does not have, e.g. to turn a new path off). Exit 0 when every run is identical, 1
otherwise. A whole
pass (the 400-step demo and eight short runs, twice) takes about 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
TIME_KEYS = ("time/", "tokens_per_s")  # wall-clock metrics: never equal between two runs
# The keys by their older names (trainer.<key>): the trees before the config's sections read
# only those, and every later tree reads them as the new ones.
SMALL = ["trainer.prompts_per_step=4", "trainer.num_generations=4", "trainer.eval_examples=32"]
QUIET = ["trainer.progress=false", "--skip-preflight"]

# name -> (launcher, [overrides], resume from checkpoint-N of the same command with fewer steps)
RUNS: dict[str, tuple[str, list[str], int | None]] = {
    "demo": ("python", [], None),
    "lora": ("python", [*SMALL, "max_steps=6", "trainer.lora_r=8", "trainer.beta=0.05"], None),
    "num_iterations=2": (
        "python",
        [*SMALL, "max_steps=6", "trainer.num_iterations=2", "trainer.mini_batch_size=8"],
        None,
    ),
    "beta>0": ("python", [*SMALL, "max_steps=6", "trainer.beta=0.04"], None),
    "torchrun 2 ranks": ("torchrun", [*SMALL, "max_steps=4", "trainer.save_steps=2"], None),
    "torchrun 2 ranks lora": (
        "torchrun",
        [
            *SMALL,
            "max_steps=4",
            "trainer.lora_r=8",
            "trainer.beta=0.05",
            "trainer.gradient_accumulation_steps=2",
        ],
        None,
    ),
    "torchrun 2 ranks accumulation": (
        "torchrun",
        [
            *SMALL,
            "max_steps=4",
            "trainer.gradient_accumulation_steps=2",
            "trainer.num_iterations=2",
            "trainer.mini_batch_size=8",
            "trainer.gradient_checkpointing=true",
        ],
        None,
    ),
    "torchrun 2 ranks compile": (
        "torchrun",
        [
            *SMALL,
            "max_steps=3",
            "trainer.torch_compile=true",
            "trainer.gradient_accumulation_steps=2",
            "trainer.ddp_bucket_mb=0.05",
        ],
        None,
    ),
    "resume": ("python", [*SMALL, "max_steps=6", "trainer.save_steps=3"], 3),
}


def run(tree: Path, launcher: str, overrides: list[str], out: Path, extra=()) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1"}
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        cmd += ["--master_port", str(29500 + os.getpid() % 1000), "-m", "grpolab"]
    else:
        cmd = [sys.executable, "-m", "grpolab"]
    cmd += ["train", f"output_dir={out}", *overrides, *QUIET, *extra]
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed in {tree}:\n{done.stderr[-3000:]}")


def one(tree: Path, name: str, out: Path, extra: tuple[str, ...] = ()) -> None:
    launcher, overrides, resume_at = RUNS[name]
    overrides = [*overrides, *extra]
    if resume_at is None:
        run(tree, launcher, overrides, out)
        return
    first = [o for o in overrides if not o.startswith("max_steps=")] + [f"max_steps={resume_at}"]
    run(tree, launcher, first, out)
    run(tree, launcher, overrides, out, extra=["--resume"])


def metric_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    last = max(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return load_file(str(last / "model.safetensors"))


def added_metrics(a: Path, b: Path) -> list[str]:
    """Metrics the new tree (b) logs that the base (a) did not log at all: new numbers, not
    moved ones, listed beside the verdict."""
    keys_a = {k for r in metric_rows(a) for k in r}
    return sorted({k for r in metric_rows(b) for k in r} - keys_a)


def compare(a: Path, b: Path) -> str | None:
    """None when both runs logged the same metrics (every metric the base logs; the new
    tree may log more) and ended with the same weights."""
    rows_a, rows_b = metric_rows(a), metric_rows(b)
    if len(rows_a) != len(rows_b):
        return f"{len(rows_a)} vs {len(rows_b)} metric rows"
    for ra, rb in zip(rows_a, rows_b, strict=True):
        if any(k not in rb or ra[k] != rb[k] for k in ra):
            keys = sorted(k for k in ra if ra.get(k) != rb.get(k))
            return f"step {ra.get('step')}: {keys[:5]} differ"
    wa, wb = final_weights(a), final_weights(b)
    if wa.keys() != wb.keys():
        return "different weight names"
    worst = max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa)
    if worst != 0.0:
        return f"final weights differ by up to {worst:.3g}"
    summary_a = json.loads((a / "summary.json").read_text())
    summary_b = json.loads((b / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "eval_history"):
        if summary_a.get(key) != summary_b.get(key):
            return f"summary {key}: {summary_a.get(key)} vs {summary_b.get(key)}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the commit to compare with (e.g. HEAD~3)")
    parser.add_argument("--only", help="comma-separated run names: " + ", ".join(RUNS))
    parser.add_argument("--keep", help="keep the run directories here")
    parser.add_argument("--new-only", nargs="*", default=[], help="overrides for this tree alone")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; known: {list(RUNS)}")
    work = Path(args.keep or tempfile.mkdtemp(prefix="same-numbers-"))
    base_tree = work / "base-tree"
    if not base_tree.exists():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base_tree), args.base],
            cwd=ROOT, check=True, capture_output=True,
        )  # fmt: skip
    failed = 0
    try:
        print(f"{'run':<20} result")
        for name in names:
            slug = name.replace(" ", "-").replace(">", "gt").replace("=", "")
            for tree, side, extra in ((base_tree, "base", ()), (ROOT, "new", args.new_only)):
                one(tree, name, work / side / slug, tuple(extra))
            verdict = compare(work / "base" / slug, work / "new" / slug)
            failed += verdict is not None
            added = added_metrics(work / "base" / slug, work / "new" / slug)
            note = f" (new metrics: {', '.join(added)})" if added else ""
            print(f"{name:<20} {'identical' if verdict is None else 'DIFFERS: ' + verdict}{note}")
    finally:
        if not args.keep:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
