"""The report's curves: which metrics share an axis, and drawing them (PNG files for report.md,
inline SVG for report.html). Three rules keep every curve readable:

- a series is drawn only on an axis scaled for it: the figures put only series of one unit
  together, and a series whose largest value is under a tenth of its panel's largest gets a
  panel of its own (a 1e-9 loss on a grad norm's axis is a flat line);
- series equal at every step are one line named for all of them (drawn twice they hide each
  other);
- a series that never changes is a note, "KL: 0 at every step (KL off: beta = 0)", not a
  flat line; beside changing series of its panel it stays as a dashed reference line.
"""

from __future__ import annotations

import io
import math
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SMALL = 0.1  # a series under this share of its panel's largest value gets a panel of its own
# Series closer than this share of their panel's span (a line's width at the report's size)
# are drawn as one line, with a note of their differences: drawn apart they hide each other.
NEAR = 0.02
NOTE_CHARS = 90  # a note is wrapped to lines of this many characters
POINTS_PER_CURVE = 30  # a longer curve is also drawn as a moving average of len // 30 steps
# Okabe-Ito colours and distinct dashes: lines that cross stay apart in colour and in print.
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
DASHES = ("-", "--", "-.", ":")


@dataclass(frozen=True)
class PanelSpec:
    ylabel: str
    series: tuple[tuple[str, str], ...]  # (metric, label)
    log: bool = False  # a log axis (phases of a step differ by orders of magnitude)
    points: bool = False  # evaluations: a few steps, drawn as markers
    missing: str = ""  # the note when none of its metrics was logged (else the panel is left out)


@dataclass(frozen=True)
class FigureSpec:
    name: str  # the PNG's file name, also the figure's id in report.html
    title: str
    panels: tuple[PanelSpec, ...]


FIGURES = (
    FigureSpec(
        "reward.png",
        "Training reward and accuracy (samples at the training temperature)",
        (
            PanelSpec("reward mean", (("reward/mean", "reward mean"),)),
            PanelSpec(
                "fraction of samples",
                (("accuracy", "accuracy (the reward's verdict)"), ("strict_accuracy", "strict")),
            ),
        ),
    ),
    FigureSpec(
        "eval.png",
        "Held-out evaluations (greedy; before training at step 0)",
        (
            PanelSpec(
                "accuracy, %",
                (("eval_accuracy", "accuracy"), ("eval_strict_accuracy", "strict accuracy")),
                points=True,
                missing="no held-out evaluation: none in metrics.jsonl (eval.eval_steps) and "
                "no summary.json (written when a run finishes)",
            ),
        ),
    ),
    FigureSpec("kl.png", "KL to the reference (k3)", (PanelSpec("nats / token", (("kl", "KL"),)),)),
    FigureSpec(
        "clip_frac.png",
        "Clipped fraction of completion tokens",
        (
            PanelSpec(
                "fraction of tokens",
                (
                    ("clip_frac", "clipped"),
                    ("clip_frac_low", "low (ratio < 1 - eps, A < 0)"),
                    ("clip_frac_high", "high (ratio > 1 + eps_high, A > 0)"),
                ),
            ),
        ),
    ),
    FigureSpec(
        "lengths.png",
        "Completion length",
        (
            PanelSpec(
                "tokens",
                (
                    ("completion_length/max", "max"),
                    ("completion_length/mean", "mean"),
                    ("completion_length/min", "min"),
                ),
            ),
        ),
    ),
    FigureSpec(
        "time.png",
        "Time per step, by phase",
        (
            PanelSpec(
                "seconds (log scale)",
                (
                    ("time/step", "whole step"),
                    ("time/rollout", "rollout"),
                    ("time/score", "rewards"),
                    ("time/logprobs", "old / ref log-probs"),
                    ("time/update", "update"),
                ),
                log=True,
            ),
        ),
    ),
    FigureSpec(
        "loss.png",
        "Gradient norm and loss",
        (
            PanelSpec(
                "grad norm (before clipping)", (("grad_norm", "grad norm (before clipping)"),)
            ),
            PanelSpec("loss", (("loss", "loss"),)),
        ),
    ),
)


@dataclass
class Line:
    label: str
    steps: list[int]
    values: list[float]

    @property
    def constant(self) -> bool:
        return len(set(self.values)) == 1

    @property
    def size(self) -> float:
        return max(abs(v) for v in self.values)


@dataclass
class Panel:
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # constant series, and what was not logged
    log: bool = False
    points: bool = False
    absent: bool = False  # none of its metrics was logged (an older run, another trainer)


