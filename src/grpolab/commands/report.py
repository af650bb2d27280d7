"""`grpolab report RUN_DIR`: the run's curves as PNG files (`report_plots`), report.md, and
report.html, one self-contained page with the curves, sample completions from early, middle
and late steps with the strict verdict, the objective card and the preflight table
(`report_html`): a reward that is being gamed draws a rising curve, and only the completions
show what it pays for. A run cut short, a torn line or a missing file is said, not fatal.

`grpolab report RUN_A RUN_B ...` compares runs: their curves overlaid (one colour per run,
each named by its directory and the config keys in which the runs differ), their results side
by side, in a directory of its own (`--output`, by default compare-<names> beside the first
run), so that no run's own report is overwritten."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpolab.commands.report_html import ComparePage, Page, RunCard, compare_page, html_page
from grpolab.commands.report_plots import (
    COLOUR_NAMES,
    COLOURS,
    Curves,
    Figure,
    constant_reasons,
    draw,
    plan_figures,
    series,
)
from grpolab.tasks.answers import infer_answer_kind
from grpolab.tasks.strict import strict_equal
from grpolab.train.tracking import read_jsonl_counting

SAMPLES_PER_STEP = 4  # completions shown for each of the early, middle and late steps
TABLE_METRICS = (  # the metrics table: first step against the mean of the last 20
    "reward/mean",
    "reward/std",
    "accuracy",
    "strict_accuracy",
    "monitor/reward_strict_gap",
    "frac_reward_zero_std",
    "completion_length/mean",
    "entropy",
    "lr",
    "loss",
    "kl",
    "clip_frac",
    "ratio_mean",
    "grad_norm",
    "time/step",
    "tokens_per_s",
)
HELD_OUT = (("eval_accuracy", "accuracy"), ("eval_strict_accuracy", "strict_accuracy"))
RUN_SPECIFIC = ("output_dir",)  # config keys that differ between any two runs by design
LABEL_KEYS = 3  # a run's legend names at most this many of the keys the runs differ in
LONGEST_NAME = 80  # a comparison's default directory name, compare-<names>, at most


@dataclass
class RunFiles:
    """What a run directory holds, each file read as far as it can be."""

    path: Path
    rows: list[dict[str, Any]]  # metrics.jsonl, one per step
    summary: dict[str, Any]  # summary.json ({} when the run did not finish)
    config: dict[str, Any]  # config.yaml
    completions: list[dict[str, Any]]  # completions.jsonl
    objective: str | None  # objective.txt
    preflight: dict[str, Any] | None  # preflight.json
    warnings: list[str] = field(default_factory=list)  # what is missing or damaged


def read_run(run_dir: str | Path) -> RunFiles:
    path = Path(run_dir)
    rows, torn = read_jsonl_counting(path / "metrics.jsonl")
    rows = [r for r in rows if isinstance(r.get("step"), int)]
    if not rows:
        raise FileNotFoundError(f"{str(path)!r} holds no metrics.jsonl with records")
    warnings = [f"metrics.jsonl: {torn} unreadable line(s) skipped"] if torn else []
    completions, torn = read_jsonl_counting(path / "completions.jsonl")
    warnings += [f"completions.jsonl: {torn} unreadable line(s) skipped"] if torn else []
    objective = path / "objective.txt"
    run = RunFiles(
        path=path,
        rows=rows,
        summary=_read(path / "summary.json", json.loads, warnings) or {},
        config=_read(path / "config.yaml", yaml.safe_load, warnings) or {},
        completions=completions,
        objective=objective.read_text(errors="replace") if objective.is_file() else None,
        preflight=_read(path / "preflight.json", json.loads, warnings),
        warnings=warnings,
    )
    run.warnings += _run_warnings(run)
    return run


def _read(path: Path, parse, warnings: list[str]) -> dict[str, Any] | None:
    """A JSON or YAML mapping; None (and a warning when the file exists) if it cannot be read."""
    if not path.is_file():
        return None
    try:
        value = parse(path.read_text(errors="replace"))
    except (ValueError, yaml.YAMLError) as e:
        warnings.append(f"{path.name} is unreadable ({str(e).splitlines()[0]})")
        return None
    if not isinstance(value, dict):
        warnings.append(f"{path.name} does not hold a mapping")
        return None
    return value


def _run_warnings(run: RunFiles) -> list[str]:
    warnings = []
    last, max_steps = run.rows[-1]["step"], run.config.get("max_steps")
    if not run.summary:
        of = f" of {max_steps}" if isinstance(max_steps, int) else ""
        warnings.append(f"no summary.json: the run did not finish (last logged step {last}{of})")
    pre = run.preflight
    if pre is None and not (run.path / "preflight.json").is_file():
        warnings.append("no preflight.json: the checks of this run were not recorded")
    elif pre is not None and pre.get("skipped"):
        warnings.append(str(pre.get("warning", "preflight skipped")))
    elif pre is not None and not pre.get("passed", True):
        failed = [str(c.get("id")) for c in pre.get("checks", []) if not c.get("passed")]
        warnings.append(f"preflight failed: {', '.join(failed)}")
    monitored = [r for r in run.rows if r.get("warnings")]
    if monitored:
        first = monitored[0]
        warnings.append(
            f"monitor warnings at {len(monitored)} step(s); the first, at step {first['step']}: "
            f"{first['warnings'][0]}"
        )
    return warnings


def plot_rows(run: RunFiles) -> list[dict[str, Any]]:
    """metrics.jsonl with the held-out accuracy before (step 0) and after training (the last
    step) from summary.json, all in percent as logged."""
    before, after = {"step": 0}, {"step": run.summary.get("steps", run.rows[-1]["step"])}
    for key, name in HELD_OUT:
        for row, when in ((before, "before"), (after, "after")):
            value = run.summary.get(f"{name}_{when}")
            if isinstance(value, int | float):
                row[key] = value
    return [r for r in (before,) if len(r) > 1] + run.rows + [r for r in (after,) if len(r) > 1]


def write_reports(run_dirs: list[str], output: str | None = None) -> Path:
    """`grpolab report`: one run's report, or several runs compared; returns report.md's path."""
    if len(run_dirs) == 1:
        return write_report(run_dirs[0], output)
    return write_comparison(run_dirs, output)


def write_report(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Write the plots, report.md and report.html into RUN_DIR (or `output`); returns
    report.md's path."""
    run = read_run(run_dir)
    out = output_dir([run], output, default=run.path)
    rows = plot_rows(run)
    figures = plan_figures([Curves(rows, constant_reasons(run.config, run.rows))])
    draw(figures, out)
    samples = pick_samples(run.completions, kind=answer_kind(run.config, run.completions))
    report = out / "report.md"
    report.write_text("\n".join(markdown(run, figures, samples)) + "\n")
    page = Page(
        name=run.path.name,
        path=str(run.path.resolve()),
        facts=headline(run),
        warnings=run.warnings,
        figures=figures,
        metrics=metrics_table(run.rows),
        samples=samples,
        objective=run.objective,
        preflight=run.preflight,
    )
    (out / "report.html").write_text(html_page(page))
    names = ", ".join(f.name for f in figures)
    print(f"wrote {report}, {out / 'report.html'} and {len(figures)} plots: {names}")
    return report


