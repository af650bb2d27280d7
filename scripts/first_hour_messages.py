"""What a new user's mistakes print: each bad input of a first hour with one's own task, run
through the real command against one or two source trees (say, a release and this one), with
the exit code, the time, the message's last line and what was left in the run directory.

    python scripts/first_hour_messages.py                     # this tree
    python scripts/first_hour_messages.py --before OLD/src    # and another, side by side

Prints a markdown table (and --json FILE writes the rows)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = "".join(json.dumps({"prompt": f"{i}+{i + 1}=", "answer": str(2 * i + 1)}) + "\n"
               for i in range(20))  # fmt: skip

REWARDS = '''
def no_return(completions, **kwargs):
    [1.0 for _ in completions]

def scalar(completions, **kwargs):
    return 0.5

def nothing(completions, **kwargs):
    return [None] * len(completions)
'''

# (what, files to write {name: text}, the command's arguments after `grpolab`)
CASES = [
    ("rewards.functions a YAML scalar", {"c.yaml": "rewards:\n  functions: accuracy\n"},
     ["train", "--config", "c.yaml", "output_dir=run", "max_steps=1"]),
    ("columns question/solution_text",
     {"q.jsonl": '{"question": "1+1=", "solution_text": "2"}\n' * 20},
     ["train", "task.name=jsonl", "task.path=q.jsonl", "output_dir=run", "max_steps=1"]),
    ("a JSONL file with a UTF-8 BOM", {"bom.jsonl": "\ufeff" + ROWS},
     ["train", "task.name=jsonl", "task.path=bom.jsonl", "batch.prompts_per_step=4",
      "output_dir=run", "max_steps=1"]),
    ("a 20-row file, default batch", {"rows.jsonl": ROWS},
     ["train", "task.name=jsonl", "task.path=rows.jsonl", "output_dir=run", "max_steps=1"]),
    ("a 20-row file, 8 prompts per step", {"rows.jsonl": ROWS},
     ["train", "task.name=jsonl", "task.path=rows.jsonl", "batch.prompts_per_step=8",
      "output_dir=run", "max_steps=1"]),
    ("a reward with no return", {"r.py": REWARDS},
     ["train", "rewards.functions=[accuracy,r.py:no_return]", "output_dir=run", "max_steps=1"]),
    ("a reward returning a scalar", {"r.py": REWARDS},
     ["train", "rewards.functions=[accuracy,r.py:scalar]", "output_dir=run", "max_steps=1"]),
    ("a reward returning None everywhere", {"r.py": REWARDS},
     ["train", "rewards.functions=[r.py:nothing]", "output_dir=run", "max_steps=1"]),
    ("model.name_or_path=smollm2-135m (typo)", {},
     ["train", "model.name_or_path=smollm2-135m", "output_dir=run", "max_steps=1"]),
    ("logging.report_to=[wandb], no wandb", {},
     ["train", "logging.report_to=[wandb]", "output_dir=run", "max_steps=1"]),
    ("a top-level learning_rate=1e-4", {},
     ["train", "learning_rate=1e-4", "output_dir=run", "max_steps=1"]),
    ("a key without effect (kl_estimator, beta=0)", {},
     ["train", "objective.kl_estimator=k2", "output_dir=run", "max_steps=1"]),
    ("--resume of a directory with no checkpoint", {"run/config.yaml": "max_steps: 1\n",
                                                    "run/metrics.jsonl": ""},
     ["train", "output_dir=run", "max_steps=1", "--resume"]),
    ("the same command after a start that never trained",
     {"run/config.yaml": "max_steps: 1\n", "run/metrics.jsonl": ""},
     ["train", "output_dir=run", "max_steps=1"]),
]


def run_case(src: Path, files: dict[str, str], args: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="grpolab-first-hour-") as tmp:
        where = Path(tmp)
        for name, text in files.items():
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            (where / name).write_text(text, encoding="utf-8")
        env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1",
               "GRPOLAB_PREFLIGHT_CACHE": str(where / ".preflight-cache")}  # fmt: skip
        tic = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "grpolab", *args], cwd=where, env=env,
                              capture_output=True, text=True, timeout=1200)  # fmt: skip
        seconds = time.perf_counter() - tic
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        said = next((line for line in reversed(lines) if line.startswith("grpolab")), "")
        warned = [line for line in lines if line.startswith("warning:")]
        run = where / "run"
        left = sorted(p.name for p in run.iterdir()) if run.is_dir() else []
        traceback = "Traceback (most recent call last)" in done.stderr
        return {"rc": done.returncode, "seconds": round(seconds, 1), "said": said or
                (warned[0] if warned else lines[-1] if lines else ""), "left": left,
                "traceback": traceback}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another tree's src/ to run first")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    trees = ([("before", args.before)] if args.before else []) + [("now", ROOT / "src")]
    rows = []
    for what, files, command in CASES:
        row = {"case": what, "command": "grpolab " + " ".join(command)}
        for label, src in trees:
            row[label] = run_case(src, files, command)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    print(f"| case | {' | '.join(label for label, _ in trees)} |")
    print("|---|" + "---|" * len(trees))
    for row in rows:
        cells = []
        for label, _ in trees:
            r = row[label]
            left = f"; left: {', '.join(r['left'])}" if r["left"] else ""
            tb = "; TRACEBACK" if r["traceback"] else ""
            said = r["said"].replace("|", "\\|")
            cells.append(f"rc {r['rc']}, {r['seconds']} s: {said}{left}{tb}")
        print(f"| {row['case']} | {' | '.join(cells)} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
