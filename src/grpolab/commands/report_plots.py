"""The report's curves: which metrics share an axis, and drawing them (PNG files for report.md,
inline SVG for report.html), for one run or for several overlaid (one colour per run, one dash
per metric). Three rules keep every curve readable:

- a series is drawn only on an axis scaled for it: the figures put only series of one unit
  together, and a series whose largest value is under a tenth of its panel's largest gets a
  panel of its own (a 1e-9 loss on a grad norm's axis is a flat line); the runs of one metric
  stay together, since comparing them is the point;
- series equal at every step (in every run) are one line named for all of them (drawn twice
  they hide each other);
- a series that never changes is a note, "KL: 0 at every step (KL off: beta = 0)", not a
  flat line on an axis matplotlib centres on it; beside changing series of its panel it stays
  as a dashed reference line. Evaluations too: a held-out accuracy flat at 0 is a note.
"""

from __future__ import annotations

import io
import math
import re
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SMALL = 0.1  # a series under this share of its panel's largest value gets a panel of its own
# Series closer than this share of their panel's span (a line's width at the report's size)
# are drawn as one line, with a note of their differences: drawn apart they hide each other.
NEAR = 0.02
NOTE_CHARS = 90  # a note is wrapped to lines of this many characters
LEGEND_CHARS = 84  # a comparison's run legend: labels wrapped to lines of this many characters
POINTS_PER_CURVE = 30  # a longer curve is also drawn as a moving average of len // 30 steps
# Okabe-Ito colours and distinct dashes: lines that cross stay apart in colour and in print.
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
COLOUR_NAMES = ("blue", "vermilion", "green", "pink", "orange", "sky blue", "black")
DASHES = ("-", "--", "-.", ":")
INK = "#3b4350"  # a comparison's metric legend: the dash names the metric, the colour the run


@dataclass(frozen=True)
class PanelSpec:
    ylabel: str
    series: tuple[tuple[str, str], ...]  # (metric, label)
    # A metric pattern such as "rewards/{}/mean": one more series for each name logged in its
    # place (each reward function), labelled by that name.
    each: str = ""
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
            PanelSpec("reward mean", (("reward/mean", "total"),), each="rewards/{}/mean"),
            PanelSpec(
                "fraction of samples",
                (("accuracy", "accuracy (the reward's verdict)"), ("strict_accuracy", "strict")),
            ),
        ),
    ),
    FigureSpec(
        "spread.png",
        "What a step learns from: the spread of the rewards",
        (
            PanelSpec("reward std (batch)", (("reward/std", "total"),), each="rewards/{}/std"),
            PanelSpec(
                "fraction of groups",
                (("frac_reward_zero_std", "flat groups (all G rewards equal: no gradient)"),),
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
    FigureSpec(
        "entropy.png",
        "Entropy of the policy (at the sampling temperature)",
        (PanelSpec("nats / token", (("entropy", "mean over the update's completion tokens"),)),),
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
                    ("time/step", "whole step (the sum)"),
                    ("time/rollout", "generation"),
                    ("time/score", "rewards and advantages"),
                    ("time/logprobs", "old / ref log-probs (before the update)"),
                    ("time/update", "update (forward, backward, optimizer)"),
                ),
                log=True,
            ),
        ),
    ),
    FigureSpec(
        "loss.png",
        "Learning rate, gradient norm and loss",
        (
            PanelSpec("learning rate", (("lr", "learning rate"),)),
            PanelSpec(
                "grad norm (before clipping)", (("grad_norm", "grad norm (before clipping)"),)
            ),
            PanelSpec("loss", (("loss", "loss"),)),
        ),
    ),
)


Logged = dict[int, tuple[list[int], list[float]]]  # run -> (steps, values)


@dataclass
class Line:
    label: str
    steps: list[int]
    values: list[float]
    run: int = 0  # which run of a comparison it belongs to: its colour there

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
    runs: list[str] = field(default_factory=list)  # a comparison's legend, one per run's colour
    svg: str = ""  # filled by draw()


@dataclass(frozen=True)
class Curves:
    """One run's metrics as the figures read them."""

    rows: list[dict[str, Any]]  # one per step (and the held-out evaluations)
    reasons: dict[str, str] = field(default_factory=dict)  # why a metric may not move
    name: str = ""  # how a comparison's notes name the run ("" in a run's own report)