def output_dir(runs: list[RunFiles], output: str | Path | None, default: Path) -> Path:
    """Where a report goes: `output`, else `default`; never another run's directory, whose
    own report.html it would overwrite."""
    out = Path(output) if output is not None else default
    own = len(runs) == 1 and out.resolve() == runs[0].path.resolve()
    if (out / "metrics.jsonl").is_file() and not own:
        raise ValueError(
            f"--output {out} is a run directory (it holds metrics.jsonl) and its own report "
            f"would be overwritten: name another directory"
        )
    out.mkdir(parents=True, exist_ok=True)
    return out


def headline(run: RunFiles) -> list[tuple[str, str]]:
    """The facts at the top of the page: held-out accuracy before and after, the steps, time."""
    s, facts = run.summary, []
    for name, what in (("accuracy", "held-out accuracy"), ("strict_accuracy", "held-out strict")):
        before, after = s.get(f"{name}_before"), s.get(f"{name}_after")
        if isinstance(before, int | float) and isinstance(after, int | float):
            facts.append(
                (f"{what} ({after - before:+.1f} points)", f"{before:.1f}% → {after:.1f}%")
            )
    max_steps = run.config.get("max_steps")
    steps = s.get("steps", run.rows[-1]["step"])
    facts.append(("steps", f"{steps} of {max_steps}" if isinstance(max_steps, int) else f"{steps}"))
    if isinstance(s.get("wall_seconds"), int | float):
        facts.append(("wall time", f"{s['wall_seconds']:.0f} s"))
    skipped = s.get("skipped_steps", run.rows[-1].get("skipped_steps"))
    facts.append(("skipped steps (non-finite)", str(skipped if skipped is not None else "n/a")))
    pre = run.preflight
    if pre is not None and not pre.get("skipped") and isinstance(pre.get("checks"), list):
        failed = sum(not c.get("passed") for c in pre["checks"] if isinstance(c, dict))
        verdict = f"{failed} failed" if failed else "all pass"
        facts.append((f"preflight, {len(pre['checks'])} checks", verdict))
    return facts


