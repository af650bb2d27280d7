"""The real-model preflight, timed phase by phase, for two source trees (before and after a
change): `grpolab preflight` on examples/smollm2-arithmetic.yaml in a process of its own per
run, PYTHONPATH set to each tree's src/, the trees alternating, --repeats runs each. A phase
is the time from one progress line ("preflight   12.3 s  doing ...") to the next; the last
one ends with the process. Prints a markdown table (median of the repeats, after / before)
and writes JSON (--json).

    python bench/preflight_time.py --before /path/to/old/tree --after . --repeats 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

LINE = re.compile(r"^preflight\s+([0-9.]+) s\s+(.*)$")
CONFIG = "examples/smollm2-arithmetic.yaml"


def phase_name(text: str) -> str:
    """A progress line's phase, without the counts that may differ between trees."""
    text = text.split(":")[0] if ":" in text[:40] else text
    return " ".join(re.sub(r"[0-9]+", "N", text).split()[:6])


def run_once(tree: Path, config: Path, threads: int | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    env.pop("GRPOLAB_PREFLIGHT_CACHE", None)
    cmd = [sys.executable, "-m", "grpolab", "preflight", "--config", str(config)]
    if threads:
        cmd.append(f"runtime.num_threads={threads}")
    load = os.getloadavg()[0]
    tic = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    total = time.perf_counter() - tic
    marks = [(float(m[1]), phase_name(m[2])) for m in map(LINE.match, out.stdout.splitlines()) if m]
    # The lines' clock starts after the imports: the last phase runs to the process's end
    # and takes the start-up (imports, config) with it, so the phases add up to the total.
    phases: dict[str, float] = {}
    for (t, name), (end, _) in itertools.pairwise(marks):
        phases[name] = phases.get(name, 0.0) + end - t
    if marks:
        last = f"{marks[-1][1]} (+ start-up, exit)"
        phases[last] = total - sum(phases.values())
    passed = out.returncode == 0 and "all checks pass" in out.stdout
    return {"total_s": total, "phases": phases, "passed": passed, "load": load,
            "tail": out.stdout[-400:] + out.stderr[-400:]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="the source tree before")
    ap.add_argument("--after", type=Path, default=Path("."), help="the source tree after")
    ap.add_argument("--config", type=Path, default=None, help=f"default: {CONFIG} of --after")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=None, help="runtime.num_threads (default: the config's)"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    config = (args.config or trees["after"] / CONFIG).resolve()
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for i in range(args.repeats):
        for label in ("before", "after") if i % 2 == 0 else ("after", "before"):
            r = run_once(trees[label], config, args.threads)
            runs[label].append(r)
            print(f"# {label} run {i + 1}: {r['total_s']:.1f} s, load {r['load']:.2f}, "
                  f"{'pass' if r['passed'] else 'FAIL'}", file=sys.stderr, flush=True)  # fmt: skip
            if not r["passed"]:
                print(r["tail"], file=sys.stderr)
    names: list[str] = []
    for label in trees:
        for r in runs[label]:
            names += [n for n in r["phases"] if n not in names]

    def median(label: str, name: str | None) -> float:
        values = [r["total_s"] if name is None else r["phases"].get(name, 0.0) for r in runs[label]]
        return statistics.median(values)

    rows = []
    for name in [*names, None]:
        b, a = median("before", name), median("after", name)
        rows.append({"phase": name or "total (process)", "before_s": b, "after_s": a,
                     "ratio": a / b if b else None})  # fmt: skip
    loads = [r["load"] for label in trees for r in runs[label]]
    print("| phase | before (s) | after (s) | after / before |\n|---|---|---|---|")
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        print(f"| {row['phase']} | {row['before_s']:.1f} | {row['after_s']:.1f} | {ratio} |")
    result = {
        "config": str(config),
        "repeats": args.repeats,
        "threads": args.threads or "config",
        "cpus": os.cpu_count(),
        "load_1min": {"min": min(loads), "max": max(loads)},
        "passed": all(r["passed"] for label in trees for r in runs[label]),
        "phases": rows,
        "runs": {
            k: [{kk: vv for kk, vv in r.items() if kk != "tail"} for r in v]
            for k, v in runs.items()
        },
    }
    print(f"\nload (1 min) {min(loads):.2f}-{max(loads):.2f}, {os.cpu_count()} CPUs, "
          f"threads {result['threads']}")  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