@dataclass
class Group:
    """One series of a panel, or several drawn as one line, in every run that logged it."""

    label: str
    first: str  # the label of its first series
    keys: list[str]  # the metrics it draws
    logged: Logged  # its first series'

    def lines(self) -> list[Line]:
        return [
            Line(self.label, steps, values, run) for run, (steps, values) in self.logged.items()
        ]


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
    # objective.beta, schedule.lr_scheduler (trainer.<key> in a run written before the
    # config's sections)
    beta = _config_value(config, ("objective", "trainer"), "beta")
    reasons = {}
    if beta == 0:
        reasons["kl"] = "KL off: beta = 0"
    scheduler = _config_value(config, ("schedule", "trainer"), "lr_scheduler")
    if scheduler == "constant" and not _config_value(
        config, ("schedule", "trainer"), "warmup_steps"
    ):
        reasons["lr"] = "schedule.lr_scheduler = constant, without warm-up"
    _, ratios = series(rows, "ratio_mean")
    if ratios and set(ratios) == {1.0}:
        why = "the ratio was 1 at every step: one optimizer step per batch, so the policy "
        why += "cannot move before its loss is taken"
        reasons |= {k: why for k in ("clip_frac", "clip_frac_low", "clip_frac_high")}
    return reasons


def _config_value(config: dict[str, Any], sections: tuple[str, ...], key: str) -> Any:
    found = [config.get(name) for name in sections]
    return next((s[key] for s in found if isinstance(s, dict) and key in s), None)


def expand(spec: PanelSpec, keys: list[str]) -> PanelSpec:
    """The spec with a series for each name its `each` pattern finds among the logged keys."""
    if not spec.each:
        return spec
    head, tail = spec.each.split("{}")
    names = [
        k[len(head) : len(k) - len(tail)]
        for k in keys
        if k.startswith(head) and k.endswith(tail) and len(k) > len(head) + len(tail)
    ]
    return replace(spec, series=spec.series + tuple((f"{head}{n}{tail}", n) for n in names))


def plan_panels(spec: PanelSpec, runs: list[Curves]) -> list[Panel]:
    """One panel spec -> the panels drawn: equal series merged, constant ones turned into
    notes (or dashed lines beside changing ones), small ones moved to panels of their own."""
    groups, notes = gather_lines(spec, runs)
    if not groups:
        note = spec.missing or _not_logged(spec)
        return [Panel(spec.ylabel, notes=[note], absent=not spec.missing)]
    lines = [g.lines() for g in groups]
    moving = [i for i, drawn in enumerate(lines) if not all(ln.constant for ln in drawn)]
    if not moving:  # no axis to draw: what each series held, and why where the run says
        notes += constant_notes(groups, lines, runs, spec.points)
        return [Panel(spec.ylabel, notes=notes, points=spec.points)]
    if spec.points:  # a few evaluations: every point is shown as it is
        return [Panel(spec.ylabel, [ln for drawn in lines for ln in drawn], notes, points=True)]
    log = spec.log and all(v > 0 for drawn in lines for ln in drawn for v in ln.values)
    largest = max(ln.size for i in moving for ln in lines[i])
    main, extra = Panel(spec.ylabel, notes=notes, log=log), []
    for i, drawn in enumerate(lines):
        if i in moving and not log and max(ln.size for ln in drawn) < SMALL * largest:
            extra.append(Panel(spec.ylabel, drawn))
            continue
        for ln in drawn:
            if ln.constant and len(runs) == 1:  # a reference line on the changing ones' scale
                ln.label += f" (constant {ln.values[0]:.4g})"
        main.lines += drawn
    return [main, *extra]


def gather_lines(spec: PanelSpec, runs: list[Curves]) -> tuple[list[Group], list[str]]:
    """The spec's logged series as groups of lines, and notes: series equal at every step of
    every run are one line ("a = b"), and so are series everywhere closer than NEAR of the
    panel's span (on a log axis, of its decades), which drawn apart would hide each other
    ("a ≈ b", with a note of where and by how much they differ)."""
    found = []
    for key, label in spec.series:
        logged = {r: series(run.rows, key) for r, run in enumerate(runs)}
        logged = {r: drawn for r, drawn in logged.items() if drawn[0]}
        if logged:
            found.append((key, label, logged))
    every = [v for *_, logged in found for _, values in logged.values() for v in values]
    log = spec.log and bool(every) and min(every) > 0
    at = math.log10 if log else float  # a value's place on the panel's axis
    span = at(max(every)) - at(min(every)) if every else 0.0
    groups: list[Group] = []
    notes: list[str] = []
    for key, label, logged in found:
        near = [(g, _gap(g.logged, logged, at)) for g in groups if _same_steps(g.logged, logged)]
        twin = next(((g, gap) for g, gap in near if gap <= NEAR * span), None)
        if twin is None:
            notes += _drawn_over(label, logged, groups, runs)
            groups.append(Group(label, label, [key], logged))
            continue
        group, gap = twin
        group.keys.append(key)
        group.label += f" {'=' if gap == 0 else '≈'} {label}"
        if gap > 0:
            notes.append(_near_note(label, group, logged, gap, log))
    for g in groups:
        moves = any(len(set(values)) > 1 for _, values in g.logged.values())
        if " = " in g.label and " ≈ " not in g.label and moves:
            g.label += " (equal at every step)"
    return groups, notes