def metrics_table(rows: list[dict[str, Any]], tail: int = 20) -> list[tuple[str, str, str]]:
    """(metric, first step, mean of the last `tail` steps) for the metrics the run logged."""
    table = []
    for key in TABLE_METRICS:
        _, first = series(rows[:1], key)
        last = last_mean(rows, key, tail)
        if first or last != "n/a":
            table.append((key, f"{first[0]:.4g}" if first else "n/a", last))
    return table


def last_mean(rows: list[dict[str, Any]], key: str, tail: int = 20) -> str:
    """The mean of a metric over the last `tail` steps, "n/a" where none logged it."""
    _, last = series(rows[-tail:], key)
    return f"{sum(last) / len(last):.4g}" if last else "n/a"


def markdown(run: RunFiles, figures: list[Figure], samples) -> list[str]:
    """report.md: the result, the metrics table, the plots and the sample completions."""
    lines = [f"# Run report: {run.path.name}", ""]
    s = run.summary
    if s:
        before, after = s.get("accuracy_before"), s.get("accuracy_after")
        if before is not None and after is not None:
            lines.append(
                f"**Held-out accuracy: {before:.1f}% -> {after:.1f}% "
                f"({after - before:+.1f} points)** on {s.get('eval_examples')} problems."
            )
        strict = s.get("strict_accuracy_before"), s.get("strict_accuracy_after")
        if None not in strict:
            lines.append(
                f"Strict held-out accuracy (the final answer exactly the reference): "
                f"{strict[0]:.1f}% -> {strict[1]:.1f}%."
            )
        lines.append(
            f"Steps: {s.get('steps')}, skipped (non-finite): "
            f"{s.get('skipped_steps', 0)}, wall time: {s.get('wall_seconds', 0):.0f} s."
        )
        lines.append("")
    lines += [f"- {w}" for w in run.warnings] + ([""] if run.warnings else [])
    lines += ["| metric | first step | mean of last 20 steps |", "|---|---|---|"]
    lines += [f"| {k} | {a} | {b} |" for k, a, b in metrics_table(run.rows)]
    lines += ["", "## Plots", "", "Also in report.html, with the objective and the preflight.", ""]
    lines += [f"![{f.name}]({f.name})" for f in figures]
    return [*lines, "", *sample_lines(samples)]