@dataclass
class Figure:
    name: str
    title: str
    panels: list[Panel]
    svg: str = ""  # filled by draw()


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a metric: the rows that hold a finite number for it."""
    steps, values = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(r["step"])
            values.append(float(v))
    return steps, values


def constant_reasons(config: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, str]:
    """Why a metric may not move, for the note beside it (read from the run's config and its
    other metrics, never assumed)."""
    # objective.beta (trainer.beta in a run written before the config's sections)
    sections = [config.get(name) for name in ("objective", "trainer")]
    beta = next((s["beta"] for s in sections if isinstance(s, dict) and "beta" in s), None)
    reasons = {}
    if beta == 0:
        reasons["kl"] = "KL off: beta = 0"
    _, ratios = series(rows, "ratio_mean")
    if ratios and set(ratios) == {1.0}:
        why = "the ratio was 1 at every step: one optimizer step per batch, so the policy "
        why += "cannot move before its loss is taken"
        reasons |= {k: why for k in ("clip_frac", "clip_frac_low", "clip_frac_high")}
    return reasons


def plan_panels(
    spec: PanelSpec, rows: list[dict[str, Any]], reasons: dict[str, str]
) -> list[Panel]:
    """One panel spec -> the panels drawn: equal series merged, constant ones turned into
    notes (or dashed lines beside changing ones), small ones moved to panels of their own."""
    lines, keys, notes = gather_lines(spec, rows)
    if not lines:
        note = spec.missing or _not_logged(spec)
        return [Panel(spec.ylabel, notes=[note], absent=not spec.missing)]
    if spec.points:  # a few evaluations: every point is shown as it is
        return [Panel(spec.ylabel, lines, notes, points=True)]
    moving = [ln for ln in lines if not ln.constant]
    log = spec.log and all(v > 0 for ln in lines for v in ln.values)
    main, extra = Panel(spec.ylabel, notes=notes, log=log), []
    for ln, drawn in zip(lines, keys, strict=True):
        if ln.constant and not moving:
            main.notes.append(_constant_note(ln, drawn, reasons))
        elif ln.constant:  # a reference line beside the changing ones, on their scale
            ln.label += f" (constant {ln.values[0]:.4g})"
            main.lines.append(ln)
        elif not log and ln.size < SMALL * max(m.size for m in moving):
            extra.append(Panel(spec.ylabel, [ln]))
        else:
            main.lines.append(ln)
    return [main, *extra]


def gather_lines(
    spec: PanelSpec, rows: list[dict[str, Any]]
) -> tuple[list[Line], list[list[str]], list[str]]:
    """The spec's logged series as lines, and the metrics each draws: series equal at every
    step are one line ("a = b"), and so are series everywhere closer than NEAR of the panel's
    span, which drawn apart would hide each other ("a ≈ b", with a note of where and by how
    much they differ)."""
    found = [(key, label, *series(rows, key)) for key, label in spec.series]
    found = [f for f in found if f[2]]
    every = [v for f in found for v in f[3]]
    span = max(every) - min(every) if every else 0.0
    lines: list[Line] = []
    keys: list[list[str]] = []
    firsts: list[str] = []  # each line's first label
    notes: list[str] = []
    for key, label, steps, values in found:
        twin = [i for i, ln in enumerate(lines) if ln.steps == steps]
        twin = [i for i in twin if _gap(lines[i].values, values) <= NEAR * span]
        if not twin:
            lines.append(Line(label, steps, values))
            keys.append([key])
            firsts.append(label)
            continue
        line, gap = lines[twin[0]], _gap(lines[twin[0]].values, values)
        keys[twin[0]].append(key)
        line.label += f" {'=' if gap == 0 else '≈'} {label}"
        if gap > 0:
            differ = sum(a != b for a, b in zip(line.values, values, strict=True))
            notes.append(
                f"{label} differs from {firsts[twin[0]]} at {differ} of {len(steps)} steps, "
                f"by at most {gap:.2g}: drawn as one line"
            )
    for ln in lines:
        if " = " in ln.label and " ≈ " not in ln.label and not ln.constant:
            ln.label += " (equal at every step)"
    return lines, keys, notes


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _constant_note(line: Line, keys: list[str], reasons: dict[str, str]) -> str:
    n = len(line.steps)
    where = "at every step" if n > 1 else "at the one logged step"
    note = f"{line.label}: {line.values[0]:.4g} {where}" + (f" ({n} steps)" if n > 1 else "")
    why = next((reasons[k] for k in keys if k in reasons), "")
    return note + (f"; {why}" if why else "")


def _not_logged(spec: PanelSpec) -> str:
    names = ", ".join(key for key, _ in spec.series)
    return f"not in metrics.jsonl: {names}"


def plan_figures(rows: list[dict[str, Any]], reasons: dict[str, str]) -> list[Figure]:
    """Every figure of FIGURES, planned; one whose metrics none was logged is left out."""
    figures = []
    for spec in FIGURES:
        panels = [p for ps in spec.panels for p in plan_panels(ps, rows, reasons)]
        if not all(p.absent for p in panels):
            figures.append(Figure(spec.name, spec.title, panels))
    return figures


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the raw curves of RL are noisy)."""
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def draw(figures: list[Figure], run_dir: Path) -> None:
    """Each figure to RUN_DIR/<name> (PNG) and to figure.svg (inline SVG for report.html)."""
    import matplotlib

    matplotlib.use("Agg")
    for figure in figures:
        mfig = _matplotlib_figure(figure)
        mfig.savefig(run_dir / figure.name, dpi=120)
        # Text stays text (smaller, selectable); ids salted by the figure's name are unique
        # within the page and the same on every run.
        with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": figure.name}):
            out = io.StringIO()
            mfig.savefig(out, format="svg")
        figure.svg = inline_svg(out.getvalue(), figure.name.removesuffix(".png"))


