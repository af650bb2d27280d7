"""The trainer tells the truth off the beaten path: rewards that fail loudly, starts that
fail or stop without leaving anything behind, conflicts said in one line, and `grpolab eval`
of a checkpoint on its own run's task and config. Real runs of the demo model."""

from __future__ import annotations

import json
import re

import pytest

from grpolab.cli import main

TINY = [
    "max_steps=5",
    "trainer.prompts_per_step=2",
    "trainer.num_generations=4",
    "trainer.eval_examples=8",
    "trainer.progress=false",
]

REWARDS = '''
CALLS = [0]


def broken(completions, **columns):
    raise KeyError("solution")


def half_nan(completions, **columns):
    return [float("nan") if i % 2 else 1.0 for i in range(len(completions))]


def flaky(completions, **columns):
    # Call 1 scores the reward probes (the scale the monitors read), calls 2-3 steps 1-2:
    # those fail on every sample, later steps succeed.
    CALLS[0] += 1
    if 2 <= CALLS[0] <= 3:
        raise RuntimeError("the grader is down")
    return [0.0] * len(completions)
'''


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def functions(rewards_file, name: str) -> str:
    return f"rewards.functions=[accuracy,{rewards_file}:{name}]"


def error_line(err: str) -> str:
    assert "Traceback (most recent call last)" not in err.split("grpolab: error:")[-1]
    lines = [line for line in err.splitlines() if line.startswith("grpolab: error:")]
    assert len(lines) == 1, err
    return lines[0]


# --- Rewards that fail loudly ----------------------------------------------------------------


def test_a_reward_that_raises_fails_the_preflight_naming_it_and_its_error(
    rewards_file, tmp_path, capsys
):
    out = tmp_path / "run"
    assert main(["train", f"output_dir={out}", functions(rewards_file, "broken"), *TINY]) == 1
    captured = capsys.readouterr()
    assert re.search(
        r"FAIL rewards.reference: reward 'broken' failed on (\d+) of \1 probes: KeyError: "
        r"'solution'",
        captured.out,
    ), captured.out
    assert "rewards.reference" in error_line(captured.err)


def test_a_reward_failing_on_every_sample_stops_the_run_with_a_checkpoint(
    rewards_file, tmp_path, capsys
):
    out = tmp_path / "run"
    args = ["train", f"output_dir={out}", functions(rewards_file, "broken"), *TINY]
    assert main([*args, "--skip-preflight"]) == 1
    captured = capsys.readouterr()
    assert error_line(captured.err) == (
        "grpolab: error: stopped at step 3: reward 'broken' failed on every sample of the last "
        "3 steps (trainer.max_consecutive_reward_failures=3); its last error: KeyError: "
        f"'solution'; checkpoint {out / 'checkpoint-3'}"
    )
    assert (out / "checkpoint-3" / "COMPLETE").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_errors/broken"] for r in rows] == [8.0, 8.0, 8.0]  # every sample counted
    assert captured.out.count("reward errors: broken 8") == 3  # on each step's line


def test_partial_and_passing_reward_failures_are_counted_without_stopping(
    rewards_file, tmp_path, capsys
):
    for name in ("half_nan", "flaky"):
        out = tmp_path / name
        args = ["train", f"output_dir={out}", functions(rewards_file, name), *TINY]
        assert main([*args, "--skip-preflight", "trainer.max_consecutive_reward_failures=3"]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        errors = [r[f"reward_errors/{name}"] for r in rows]
        assert errors == ([4.0] * 5 if name == "half_nan" else [8.0, 8.0, 0.0, 0.0, 0.0])
    assert "reward errors: half_nan 4" in capsys.readouterr().out
