"""`grpolab report`: the curves, and beside them sample completions of early, middle and late
steps with the strict verdict (curves alone drew a gamed reward as a success)."""

import json

from grpolab.report import sample_completions, write_report


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
