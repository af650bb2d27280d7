"""`grpolab report`: the curves, and beside them sample completions of early, middle and late
steps with the strict verdict (curves alone drew a gamed reward as a success)."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from grpolab.commands.cli import main
from grpolab.commands.report import (
    config_differences,
    override_text,
    plot_rows,
    read_run,
    sample_completions,
    write_comparison,
    write_report,
)
from grpolab.commands.report_plots import (
    COLOURS,
    Curves,
    PanelSpec,
    constant_reasons,
    plan_figures,
    plan_panels,
)


def write_run(run_dir, completions):
    run_dir.mkdir()
    rows = [
        {"step": s, "reward/mean": s / 30, "accuracy": s / 30, "strict_accuracy": 0.1}
        for s in range(1, 31)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "accuracy_before": 14.0,
        "accuracy_after": 100.0,
        "strict_accuracy_before": 11.0,
        "strict_accuracy_after": 0.0,
        "steps": 30,
        "eval_examples": 200,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "completions.jsonl").write_text("".join(json.dumps(c) + "\n" for c in completions))


def test_the_report_shows_what_the_reward_paid_for(tmp_path):
    # Completions as a chat model wrote them while learning to restate the question.
    logged = []
    for step, completion in ((1, "37 + 48 = 104"), (15, "88 + 22 = 110"), (30, "88 + 22 =")):
        for _ in range(5):
            logged.append(
                {
                    "step": step,
                    "prompt": "What is 88 + 22?",
                    "completion": completion,
                    "answer": "110",
                    "reward": 1.0 if step > 1 else 0.0,
                    "advantage": 0.0,
                }
            )
    write_run(tmp_path / "run", logged)
    report = write_report(tmp_path / "run").read_text()
    assert "Strict held-out accuracy (the final answer exactly the reference): 11.0% -> 0.0%" in (
        report
    )
    assert "| strict_accuracy | 0.1 | 0.1 |" in report
    early, middle, late = (report.index(f"### Step {s} ({w})") for s, w in
                           ((1, "early"), (15, "middle"), (30, "late")))  # fmt: skip
    assert early < middle < late
    rows = [line for line in report[late:].splitlines() if line.startswith("| `")]
    assert len(rows) == 4  # SAMPLES_PER_STEP of the five logged
    assert rows[0] == "| `What is 88 + 22?` | `88 + 22 =` | `110` | 1 | **no** |"
    assert "| `88 + 22 = 110` | `110` | 1 | yes |" in report[middle:late]


def test_cells_stay_on_one_line_and_a_run_without_completions_says_so():
    lines = sample_completions(
        [{"step": 3, "prompt": "a|b", "completion": "x\ny " + "z" * 300, "answer": "1"}]
    )
    (row,) = [line for line in lines if line.startswith("| `")]
    assert "a\\|b" in row and " ⏎ " in row and " … " in row and "n/a" in row
    assert "### Step 3 (early)" in lines
    assert sample_completions([])[-1].startswith("No completions were logged")


# --- report.html and the curves' axes ---------------------------------------------------------

DEMO = [  # the CPU demo, short: evaluations, logged completions and the preflight included
    "max_steps=12",
    "eval.eval_steps=5",
    "eval.eval_examples=100",
    "logging.log_completions_steps=4",
    "logging.progress=false",
]
SHORT = [  # three steps, two reward functions, a cosine schedule
    "max_steps=3",
    "eval.eval_examples=50",
    "rewards.functions=[accuracy,overlong]",
    "rewards.overlong_buffer=3",
    "schedule.lr_scheduler=cosine",
    "logging.log_completions_steps=1",
    "logging.progress=false",
]
CHROMIUM_FLAGS = (  # headless, offline: nothing may be fetched, so nothing is
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("report")


def trained(path: Path, overrides: list[str]) -> Path:
    assert main(["train", f"output_dir={path}", *overrides]) == 0
    return path


@pytest.fixture(scope="module")
def demo_run(runs_dir):
    return trained(runs_dir / "demo", DEMO)


@pytest.fixture(scope="module")
def lr_run(runs_dir):  # the demo at another learning rate: what a comparison is for
    return trained(runs_dir / "lr", [*DEMO, "optim.learning_rate=1e-4"])


@pytest.fixture(scope="module")
def short_run(runs_dir):
    return trained(runs_dir / "short", SHORT)


def figures_of(run_dir: Path) -> dict:
    run = read_run(run_dir)
    planned = plan_figures([Curves(plot_rows(run), constant_reasons(run.config, run.rows))])
    return {f.name: f for f in planned}


def chromium() -> str:
    exe = shutil.which("chromium")
    if exe is None:  # CI installs it (scripts/setup.sh): a missing browser is a failure
        pytest.fail("chromium is not installed (Debian: apt-get install -y chromium)")
    return exe


def screenshot(html: Path, tmp_path: Path, size: tuple[int, int] = (1200, 2000)) -> np.ndarray:
    """The page as headless Chromium draws it: [height, width, RGB] in 0..255."""
    png = tmp_path / "shot.png"
    command = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    command += [f"--screenshot={png}", f"--window-size={size[0]},{size[1]}", html.as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert png.is_file(), done.stderr[-2000:]
    return np.asarray(Image.open(png).convert("RGB"), dtype=np.int32)


# Appended to a copy of the page (the report itself has no script): after layout, the page's
# scroll width and every element whose box reaches past the window's right edge.
LAYOUT_PROBE = """<script>
const view = document.documentElement.clientWidth;
const out = [...document.querySelectorAll("main *")]
  .filter(e => e.getBoundingClientRect().right > view + 0.5)
  .map(e => e.tagName.toLowerCase() + (e.id ? "#" + e.id : ""));