def _same_steps(a: Logged, b: Logged) -> bool:
    return a.keys() == b.keys() and all(a[r][0] == b[r][0] for r in a)


def _gap(a: Logged, b: Logged, at) -> float:
    return max(abs(at(x) - at(y)) for r in a for x, y in zip(a[r][1], b[r][1], strict=True))


def _drawn_over(label: str, logged: Logged, groups: list[Group], runs: list[Curves]) -> list[str]:
    """Series of a comparison equal at every step in some runs but not in all: drawn apart,
    one line hides the other there, which a note says."""
    return [
        f"{runs[r].name}: {label} = {g.first} at every step (one line hides the other)"
        for r, drawn in logged.items()
        for g in groups
        if g.logged.get(r) == drawn
    ]


def _near_note(label: str, group: Group, logged: Logged, gap: float, log: bool) -> str:
    pairs = [(x, y) for r in logged for x, y in zip(group.logged[r][1], logged[r][1], strict=True)]
    differ = sum(x != y for x, y in pairs)
    over = " of the runs together" if len(logged) > 1 else ""
    by = f"a factor of {10**gap:.3g}" if log else f"{gap:.2g}"
    return (
        f"{label} and {group.first} are drawn as one line: they differ at {differ} of "
        f"{len(pairs)} steps{over}, by at most {by}, under a line's width on this axis"
    )


def constant_notes(
    groups: list[Group], lines: list[list[Line]], runs: list[Curves], points: bool
) -> list[str]:
    """A note for each run's flat series; one for every run where they all say the same."""
    said: dict[str, list[str]] = {}  # note -> the runs it is said of
    for group, drawn in zip(groups, lines, strict=True):
        for ln in drawn:
            note = _constant_note(ln, group.keys, runs[ln.run].reasons, points)
            said.setdefault(note, []).append(runs[ln.run].name)
    if len(runs) == 1:
        return list(said)
    return [
        f"{'every run' if len(names) == len(runs) else ', '.join(names)}: {note}"
        for note, names in said.items()
    ]


def _constant_note(line: Line, keys: list[str], reasons: dict[str, str], points: bool) -> str:
    n, steps = len(line.steps), ", ".join(str(s) for s in line.steps)
    if points:
        where = f"at every evaluation (steps {steps})" if n > 1 else f"at step {steps}"
        where = where if n <= 6 else f"at every evaluation ({n} evaluations)"
    else:
        where = f"at every step ({n} steps)" if n > 1 else "at the one logged step"
    note = f"{line.label}: {line.values[0]:.4g} {where}"
    why = next((reasons[k] for k in keys if k in reasons), "")
    return note + (f"; {why}" if why else "")


def _not_logged(spec: PanelSpec) -> str:
    names = ", ".join(key for key, _ in spec.series)
    return f"not in metrics.jsonl: {names}"


def plan_figures(runs: list[Curves], legend: list[str] | None = None) -> list[Figure]:
    """Every figure of FIGURES, planned for one run or for several overlaid (legend: one label
    per run, in colour order); a figure none of whose metrics was logged is left out."""
    keys = list(dict.fromkeys(k for run in runs for row in run.rows for k in row))
    figures = []
    for spec in FIGURES:
        panels = [p for ps in spec.panels for p in plan_panels(expand(ps, keys), runs)]
        if not all(p.absent for p in panels):
            figures.append(Figure(spec.name, spec.title, panels, runs=list(legend or [])))
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
    from matplotlib.ticker import MaxNLocator

    heights = [(2.2 if p.lines else 0.25) + 0.2 * _note_lines(p) for p in figure.panels]
    drawn = [p for p in figure.panels if p.lines]
    runs = figure.runs if drawn else []  # a figure of notes names its runs in them
    legend_rows = _legend_rows(runs)
    size = (6.4, sum(heights) + 0.45 + 0.22 * legend_rows)
    mfig = MplFigure(figsize=size, layout="constrained")
    axes = mfig.subplots(len(heights), 1, squeeze=False, height_ratios=heights)[:, 0]
    mfig.suptitle(figure.title, fontsize=11)
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
        _draw_lines(ax, panel, window, overlay=bool(figure.runs))
        pad = max(0.5, 0.02 * (max(steps) - min(steps)))  # the end points' markers stay whole
        ax.set_xlim(min(steps) - pad, max(steps) + pad)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        below = [xlabel] if panel is drawn[-1] else []  # the notes go under the x axis
        below += [textwrap.fill(n, NOTE_CHARS) for n in panel.notes]
        ax.set_xlabel("\n".join(below), fontsize=9)
    if runs:
        _run_legend(mfig, runs)
    return mfig