def inline_svg(svg: str, prefix: str) -> str:
    """matplotlib's SVG document as an element of an HTML page: no XML declaration, DOCTYPE or
    metadata, no namespace declarations (the HTML parser puts <svg> in its namespace), so the
    page names no address outside itself; and every id (and reference to one) prefixed, so the
    figures' "figure_1", "axes_1" and clip paths stay apart on one page."""
    svg = svg[svg.index("<svg") :]
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg)
    svg = re.sub(r'\bid="([^"]+)"', rf'id="{prefix}-\1"', svg)
    return re.sub(r'(url\(#|href="#)([^)"]+)', rf"\1{prefix}-\2", svg)


def _matplotlib_figure(figure: Figure):
    from matplotlib.figure import Figure as MplFigure

    heights = [(2.2 if p.lines else 0.25) + 0.2 * _note_lines(p) for p in figure.panels]
    mfig = MplFigure(figsize=(6.4, sum(heights) + 0.45), layout="constrained")
    axes = mfig.subplots(len(heights), 1, squeeze=False, height_ratios=heights)[:, 0]
    mfig.suptitle(figure.title, fontsize=11)
    drawn = [p for p in figure.panels if p.lines]
    steps = [s for p in drawn for ln in p.lines for s in ln.steps]
    curves = [ln for p in drawn if not p.points for ln in p.lines if not ln.constant]
    window = max([1] + [len(ln.steps) // POINTS_PER_CURVE for ln in curves])
    xlabel = "step" + (f" (faint: each step; solid: the mean of the last {window})" * (window > 1))
    for ax, panel in zip(axes, figure.panels, strict=True):
        if not panel.lines:
            ax.axis("off")
            text = "\n".join(textwrap.fill(n, NOTE_CHARS) for n in panel.notes)
            ax.text(0, 0.5, text, va="center", ha="left", fontsize=9, transform=ax.transAxes)
            continue
        _draw_lines(ax, panel, window)
        pad = max(0.5, 0.02 * (max(steps) - min(steps)))  # the end points' markers stay whole
        ax.set_xlim(min(steps) - pad, max(steps) + pad)
        below = [xlabel] if panel is drawn[-1] else []  # the notes go under the x axis
        below += [textwrap.fill(n, NOTE_CHARS) for n in panel.notes]
        ax.set_xlabel("\n".join(below), fontsize=9)
    return mfig


def _note_lines(panel: Panel) -> int:
    return sum(len(textwrap.wrap(n, NOTE_CHARS)) for n in panel.notes)


def _draw_lines(ax, panel: Panel, window: int) -> None:
    for i, ln in enumerate(panel.lines):
        style = {"color": COLOURS[i % len(COLOURS)], "linestyle": DASHES[i % len(DASHES)]}
        if panel.points:
            ax.plot(ln.steps, ln.values, marker="osD^v"[i % 5], label=ln.label, **style)
        elif ln.constant:
            ax.plot(ln.steps, ln.values, label=ln.label, lw=1, **style | {"linestyle": "--"})
        elif window > 1:
            ax.plot(ln.steps, ln.values, color=style["color"], alpha=0.25, lw=0.8)
            ax.plot(ln.steps, smooth(ln.values, window), label=ln.label, lw=1.6, **style)
        else:
            ax.plot(ln.steps, ln.values, label=ln.label, lw=1.4, **style)
    if panel.log:
        ax.set_yscale("log")
    ax.set_ylabel(panel.ylabel, fontsize=9)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=8)
    if len(panel.lines) > 1:  # one line needs no legend: the axis is named for it
        # Above the axes on the right: it hides no data and leaves the left corner to the
        # axis' multiplier ("1e-8"); as many columns as fit the figure's width.
        widest = max(len(ln.label) for ln in panel.lines)
        ncol = max(1, min(len(panel.lines), 3, int(5.6 / (0.055 * widest + 0.5))))
        legend = {"loc": "lower right", "bbox_to_anchor": (1, 1), "ncol": ncol, "frameon": False}
        ax.legend(fontsize=8, **legend)
    elif panel.lines[0].label != panel.ylabel:
        ax.set_title(panel.lines[0].label, fontsize=9, loc="right")