document.body.dataset.layout = JSON.stringify({width: document.documentElement.scrollWidth,
  view: view, out: out.slice(0, 10)});
</script>"""


def layout(html: Path, tmp_path: Path, width: int) -> dict:
    """How Chromium lays the page out in a window `width` pixels wide."""
    probe = tmp_path / f"probe-{width}.html"
    probe.write_text(html.read_text().replace("</body>", LAYOUT_PROBE + "</body>"))
    command = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    command += [f"--window-size={width},1000", "--dump-dom", probe.as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    found = re.search(r'data-layout="([^"]*)"', done.stdout)
    assert found, done.stderr[-2000:]
    return json.loads(found.group(1).replace("&quot;", '"'))


def near(image: np.ndarray, colour: str, distance: int = 40) -> np.ndarray:
    """Pixels within `distance` (max over channels) of a #rrggbb colour."""
    rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
    return np.abs(image - rgb).max(axis=-1) <= distance


def x_ticks(html: str, figure: str) -> list[str]:
    """The x-axis tick labels of a figure's inline SVG, every panel's in order."""
    svg = re.search(rf'<figure id="{figure}">(.*?)</figure>', html, re.S).group(1)
    return re.findall(r'id="[^"]*-xtick_\d+">.*?<text[^>]*>\s*([^<]*?)\s*</text>', svg, re.S)


@pytest.mark.slow
def test_report_html_is_self_contained_and_chromium_draws_its_curves(demo_run, tmp_path):
    write_report(demo_run)
    html = (demo_run / "report.html").read_text()
    assert not re.findall(r"https?://", html)  # no address outside the file, not even xmlns
    assert not re.search(r"<(script|link|img|iframe)\b", html)
    ids = re.findall(r'\bid="([^"]+)"', html)
    assert len(ids) == len(set(ids)) > 50  # the inline SVGs' clip paths and glyphs stay apart
    assert html.count("<svg") == len(figures_of(demo_run))
    assert "GRPO objective" in html and "logprobs.fused_vs_naive" in html  # card, preflight
    assert "Step 1 (early)" in html and "Step 12 (late)" in html
    image = screenshot(demo_run / "report.html", tmp_path)
    assert image.shape == (2000, 1200, 3)
    # Not blank: a blank page is one colour; text alone already gives hundreds (antialiasing).
    background = near(image, "#ffffff", 8) | near(image, "#f4f6f9", 8)
    assert 1 - background.mean() > 0.04
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 500
    # The figures: their curves' colours, in both columns of figures and down the page (a page
    # without its figures has none of these pixels).
    blue, orange = near(image, COLOURS[0]), near(image, COLOURS[1])
    assert blue.sum() > 2000 and orange.sum() > 200
    rows, cols = np.nonzero(blue)
    assert (cols < 600).sum() > 500 and (cols > 600).sum() > 500
    assert np.ptp(rows) > 800
    for width in (1200, 640):  # two columns of figures, and one
        laid = layout(demo_run / "report.html", tmp_path, width)
        assert laid["width"] == laid["view"] == width and laid["out"] == [], laid


