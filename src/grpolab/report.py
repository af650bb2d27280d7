"""`grpolab report RUN_DIR`: PNG plots of metrics.jsonl and a one-page summary (report.md)
with sample completions from early, middle and late steps: a reward that is being gamed draws
a rising curve, and only the completions show what it pays for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpolab.strict import strict_equal
from grpolab.tasks.answers import infer_answer_kind
from grpolab.tracking import read_jsonl

SAMPLES_PER_STEP = 4  # completions shown for each of the early, middle and late steps

# (file name, title, [(metric, label)], y label)
PLOTS = (
    (
        "reward.png",
        "Reward and accuracy (training samples at T; held-out greedy)",
        [
            ("reward/mean", "reward mean"),
            ("accuracy", "accuracy"),
            ("strict_accuracy", "strict accuracy"),
            ("eval_accuracy_frac", "held-out"),
            ("eval_strict_accuracy_frac", "held-out strict"),
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
    held_out = (("eval_accuracy", "accuracy"), ("eval_strict_accuracy", "strict_accuracy"))
    for r in rows:  # held-out accuracy is logged in percent; plot it as a fraction
        for key, _ in held_out:
            if isinstance(r.get(key), (int, float)):
                r[f"{key}_frac"] = r[key] / 100
    before = {"step": 0}  # held-out accuracy before and after GRPO, from the summary
    for key, name in held_out:
        if isinstance(summary.get(f"{name}_before"), (int, float)):
            before[f"{key}_frac"] = summary[f"{name}_before"] / 100
        if isinstance(summary.get(f"{name}_after"), (int, float)):
            rows[-1][f"{key}_frac"] = summary[f"{name}_after"] / 100
    if len(before) > 1:
        rows.insert(0, before)
    window = max(1, len(rows) // 30)
    written = []
    for name, title, series, ylabel in PLOTS:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        drew = False
        for key, label in series:
            steps, values = _series(rows, key)
            if not steps:
                continue
            if key.startswith("eval_"):
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

    rows = [r for r in rows if r is not before]
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
        strict = summary.get("strict_accuracy_before"), summary.get("strict_accuracy_after")
        if None not in strict:
            lines.append(
                f"Strict held-out accuracy (the final answer exactly the reference): "
                f"{strict[0]:.1f}% -> {strict[1]:.1f}%."
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
        "strict_accuracy",
        "monitor/reward_strict_gap",
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
    records = read_jsonl(run_dir / "completions.jsonl")
    lines += ["", *sample_completions(records, kind=answer_kind(run_dir, records))]
    report = run_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    print(f"wrote {report} and {len(written)} plots: {', '.join(written)}")
    return report


def answer_kind(run_dir: Path, records: list[dict[str, Any]]) -> str:
    """The run's answer kind: its config's task.answer_kind, else the arithmetic task's
    number, else inferred from the logged reference answers as the run inferred it."""
    import yaml

    config = run_dir / "config.yaml"
    task = (yaml.safe_load(config.read_text()) or {}).get("task", {}) if config.is_file() else {}
    if task.get("answer_kind"):
        return task["answer_kind"]
    if task.get("name", "arithmetic") == "arithmetic":
        return "number"
    return infer_answer_kind([str(r.get("answer", "")) for r in records])[0]


def sample_completions(
    records: list[dict[str, Any]], n: int = SAMPLES_PER_STEP, kind: str = "number"
) -> list[str]:
    """report.md's section of completions.jsonl: the first, middle and last logged steps, up
    to n completions each, with their reward and whether the final answer is the reference
    (the strict check, judging answers of `kind`)."""
    lines = ["## Sample completions", ""]
    steps = sorted({r["step"] for r in records if isinstance(r.get("step"), int)})
    if not steps:
        return [*lines, "No completions were logged (trainer.log_completions_steps=0)."]
    lines += [
        "The training reward beside the strict check (the final answer, as written, is exactly "
        "the reference). A reward that pays where the strict check says no is being gamed.",
        "",
    ]
    picked = {steps[len(steps) // 2]: "middle"}  # step -> label: first and last win ties
    picked |= {steps[-1]: "late"} | {steps[0]: "early"}
    for step in sorted(picked):
        lines += [f"### Step {step} ({picked[step]})", ""]
        lines += ["| prompt | completion | answer | reward | strict |", "|---|---|---|---|---|"]
        for r in [r for r in records if r.get("step") == step][:n]:
            completion, answer = str(r.get("completion", "")), str(r.get("answer", ""))
            verdict = "yes" if strict_equal(completion, answer, kind) else "**no**"
            reward = r.get("reward")
            shown = f"{reward:.3g}" if isinstance(reward, (int, float)) else "n/a"
            cells = (_cell(r.get("prompt", "")), _cell(completion), _cell(answer), shown, verdict)
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _cell(text: Any, width: int = 160) -> str:
    """A markdown table cell: one line, pipes escaped, long texts cut in the middle."""
    text = str(text).replace("`", "'").replace("|", "\\|").replace("\n", " ⏎ ")
    if len(text) > width:
        text = text[: width // 2 - 2] + " … " + text[-(width // 2 - 2) :]
    return f"`{text}`" if text.strip() else "(empty)"
