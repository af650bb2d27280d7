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
from grpolab.commands.report import plot_rows, read_run, sample_completions, write_report
from grpolab.commands.report_plots import (
    COLOURS,
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
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "demo"
    assert main(["train", f"output_dir={out}", *DEMO]) == 0
    return out


def screenshot(html: Path, tmp_path: Path, size: tuple[int, int] = (1200, 2000)) -> np.ndarray:
    """The page as headless Chromium draws it: [height, width, RGB] in 0..255."""
    exe = shutil.which("chromium")
    if exe is None:  # CI installs it (scripts/setup.sh): a missing browser is a failure
        pytest.fail("chromium is not installed (Debian: apt-get install -y chromium)")
    png = tmp_path / "shot.png"
    command = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    command += [f"--screenshot={png}", f"--window-size={size[0]},{size[1]}", html.as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert png.is_file(), done.stderr[-2000:]
    return np.asarray(Image.open(png).convert("RGB"), dtype=np.int32)


def near(image: np.ndarray, colour: str, distance: int = 40) -> np.ndarray:
    """Pixels within `distance` (max over channels) of a #rrggbb colour."""
    rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
    return np.abs(image - rgb).max(axis=-1) <= distance


@pytest.mark.slow
def test_report_html_is_self_contained_and_chromium_draws_its_curves(demo_run, tmp_path):
    write_report(demo_run)
    html = (demo_run / "report.html").read_text()
    assert not re.findall(r"https?://", html)  # no address outside the file, not even xmlns
    assert not re.search(r"<(script|link|img|iframe)\b", html)
    ids = re.findall(r'\bid="([^"]+)"', html)
    assert len(ids) == len(set(ids)) > 50  # the inline SVGs' clip paths and glyphs stay apart
    assert html.count("<svg") == len(plan_figures(plot_rows(read_run(demo_run)), {}))
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


def test_no_series_is_drawn_on_another_series_axis(demo_run):
    run = read_run(demo_run)
    figures = {
        f.name: f for f in plan_figures(plot_rows(run), constant_reasons(run.config, run.rows))
    }
    grad_norm, loss = figures["loss.png"].panels
    assert [ln.label for ln in loss.lines] == ["loss"] and len(grad_norm.lines) == 1
    # The demo's beta is 0 and each batch gets one optimizer step: notes, not flat lines.
    (kl,) = figures["kl.png"].panels
    assert not kl.lines and kl.notes == ["KL: 0 at every step (12 steps); KL off: beta = 0"]
    (clip,) = figures["clip_frac.png"].panels
    assert not clip.lines and "the ratio was 1 at every step" in clip.notes[0]
    (held_out,) = figures["eval.png"].panels  # before, at steps 5 and 10, after
    assert held_out.lines[0].steps == [0, 5, 10, 12]
    (time,) = figures["time.png"].panels
    assert time.log and len(time.lines) == 5  # 4e-5 s beside 4e-2 s: both visible


def test_the_axis_rules_merge_equal_series_and_move_small_ones_out():
    rows = [
        {"step": s, "a": s, "b": s, "small": s / 1000, "flat": 0.5, "gone": float("nan")}
        for s in range(1, 11)
    ]
    spec = PanelSpec("units", (("a", "A"), ("b", "B"), ("small", "S"), ("flat", "F")))
    main_panel, own = plan_panels(spec, rows, {})
    assert [ln.label for ln in main_panel.lines] == [
        "A = B (equal at every step)",
        "F (constant 0.5)",
    ]
    assert [ln.label for ln in own.lines] == ["S"] and own.lines[0].values[0] == 0.001
    rows[4]["b"] += 0.1  # 1% of the span: drawn apart they would hide each other
    (close,) = plan_panels(PanelSpec("units", (("a", "A"), ("b", "B"))), rows, {})
    assert [ln.label for ln in close.lines] == ["A ≈ B"]
    assert close.notes == ["B differs from A at 1 of 10 steps, by at most 0.1: drawn as one line"]
    rows[4]["b"] += 0.2  # 3%: apart
    assert len(plan_panels(PanelSpec("units", (("a", "A"), ("b", "B"))), rows, {})[0].lines) == 2
    (alone,) = plan_panels(PanelSpec("u", (("flat", "F"), ("gone", "G"))), rows, {"flat": "why"})
    assert not alone.lines and alone.notes == ["F: 0.5 at every step (10 steps); why"]
    (absent,) = plan_panels(PanelSpec("u", (("gone", "G"),)), rows, {})
    assert absent.absent  # a metric never logged finitely: its figure is left out


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