@pytest.mark.slow
def test_no_series_is_drawn_on_another_series_axis(demo_run):
    figures = figures_of(demo_run)
    lr, grad_norm, loss = figures["loss.png"].panels
    assert [ln.label for ln in loss.lines] == ["loss"] and len(grad_norm.lines) == 1
    # A constant learning rate is a sentence, with the schedule that keeps it so.
    assert not lr.lines and lr.notes == [
        "learning rate: 0.0003 at every step (12 steps); schedule.lr_scheduler = constant, "
        "without warm-up"
    ]
    # The demo's beta is 0 and each batch gets one optimizer step: notes, not flat lines.
    (kl,) = figures["kl.png"].panels
    assert not kl.lines and kl.notes == ["KL: 0 at every step (12 steps); KL off: beta = 0"]
    (clip,) = figures["clip_frac.png"].panels
    assert not clip.lines and "the ratio was 1 at every step" in clip.notes[0]
    (held_out,) = figures["eval.png"].panels  # before, at steps 5 and 10, after
    assert held_out.lines[0].steps == [0, 5, 10, 12]
    (time,) = figures["time.png"].panels
    assert time.log and len(time.lines) == 5  # 4e-6 s beside 4e-2 s: both visible
    # What a GRPO dashboard shows beside the reward: its spread, the flat groups, entropy.
    reward_std, flat = figures["spread.png"].panels
    assert reward_std.ylabel == "reward std (batch)" and len(reward_std.lines[0].steps) == 12
    assert flat.lines[0].label.startswith("flat groups") and not flat.lines[0].constant
    (entropy,) = figures["entropy.png"].panels
    assert entropy.ylabel == "nats / token" and min(entropy.lines[0].values) > 0


@pytest.mark.slow
def test_a_short_run_gets_whole_steps_a_curve_per_reward_and_its_schedule(short_run):
    figures = figures_of(short_run)
    # The total and each function, on the reward's axis (or, far smaller, on one of their own).
    rewards = [p for p in figures["reward.png"].panels if p.ylabel == "reward mean"]
    assert sorted(ln.label for p in rewards for ln in p.lines) == ["accuracy", "overlong", "total"]
    lr = figures["loss.png"].panels[0]  # cosine: drawn
    assert lr.ylabel == "learning rate" and lr.lines[0].values[-1] == 0 < lr.lines[0].values[0]
    write_report(short_run)
    html = (short_run / "report.html").read_text()
    for name in ("reward", "spread", "entropy", "lengths", "time", "loss"):
        ticks = x_ticks(html, name)
        assert ticks and set(ticks) == {"1", "2", "3"}, (name, ticks)  # never 0.5, 1.5, 2.5
    assert set(x_ticks(html, "eval")) <= {"0", "1", "2", "3"}
    for title in ("What a step learns from", "Entropy of the policy", "Learning rate"):
        assert title in html
    assert ">overlong<" in html and ">flat groups (all G rewards equal: no gradient)<" in html


def test_the_axis_rules_merge_equal_series_and_move_small_ones_out():
    rows = [
        {"step": s, "a": s, "b": s, "small": s / 1000, "flat": 0.5, "gone": float("nan")}
        for s in range(1, 11)
    ]
    spec = PanelSpec("units", (("a", "A"), ("b", "B"), ("small", "S"), ("flat", "F")))
    main_panel, own = plan_panels(spec, [Curves(rows)])
    assert [ln.label for ln in main_panel.lines] == [
        "A = B (equal at every step)",
        "F (constant 0.5)",
    ]
    assert [ln.label for ln in own.lines] == ["S"] and own.lines[0].values[0] == 0.001
    rows[4]["b"] += 0.1  # 1% of the span: drawn apart they would hide each other
    (close,) = plan_panels(PanelSpec("units", (("a", "A"), ("b", "B"))), [Curves(rows)])
    assert [ln.label for ln in close.lines] == ["A ≈ B"]
    assert close.notes == [
        "B and A are drawn as one line: they differ at 1 of 10 steps, by at most 0.1, "
        "under a line's width on this axis"
    ]
    rows[4]["b"] += 0.2  # 3%: apart
    apart = plan_panels(PanelSpec("units", (("a", "A"), ("b", "B"))), [Curves(rows)])
    assert len(apart[0].lines) == 2
    flat = PanelSpec("u", (("flat", "F"), ("gone", "G")))
    (alone,) = plan_panels(flat, [Curves(rows, {"flat": "why"})])
    assert not alone.lines and alone.notes == ["F: 0.5 at every step (10 steps); why"]
    (absent,) = plan_panels(PanelSpec("u", (("gone", "G"),)), [Curves(rows)])
    assert absent.absent  # a metric never logged finitely: its figure is left out


