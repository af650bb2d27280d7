"""report.html: one self-contained page (inline SVG curves and CSS, no script, no address
outside the file) with what a run's reader looks at: the result, the curves, sample
completions beside the strict verdict, the objective card and the preflight table; or, for
runs compared, their results side by side, the config keys they differ in and the curves
overlaid."""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from typing import Any

from grpolab.commands.report_plots import Figure

CELL_CHARS = 1200  # a longer prompt or completion is cut in the middle

CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
  color: #1d2430; background: #f4f6f9; margin: 0; }
main { max-width: 1180px; margin: 0 auto; padding: 20px 24px 48px; }
h1 { font-size: 24px; margin: 8px 0 2px; } h2 { font-size: 19px; margin: 28px 0 10px; }
h3 { font-size: 16px; margin: 18px 0 6px; }
.path { color: #5b6575; font-size: 13px; margin-bottom: 14px; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; }
.card { background: #fff; border: 1px solid #d9dee7; border-radius: 8px; padding: 10px 14px;
  min-width: 150px; }
.card .v { font-size: 21px; font-weight: 650; } .card .k { color: #5b6575; font-size: 12px; }
.warn { background: #fff6db; border: 1px solid #e8c766; border-radius: 8px; padding: 8px 14px;
  margin: 12px 0; } .warn li { margin: 2px 0; }
.figs { display: grid; gap: 14px; align-items: start;
  grid-template-columns: repeat(auto-fit, minmax(min(520px, 100%), 1fr)); }
figure { background: #fff; border: 1px solid #d9dee7; border-radius: 8px; margin: 0;
  padding: 8px; } figure svg { width: 100%; height: auto; display: block; }
table { border-collapse: collapse; background: #fff; width: 100%; font-size: 13.5px; }
table.narrow { width: auto; min-width: 50%; }
th, td { border: 1px solid #d9dee7; padding: 4px 8px; text-align: left; vertical-align: top;
  overflow-wrap: anywhere; }
th { background: #e9edf3; } th.n { width: 1%; white-space: nowrap; }
tr:nth-child(even) td { background: #f8f9fb; }
td.text { font-family: ui-monospace, "DejaVu Sans Mono", monospace; white-space: pre-wrap;
  word-break: break-word; font-size: 12.5px; } td.num { text-align: right; }
.yes { color: #0a7a3d; font-weight: 650; } .no { color: #c0262d; font-weight: 650; }
pre { background: #fff; border: 1px solid #d9dee7; border-radius: 8px; padding: 12px;
  overflow-x: auto; font-size: 13px; }
.muted { color: #5b6575; }
.runs { display: grid; gap: 14px;
  grid-template-columns: repeat(auto-fit, minmax(min(340px, 100%), 1fr)); }
.run { background: #fff; border: 1px solid #d9dee7; border-top: 6px solid; border-radius: 8px;
  padding: 10px 14px 14px; }
.run h3 { margin: 2px 0 10px; font-size: 15px; overflow-wrap: anywhere; }
.run .card { background: #f8f9fb; min-width: 120px; padding: 8px 12px; }
.run .card .v { font-size: 18px; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 3px;
  margin-right: 6px; vertical-align: -1px; }
"""


@dataclass
class Page:
    name: str  # the run directory's name
    path: str
    facts: list[tuple[str, str]] = field(default_factory=list)  # (what, value) cards
    warnings: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    metrics: list[tuple[str, str, str]] = field(default_factory=list)  # (key, first, last 20)
    samples: list[tuple[int, str, list[dict[str, Any]]]] = field(default_factory=list)
    objective: str | None = None  # objective.txt
    preflight: dict[str, Any] | None = None  # preflight.json


def html_page(page: Page) -> str:
    body = [
        f"<h1>Run report: {escape(page.name)}</h1>",
        f'<div class="path">{escape(page.path)}</div>',
        _cards(page.facts),
        *_warnings(page.warnings),
        "<h2>Curves</h2>",
        _figures(page.figures),
    ]
    body += _samples(page.samples)
    body += ["<h2>Objective</h2>", _objective(page.objective)]
    body += ["<h2>Preflight</h2>", *_preflight(page.preflight)]
    body += ["<h2>Metrics</h2>", _metrics(page.metrics)]
    return _document(f"grpolab report: {page.name}", body)


@dataclass
class RunCard:
    label: str  # its directory and its values of the keys the runs differ in
    colour: str  # its curves' colour
    facts: list[tuple[str, str]] = field(default_factory=list)  # (what, value) cards


@dataclass
class ComparePage:
    names: list[str]  # the runs' directories, in colour order
    path: str  # where the comparison is written
    runs: list[RunCard] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    differences: list[tuple[str, list[str | None]]] = field(default_factory=list)  # key, values
    figures: list[Figure] = field(default_factory=list)
    metrics: list[tuple[str, list[str]]] = field(default_factory=list)  # key, last-20 means


def compare_page(page: ComparePage) -> str:
    """Runs side by side: each one's result in its colour, the config keys they differ in, the
    curves overlaid and the metrics' last-20-step means."""
    cards = "".join(
        f'<section class="run" style="border-top-color: {run.colour}">'
        f"<h3>{_swatch(run.colour)}{escape(run.label)}</h3>{_cards(run.facts)}</section>"
        for run in page.runs
    )
    body = [
        f"<h1>Run comparison: {escape(', '.join(page.names))}</h1>",
        f'<div class="path">{escape(page.path)}</div>',
        f'<div class="runs">{cards}</div>',
        *_warnings(page.warnings),
        "<h2>Config differences</h2>",
        _differences(page),
        "<h2>Curves</h2>",
        '<p class="muted">One colour per run, as above and in the legend under each figure; '
        "within a panel, one dash per series.</p>",
        _figures(page.figures),
        "<h2>Metrics: the mean of the last 20 steps</h2>",
        _table(["metric", *page.names], page.metrics, page.runs),
        '<p class="muted">Each run\'s own report (<code>grpolab report RUN_DIR</code>) has its '
        "sample completions, objective card and preflight table.</p>",
    ]
    return _document(f"grpolab report: {', '.join(page.names)}", body)


def _document(title: str, body: list[str]) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head>"
        f"<body><main>{''.join(body)}</main></body></html>\n"
    )


def _warnings(warnings: list[str]) -> list[str]:
    if not warnings:
        return []
    items = "".join(f"<li>{escape(w)}</li>" for w in warnings)
    return [f'<div class="warn"><ul>{items}</ul></div>']


def _figures(figures: list[Figure]) -> str:
    drawn = "".join(
        f'<figure id="{escape(f.name.removesuffix(".png"))}">{f.svg}</figure>' for f in figures
    )
    return f'<div class="figs">{drawn}</div>'


def _swatch(colour: str) -> str:
    return f'<span class="swatch" style="background: {colour}"></span>'


def _differences(page: ComparePage) -> str:
    if not page.differences:
        return '<p class="muted">The runs\' config.yaml files differ in no key but output_dir.</p>'
    rows = [(key, [v or "n/a" for v in values]) for key, values in page.differences]
    return _table(["key", *page.names], rows, page.runs)


def _table(head: list[str], rows: list[tuple[str, list[str]]], runs: list[RunCard]) -> str:
    """A table with a column per run, headed by the run's colour and directory."""
    cells = [f"<th>{escape(head[0])}</th>"]
    cells += [
        f"<th>{_swatch(run.colour)}{escape(name)}</th>"
        for run, name in zip(runs, head[1:], strict=True)
    ]
    body = "".join(
        f"<tr><td><code>{escape(key)}</code></td>"
        + "".join(f'<td class="num">{escape(v)}</td>' for v in values)
        + "</tr>"
        for key, values in rows
    )
    return f'<table class="narrow"><tr>{"".join(cells)}</tr>{body}</table>'


def _cards(facts: list[tuple[str, str]]) -> str:
    cards = "".join(
        f'<div class="card"><div class="v">{escape(v)}</div><div class="k">{escape(k)}</div></div>'
        for k, v in facts
    )
    return f'<div class="cards">{cards}</div>'


def _samples(samples: list[tuple[int, str, list[dict[str, Any]]]]) -> list[str]:
    out = ["<h2>Sample completions</h2>"]
    if not samples:
        return [*out, '<p class="muted">No completions were logged (completions.jsonl).</p>']
    out.append(
        "<p>The training reward beside the strict check (the final answer, as written, is "
        "exactly the reference). A reward that pays where the strict check says no is being "
        "gamed.</p>"
    )
    for step, when, records in samples:
        out.append(f"<h3>Step {step} ({escape(when)})</h3>")
        rows = [
            "<tr>"
            f'<td class="text">{_text(r.get("prompt", ""))}</td>'
            f'<td class="text">{_text(r.get("completion", ""))}</td>'
            f'<td class="text">{_text(r.get("answer", ""))}</td>'
            f'<td class="num">{_number(r.get("reward"))}</td>'
            + ('<td class="yes">yes</td>' if r["strict"] else '<td class="no">no</td>')
            + "</tr>"
            for r in records
        ]
        head = '<tr><th>prompt</th><th>completion</th><th>answer</th><th class="n">reward</th>'
        out.append(f'<table>{head}<th class="n">strict</th></tr>{"".join(rows)}</table>')
    return out


def _objective(card: str | None) -> str:
    if card is None:
        return '<p class="muted">No objective.txt in the run directory.</p>'
    return f"<pre>{escape(card)}</pre>"


def _preflight(record: dict[str, Any] | None) -> list[str]:
    if record is None:
        return ['<p class="muted">No readable preflight.json in the run directory.</p>']
    if record.get("skipped"):
        return [f'<p class="no">{escape(str(record.get("warning", "preflight skipped")))}</p>']
    checks = [c for c in record.get("checks", []) if isinstance(c, dict)]
    failed = sum(not c.get("passed") for c in checks)
    verdict = (
        f"{failed} of {len(checks)} checks failed" if failed else f"all {len(checks)} checks pass"
    )
    impl = f" (checked functions from {record['impl']})" if record.get("impl") else ""
    out = [f'<p class="{"no" if failed else "yes"}">{verdict}{escape(impl)}</p>']
    head = '<tr><th class="n">check</th><th class="n">goal</th><th>what is measured</th>'
    rows = [head + '<th class="n">measured</th><th>expected</th><th class="n">result</th></tr>']
    for c in checks:
        what = escape(str(c.get("error") or c.get("what", "")))
        if not c.get("passed") and c.get("hint"):
            what += f'<br><span class="no">likely bug: {escape(str(c["hint"]))}</span>'
        rows.append(
            f"<tr><td><code>{escape(str(c.get('id', '')))}</code></td>"
            f'<td class="num">{escape(str(c.get("goal") or ""))}</td><td>{what}</td>'
            f'<td class="num">{_number(c.get("measured"))}</td>'
            f"<td>{escape(str(c.get('expected', '')))}</td>"
            + ('<td class="yes">pass</td>' if c.get("passed") else '<td class="no">FAIL</td>')
            + "</tr>"
        )
    return [*out, f"<table>{''.join(rows)}</table>"]


def _metrics(metrics: list[tuple[str, str, str]]) -> str:
    rows = "".join(
        f'<tr><td><code>{escape(k)}</code></td><td class="num">{escape(a)}</td>'
        f'<td class="num">{escape(b)}</td></tr>'
        for k, a, b in metrics
    )
    head = "<tr><th>metric</th><th>first step</th><th>mean of the last 20 steps</th></tr>"
    return f'<table class="narrow">{head}{rows}</table>'


def _number(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return escape("n/a" if v is None else str(v))
    return f"{v:.4g}"


def _text(text: Any) -> str:
    text = str(text)
    if len(text) > CELL_CHARS:
        half = CELL_CHARS // 2
        text = f"{text[:half]} … {text[-half:]}"
    return escape(text) if text.strip() else '<span class="muted">(empty)</span>'