def pick_samples(
    records: list[dict[str, Any]], n: int = SAMPLES_PER_STEP, kind: str = "number"
) -> list[tuple[int, str, list[dict[str, Any]]]]:
    """The first, middle and last logged steps of completions.jsonl: (step, "early" | "middle"
    | "late", up to n of its records, each with "strict": the final answer is the reference,
    judged as answers of `kind`)."""
    steps = sorted({r["step"] for r in records if isinstance(r.get("step"), int)})
    if not steps:
        return []
    picked = {steps[len(steps) // 2]: "middle"}  # step -> label: first and last win ties
    picked |= {steps[-1]: "late"} | {steps[0]: "early"}
    out = []
    for step in sorted(picked):
        chosen = [r for r in records if r.get("step") == step][:n]
        chosen = [r | {"strict": judged(r, kind)} for r in chosen]
        out.append((step, picked[step], chosen))
    return out


def judged(record: dict[str, Any], kind: str) -> bool:
    """Whether a logged completion's final answer is its reference (the strict check)."""
    return strict_equal(str(record.get("completion", "")), str(record.get("answer", "")), kind)


def answer_kind(config: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """The run's answer kind: its config's task.answer_kind, else the arithmetic task's
    number, else inferred from the logged reference answers as the run inferred it."""
    task = config.get("task") or {}
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
    return sample_lines(pick_samples(records, n, kind))


def sample_lines(samples: list[tuple[int, str, list[dict[str, Any]]]]) -> list[str]:
    lines = ["## Sample completions", ""]
    if not samples:
        return [*lines, "No completions were logged (logging.log_completions_steps=0)."]
    lines += [
        "The training reward beside the strict check (the final answer, as written, is exactly "
        "the reference). A reward that pays where the strict check says no is being gamed.",
        "",
    ]
    for step, when, records in samples:
        lines += [f"### Step {step} ({when})", ""]
        lines += ["| prompt | completion | answer | reward | strict |", "|---|---|---|---|---|"]
        for r in records:
            reward = r.get("reward")
            shown = f"{reward:.3g}" if isinstance(reward, int | float) else "n/a"
            verdict = "yes" if r["strict"] else "**no**"
            cells = (_cell(r.get("prompt", "")), _cell(r.get("completion", "")))
            cells += (_cell(r.get("answer", "")), shown, verdict)
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _cell(text: Any, width: int = 160) -> str:
    """A markdown table cell: one line, pipes escaped, long texts cut in the middle."""
    text = str(text).replace("`", "'").replace("|", "\\|").replace("\n", " ⏎ ")
    if len(text) > width:
        text = text[: width // 2 - 2] + " … " + text[-(width // 2 - 2) :]
    return f"`{text}`" if text.strip() else "(empty)"


# --- Comparing runs ---------------------------------------------------------------------------


def write_comparison(run_dirs: list[str | Path], output: str | Path | None = None) -> Path:
    """Several runs compared: their curves overlaid (one colour per run), their results side by
    side, the config keys they differ in; report.md, report.html and the plots into `output`
    (default: compare-<names> beside the first run). Returns report.md's path."""
    where = [Path(d).resolve() for d in run_dirs]
    for d, resolved in zip(run_dirs, where, strict=True):
        if where.count(resolved) > 1:
            raise ValueError(f"{str(d)!r} is named twice: compare different runs")
    runs = [read_run(d) for d in run_dirs]
    out = output_dir(runs, output, default=comparison_name(runs))
    names = [str(run.path) for run in runs]
    differences = config_differences([run.config or None for run in runs])
    legend = [
        run_label(name, {k: v[i] for k, v in differences.items()}) for i, name in enumerate(names)
    ]
    curves = [
        Curves(plot_rows(run), constant_reasons(run.config, run.rows), name)
        for run, name in zip(runs, names, strict=True)
    ]
    figures = plan_figures(curves, legend)
    draw(figures, out)
    warnings = [f"{name}: {w}" for run, name in zip(runs, names, strict=True) for w in run.warnings]
    missing = [name for run, name in zip(runs, names, strict=True) if not run.config]
    warnings += [f"{name}: no config.yaml, its settings are not compared" for name in missing]
    report = out / "report.md"
    lines = comparison_markdown(runs, legend, differences, warnings, figures)
    report.write_text("\n".join(lines) + "\n")
    page = ComparePage(
        names=names,
        path=str(out.resolve()),
        runs=[
            RunCard(label, COLOURS[i % len(COLOURS)], headline(run))
            for i, (run, label) in enumerate(zip(runs, legend, strict=True))
        ],
        warnings=warnings,
        differences=list(differences.items()),
        figures=figures,
        metrics=compared_metrics(runs),
    )
    (out / "report.html").write_text(compare_page(page))
    print(
        f"wrote {report}, {out / 'report.html'} and {len(figures)} plots comparing {len(runs)} runs"
    )
    return report


def comparison_name(runs: list[RunFiles]) -> Path:
    """compare-<each run's directory name>, beside the first run."""
    names = "-".join(run.path.resolve().name for run in runs)
    if len(names) > LONGEST_NAME:
        names = f"{runs[0].path.resolve().name}-and-{len(runs) - 1}-more"
    return runs[0].path.resolve().parent / f"compare-{names}"


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """config.yaml's sections as dotted keys: {"optim.learning_rate": 0.0003, ...}."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= flat_config(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_differences(configs: list[dict[str, Any] | None]) -> dict[str, list[str | None]]:
    """The dotted keys whose values differ between the runs' configs -> each run's value as an
    override writes it ("(absent)" where its config lacks the key; None for a run without a
    config, which is not compared). The run's own output_dir differs by design."""
    flats = [None if c is None else flat_config(c) for c in configs]
    known = [f for f in flats if f is not None]
    keys = dict.fromkeys(k for f in known for k in f if k not in RUN_SPECIFIC)
    differences = {}
    for key in keys:
        values = [f.get(key, "(absent)") for f in known]
        if any(v != values[0] for v in values):
            shown = (None if f is None else override_text(f.get(key, "(absent)")) for f in flats)
            differences[key] = list(shown)
    return differences


def override_text(value: Any) -> str:
    """A config value as an override writes it: 1e-4, cosine, [accuracy, format], null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):  # the fewest digits that read back as the value
        if value != 0 and math.isfinite(value) and not 1e-3 <= abs(value) < 1e5:
            digits = next(d for d in range(17) if float(f"{value:.{d}e}") == value)
            mantissa, exponent = f"{value:.{digits}e}".split("e")
            return f"{mantissa}e{int(exponent)}"
        return next(f"{value:.{d}g}" for d in range(1, 18) if float(f"{value:.{d}g}") == value)
    if isinstance(value, list):
        return "[" + ", ".join(override_text(v) for v in value) + "]"
    return str(value)


def run_label(name: str, values: dict[str, str | None]) -> str:
    """A run in a comparison's legends: its directory and its values of the keys the runs
    differ in ("runs/a (optim.learning_rate=1e-4)"), the first LABEL_KEYS of them."""
    said = [f"{k}={v}" for k, v in values.items() if v is not None]
    if not said:
        return name
    more = f", +{len(said) - LABEL_KEYS} more" if len(said) > LABEL_KEYS else ""
    return f"{name} ({', '.join(said[:LABEL_KEYS])}{more})"


def compared_metrics(runs: list[RunFiles], tail: int = 20) -> list[tuple[str, list[str]]]:
    """(metric, each run's mean of its last `tail` steps) for the metrics some run logged."""
    table = [(key, [last_mean(run.rows, key, tail) for run in runs]) for key in TABLE_METRICS]
    return [(key, means) for key, means in table if any(m != "n/a" for m in means)]


def result_cells(run: RunFiles) -> list[str]:
    """A run's held-out accuracy, strict accuracy (before -> after), steps and wall time."""
    s, cells = run.summary, []
    for name in ("accuracy", "strict_accuracy"):
        before, after = s.get(f"{name}_before"), s.get(f"{name}_after")
        numbers = isinstance(before, int | float) and isinstance(after, int | float)
        cells.append(f"{before:.1f}% -> {after:.1f}% ({after - before:+.1f})" if numbers else "n/a")
    cells.append(str(s.get("steps", run.rows[-1]["step"])))
    wall = s.get("wall_seconds")
    cells.append(f"{wall:.0f} s" if isinstance(wall, int | float) else "n/a")
    return cells


def comparison_markdown(
    runs: list[RunFiles],
    legend: list[str],
    differences: dict[str, list[str | None]],
    warnings: list[str],
    figures: list[Figure],
) -> list[str]:
    """report.md of a comparison: the runs' results, the config keys they differ in, the
    metrics side by side and the overlaid plots."""
    names = [str(run.path) for run in runs]
    lines = [f"# Run comparison: {', '.join(names)}", ""]
    lines += ["| colour | run | held-out accuracy | strict | steps | wall time |"]
    lines += ["|---|---|---|---|---|---|"]
    for i, (run, label) in enumerate(zip(runs, legend, strict=True)):
        cells = [COLOUR_NAMES[i % len(COLOUR_NAMES)], label, *result_cells(run)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *[f"- {w}" for w in warnings], *([""] if warnings else [])]
    lines += ["## Config differences", ""]
    if differences:
        lines += ["| key | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for key, values in differences.items():
            lines.append(f"| {key} | " + " | ".join(v or "n/a" for v in values) + " |")
    else:
        lines.append("The runs' config.yaml files differ in no key but output_dir.")
    lines += ["", "## Metrics (mean of the last 20 steps)", ""]
    lines += ["| metric | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(ms) + " |" for k, ms in compared_metrics(runs)]
    lines += ["", "## Plots", "", "One colour per run; each run's own report has its samples.", ""]
    return lines + [f"![{f.name}]({f.name})" for f in figures]