def test_flat_evaluations_are_a_note_and_a_log_axis_merges_only_what_overlaps():
    held_out = PanelSpec("%", (("eval_accuracy", "accuracy"),), points=True)
    rows = [{"step": 0, "eval_accuracy": 0.0}, {"step": 3, "eval_accuracy": 0.0}]
    (flat,) = plan_panels(held_out, [Curves(rows)])  # not a line on a -0.04..0.04 axis
    assert not flat.lines and flat.notes == ["accuracy: 0 at every evaluation (steps 0, 3)"]
    rows[1]["eval_accuracy"] = 4.0
    assert plan_panels(held_out, [Curves(rows)])[0].lines[0].values == [0.0, 4.0]
    # Phases of a step: 1e-3 s and 1e-5 s are two decades apart on a log axis, though both
    # are within 2% of a 10 s step's linear span; 1e-3 s and 1.01e-3 s do overlap there.
    spec = PanelSpec("s", (("whole", "whole"), ("score", "R"), ("logp", "L")), log=True)
    rows = [{"step": s, "whole": 10.0 + s, "score": 1e-3, "logp": 1e-5} for s in (1, 2, 3)]
    (apart,) = plan_panels(spec, [Curves(rows)])
    labels = [ln.label for ln in apart.lines]
    assert labels == ["whole", "R (constant 0.001)", "L (constant 1e-05)"]
    for r in rows:
        r["logp"] = 1.01e-3 if r["step"] == 2 else 1e-3
    (merged,) = plan_panels(spec, [Curves(rows)])
    assert [ln.label for ln in merged.lines] == ["whole", "R ≈ L (constant 0.001)"]
    assert merged.notes == [
        "L and R are drawn as one line: they differ at 1 of 3 steps, by at most a factor of "
        "1.01, under a line's width on this axis"
    ]


def test_config_differences_name_what_an_override_would_set():
    a = {"output_dir": "runs/a", "optim": {"learning_rate": 1e-4, "adam_beta1": 0.9}}
    b = {"output_dir": "runs/b", "optim": {"learning_rate": 3e-4, "adam_beta1": 0.9}}
    c = {"output_dir": "runs/c", "optim": {"learning_rate": 3e-4}, "rewards": {"f": ["x", "y"]}}
    assert config_differences([a, b]) == {"optim.learning_rate": ["1e-4", "3e-4"]}
    assert config_differences([a, b, c, None]) == {
        "optim.learning_rate": ["1e-4", "3e-4", "3e-4", None],
        "optim.adam_beta1": ["0.9", "0.9", "(absent)", None],
        "rewards.f": ["(absent)", "(absent)", "[x, y]", None],
    }
    shown = [override_text(v) for v in (None, True, 0.0, 0.9, 2.5e-6, 123456.0, 1 / 3, 30)]
    assert shown == ["null", "true", "0", "0.9", "2.5e-6", "1.23456e5", "0.3333333333333333", "30"]