def _note_lines(panel: Panel) -> int:
    return sum(len(textwrap.wrap(n, NOTE_CHARS)) for n in panel.notes)


def _legend_rows(runs: list[str]) -> int:
    if not runs or _legend_columns(runs) == 2:
        return math.ceil(len(runs) / 2)
    return sum(len(textwrap.wrap(label, LEGEND_CHARS)) for label in runs)


def _legend_columns(labels: list[str]) -> int:
    return 2 if max(len(label) for label in labels) <= LEGEND_CHARS // 2 else 1


def _run_legend(mfig, runs: list[str]) -> None:
    """A comparison's runs, under the figure: each colour is one run in every panel."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=COLOURS[r % len(COLOURS)], lw=2.4) for r in range(len(runs))]
    ncol = _legend_columns(runs)
    labels = [textwrap.fill(label, LEGEND_CHARS, subsequent_indent="  ") for label in runs]
    mfig.legend(handles, labels, loc="outside lower center", ncol=ncol, frameon=False, fontsize=8.5)


def _draw_lines(ax, panel: Panel, window: int, overlay: bool) -> None:
    """A panel's lines: in a run's own report one colour and dash per series; in a comparison
    the colour is the run's and the dash the series'."""
    labels = list(dict.fromkeys(ln.label for ln in panel.lines))  # the panel's series, in order
    for ln in panel.lines:
        k = labels.index(ln.label)
        colour = COLOURS[(ln.run if overlay else k) % len(COLOURS)]
        style = {"color": colour, "linestyle": DASHES[k % len(DASHES)]}
        label = None if overlay else ln.label  # a comparison's legend names series, not runs
        if panel.points:
            ax.plot(ln.steps, ln.values, marker="osD^v"[k % 5], label=label, **style)
        elif ln.constant:  # a reference line
            dash = style["linestyle"] if overlay else "--"
            ax.plot(ln.steps, ln.values, label=label, lw=1, **style | {"linestyle": dash})
        elif window > 1:
            ax.plot(ln.steps, ln.values, color=colour, alpha=0.25, lw=0.8)
            ax.plot(ln.steps, smooth(ln.values, window), label=label, lw=1.6, **style)
        else:
            ax.plot(ln.steps, ln.values, label=label, lw=1.4, **style)
    if panel.log:
        ax.set_yscale("log")
    ax.set_ylabel(panel.ylabel, fontsize=9)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=8)
    _series_legend(ax, panel, labels, overlay)


def _series_legend(ax, panel: Panel, labels: list[str], overlay: bool) -> None:
    if len(labels) == 1:  # one series needs no legend: the axis, or the title, names it
        if labels[0] != panel.ylabel:
            ax.set_title(labels[0], fontsize=9, loc="right")
        return
    from matplotlib.lines import Line2D

    # Above the axes on the right: it hides no data and leaves the left corner to the
    # axis' multiplier ("1e-8"); as many columns as fit the figure's width.
    widest = max(len(label) for label in labels)
    ncol = max(1, min(len(labels), 3, int(5.6 / (0.055 * widest + 0.5))))
    legend = {"loc": "lower right", "bbox_to_anchor": (1, 1), "ncol": ncol, "frameon": False}
    if overlay:  # the series by their dash, in a neutral ink: the colours are the runs'
        marker = "osD^v" if panel.points else [None] * 5
        handles = [
            Line2D([], [], color=INK, linestyle=DASHES[k % len(DASHES)], marker=marker[k % 5])
            for k in range(len(labels))
        ]
        ax.legend(handles, labels, fontsize=8, **legend)
    else:
        ax.legend(fontsize=8, **legend)
