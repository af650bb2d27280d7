"""`grpolab report RUN_DIR`: PNG plots of metrics.jsonl and a one-page summary (report.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpolab.tracking import read_jsonl

# (file name, title, [(metric, label)], y label)
PLOTS = (
    (
        "reward.png",
        "Reward and accuracy (training samples at T; held-out greedy)",
        [
            ("reward/mean", "reward mean"),
            ("accuracy", "accuracy"),
            ("eval_accuracy_frac", "held-out"),
        ],
        "",
    ),
    ("kl.png", "KL to the reference (k3)", [("kl", "kl")], "nats / token"),
    (
        "clip_frac.png",
        "Clipped fraction of tokens",
        [("clip_frac", "total"), ("clip_frac_low", "low"), ("clip_frac_high", "high")],
        "fraction",
    ),
    (
        "lengths.png",
        "Completion length",
        [("completion_length/mean", "mean"), ("completion_length/max", "max")],
        "tokens",
    ),
    (
        "time.png",
        "Time per step",
        [
            ("time/rollout", "rollout"),
            ("time/score", "score"),
            ("time/logprobs", "logprobs"),
            ("time/update", "update"),
        ],
        "seconds",
    ),
    ("loss.png", "Loss and gradient norm", [("loss", "loss"), ("grad_norm", "grad norm")], ""),
)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the raw curves of RL are noisy)."""
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            steps.append(r["step"])
            values.append(float(v))
    return steps, values


def write_report(run_dir: str | Path) -> Path:
    """Write the plots and report.md into RUN_DIR; returns the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if not rows:
        raise FileNotFoundError(f"{str(run_dir)!r} holds no metrics.jsonl with records")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    for r in rows:  # held-out accuracy is logged in percent; plot it as a fraction
        if isinstance(r.get("eval_accuracy"), (int, float)):
            r["eval_accuracy_frac"] = r["eval_accuracy"] / 100
    if isinstance(summary.get("accuracy_before"), (int, float)):  # before and after GRPO
        rows.insert(0, {"step": 0, "eval_accuracy_frac": summary["accuracy_before"] / 100})
    if isinstance(summary.get("accuracy_after"), (int, float)):
        rows[-1]["eval_accuracy_frac"] = summary["accuracy_after"] / 100
    window = max(1, len(rows) // 30)
    written = []
    for name, title, series, ylabel in PLOTS:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        drew = False
        for key, label in series:
            steps, values = _series(rows, key)
            if not steps:
                continue
            if key == "eval_accuracy_frac":
                ax.plot(steps, values, "o-", label=label)
            else:
                ax.plot(steps, values, alpha=0.25)
                ax.plot(steps, smooth(values, window), label=f"{label} (avg {window})")
            drew = True
        if drew:
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(run_dir / name, dpi=100)
            written.append(name)
        plt.close(fig)

    rows = [r for r in rows if len(r) > 2 or "eval_accuracy_frac" not in r]  # drop step 0
    last = rows[-1]

    def mean_of(key: str, tail: int = 20) -> str:
        _, values = _series(rows[-tail:], key)
        return f"{sum(values) / len(values):.4g}" if values else "n/a"

    lines = [f"# Run report: {run_dir.name}", ""]
    if summary:
        before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
        if before is not None and after is not None:
            lines.append(
                f"**Held-out accuracy: {before:.1f}% -> {after:.1f}% "
                f"({after - before:+.1f} points)** on {summary.get('eval_examples')} problems."
            )
        lines.append(
            f"Steps: {summary.get('steps')}, skipped (non-finite): "
            f"{summary.get('skipped_steps', 0)}, wall time: {summary.get('wall_seconds', 0):.0f} s."
        )
        lines.append("")
    first = rows[0]
    lines += [
        "| metric | first step | mean of last 20 steps |",
        "|---|---|---|",
    ]
    for key in (
        "reward/mean",
        "accuracy",
        "frac_reward_zero_std",
        "completion_length/mean",
        "loss",
        "kl",
        "clip_frac",
        "ratio_mean",
        "grad_norm",
        "time/step",
        "tokens_per_s",
    ):
        if key in last:
            v = first.get(key)
            shown = f"{v:.4g}" if isinstance(v, (int, float)) else "n/a"
            lines.append(f"| {key} | {shown} | {mean_of(key)} |")
    lines += ["", "## Plots", ""] + [f"![{n}]({n})" for n in written]
    report = run_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    print(f"wrote {report} and {len(written)} plots: {', '.join(written)}")
    return report