@pytest.mark.slow
def test_runs_compared_on_one_page_each_in_its_colour(demo_run, lr_run, tmp_path):
    listing = {p: p.stat().st_mtime_ns for run in (demo_run, lr_run) for p in run.iterdir()}
    assert main(["report", str(demo_run), str(lr_run)]) == 0
    # Nothing written into the runs: their own reports stay theirs.
    assert listing == {p: p.stat().st_mtime_ns for run in (demo_run, lr_run) for p in run.iterdir()}
    out = demo_run.parent / "compare-demo-lr"  # beside the first run
    html = (out / "report.html").read_text()
    demo_label = f"{demo_run} (optim.learning_rate=3e-4)"
    lr_label = f"{lr_run} (optim.learning_rate=1e-4)"
    assert html.count(demo_label) >= 2 and html.count(lr_label) >= 2  # the tiles, each figure
    assert not re.search(r"<(script|link|img|iframe)\b", html) and "https://" not in html
    figures = {f.name: f for f in _planned(demo_run, lr_run)}
    (held_out,) = figures["eval.png"].panels
    assert sorted({ln.run for ln in held_out.lines}) == [0, 1]  # a line per run
    assert all(ln.steps == [0, 5, 10, 12] for ln in held_out.lines)
    lr = figures["loss.png"].panels[0]  # two constants: a note for each run
    assert lr.notes == [
        f"{demo_run}: learning rate: 0.0003 at every step (12 steps); "
        "schedule.lr_scheduler = constant, without warm-up",
        f"{lr_run}: learning rate: 0.0001 at every step (12 steps); "
        "schedule.lr_scheduler = constant, without warm-up",
    ]
    (kl,) = figures["kl.png"].panels
    assert kl.notes == ["every run: KL: 0 at every step (12 steps); KL off: beta = 0"]
    report = (out / "report.md").read_text()
    assert "| optim.learning_rate | 3e-4 | 1e-4 |" in report
    assert f"| blue | {demo_label} |" in report and f"| vermilion | {lr_label} |" in report
    for png in ("reward.png", "eval.png", "loss.png"):
        assert (out / png).is_file() and f"![{png}]({png})" in report
    image = screenshot(out / "report.html", tmp_path)
    background = near(image, "#ffffff", 8) | near(image, "#f4f6f9", 8)
    assert 1 - background.mean() > 0.04
    blue, vermilion = near(image, COLOURS[0]), near(image, COLOURS[1])
    assert blue.sum() > 2000 and vermilion.sum() > 2000  # each run's tiles and curves
    for colour in (blue, vermilion):  # in both columns of figures
        cols = np.nonzero(colour)[1]
        assert (cols < 600).sum() > 300 and (cols > 600).sum() > 300
    for width in (1200, 640):
        laid = layout(out / "report.html", tmp_path, width)
        assert laid["width"] == laid["view"] == width and laid["out"] == [], laid


def _planned(*run_dirs: Path):
    runs = [read_run(d) for d in run_dirs]
    curves = [Curves(plot_rows(r), constant_reasons(r.config, r.rows), str(r.path)) for r in runs]
    return plan_figures(curves, [str(r.path) for r in runs])


@pytest.mark.slow
def test_a_comparison_never_overwrites_a_runs_own_report(demo_run, lr_run, tmp_path, capsys):
    assert main(["report", str(demo_run), str(lr_run), "--output", str(lr_run)]) == 2
    assert "is a run directory" in capsys.readouterr().err
    assert main(["report", str(demo_run), str(demo_run)]) == 2
    assert "named twice" in capsys.readouterr().err
    report = write_comparison([lr_run, demo_run], tmp_path / "cmp")
    assert report == tmp_path / "cmp" / "report.md" and (tmp_path / "cmp" / "report.html").is_file()
    assert report.read_text().startswith(f"# Run comparison: {lr_run}, {demo_run}")


@pytest.mark.slow
def test_a_run_cut_short_without_its_files_still_gets_a_report(demo_run, tmp_path):
    run = tmp_path / "cut"
    run.mkdir()
    lines = (demo_run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])
    shutil.copy(demo_run / "config.yaml", run / "config.yaml")
    write_report(run)
    html = (run / "report.html").read_text()
    for said in (
        "metrics.jsonl: 1 unreadable line(s) skipped",
        "no summary.json: the run did not finish (last logged step 4 of 12)",
        "no preflight.json",
        "no held-out evaluation",
        "No completions were logged",
        "No objective.txt",
    ):
        assert said in html, said
    assert "no summary.json" in (run / "report.md").read_text()
    (run / "preflight.json").write_text(json.dumps({"skipped": True, "warning": "skipped!"}))
    (run / "summary.json").write_text('{"accuracy_before": 3')  # torn
    write_report(run)
    html = (run / "report.html").read_text()
    assert "skipped!" in html and "summary.json is unreadable" in html
