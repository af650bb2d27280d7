"""The trainer tells the truth off the beaten path: rewards that fail loudly, starts that
fail or stop without leaving anything behind, conflicts said in one line, and `grpolab eval`
of a checkpoint on its own run's task and config. Real runs of the demo model."""

from __future__ import annotations

import json
import re

import pytest

from grpolab.commands.cli import main

TINY = [
    "max_steps=5",
    "batch.prompts_per_step=2",
    "batch.num_generations=4",
    "eval.eval_examples=8",
    "logging.progress=false",
]

REWARDS = """
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
"""


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
        "3 steps (monitors.max_consecutive_reward_failures=3); its last error: KeyError: "
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
        assert main([*args, "--skip-preflight", "monitors.max_consecutive_reward_failures=3"]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        errors = [r[f"reward_errors/{name}"] for r in rows]
        assert errors == ([4.0] * 5 if name == "half_nan" else [8.0, 8.0, 0.0, 0.0, 0.0])
    assert "reward errors: half_nan 4" in capsys.readouterr().out


# --- Clean starts ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["model.name_or_path=/no/such/model"], "model.name_or_path='/no/such/model'"),
        (["rewards.functions=[no_such_file.py:f]"], "no_such_file.py"),
        (
            ["rollout.max_completion_length=60"],
            "rollout.max_completion_length=60: the longest prompt (train row 0, '",
        ),
    ],
)
def test_a_start_that_fails_after_the_run_dir_check_writes_nothing(
    tmp_path, capsys, extra, expected
):
    out = tmp_path / "run"
    assert main(["train", f"output_dir={out}", *TINY, *extra]) == 2
    assert expected in error_line(capsys.readouterr().err)
    assert not out.exists()
    kept = tmp_path / "kept"  # a run --overwrite would replace stays, when the start fails
    assert main(["train", f"output_dir={kept}", *TINY, "max_steps=1", "--skip-preflight"]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in kept.iterdir()}
    assert main(["train", f"output_dir={kept}", *TINY, *extra, "--overwrite"]) == 2
    assert {p.name: p.stat().st_mtime_ns for p in kept.iterdir()} == before


def test_the_context_check_names_the_key_the_prompt_and_the_context(tmp_path, capsys):
    assert main(["train", f"output_dir={tmp_path / 'x'}", "rollout.max_completion_length=60"]) == 2
    assert re.fullmatch(
        r"grpolab: error: rollout.max_completion_length=60: the longest prompt \(train row 0, "
        r"'\d\d\+\d\d='\) is 6 tokens, and 6 \+ 60 exceeds the model's context of 64 tokens "
        r"\(max_position_embeddings\); at most 58 fit",
        error_line(capsys.readouterr().err),
    )
    args = ["train", f"output_dir={tmp_path / 'y'}", "eval.eval_max_completion_length=59"]
    assert main(args) == 2
    assert "eval.eval_max_completion_length=59: the longest prompt (held-out row" in (
        error_line(capsys.readouterr().err)
    )


# --- Conflicts said, not swallowed ------------------------------------------------------------


def test_resume_and_overwrite_together_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", f"output_dir={out}", "--resume", "--overwrite", *TINY]) == 2
    assert error_line(capsys.readouterr().err) == (
        "grpolab: error: --resume and --overwrite contradict each other: --resume continues "
        f"the run in output_dir={str(out)!r}, --overwrite deletes it and starts over; pass one "
        "of them"
    )


def test_max_steps_below_the_resumed_checkpoint_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", f"output_dir={out}", *TINY, "max_steps=3", "--skip-preflight"]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(["train", f"output_dir={out}", *TINY, "max_steps=2", "--resume"]) == 2
    assert error_line(capsys.readouterr().err) == (
        f"grpolab: error: max_steps=2 is below the step of the checkpoint to resume "
        f"({out / 'checkpoint-3'}, step 3): set max_steps above 3 to train further"
    )
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


# --- grpolab eval of a run's checkpoint -------------------------------------------------------


def test_eval_of_a_checkpoint_uses_its_runs_task_and_config(tmp_path, capsys):
    rows = "".join(
        json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
        for a in range(10, 20)
        for b in range(30, 38)
    )
    data = tmp_path / "sums.jsonl"
    data.write_text(rows)
    out = tmp_path / "run"
    task = ["task.name=jsonl", f"task.path={data}", "task.num_eval=24"]
    assert main(["train", f"output_dir={out}", *TINY, *task, "--skip-preflight"]) == 0
    after = json.loads((out / "summary.json").read_text())["accuracy_after"]
    capsys.readouterr()
    assert main(["eval", "--model", str(out / "checkpoint-5"), "--examples", "8"]) == 0
    printed = capsys.readouterr().out
    assert f"with the config it was trained with ({out / 'checkpoint-5' / 'config.yaml'})" in (
        printed
    )
    # The trainer's own evaluation (eval.eval_examples=8) repeated: the same problems,
    # batches and lengths, the same number.
    assert f"accuracy (greedy): {after:.1f}% on 8 problems" in printed
    assert main(["eval", "--model", str(out / "checkpoint-5")]) == 0
    assert "on 24 problems" in capsys.readouterr().out  # --examples unset: all held-out rows


def test_an_evaluation_prints_its_progress(tmp_path, capsys, monkeypatch):
    from grpolab.train import loop

    monkeypatch.setattr(loop, "EVAL_PROGRESS_SECONDS", 0.0)  # a line after every batch
    out = tmp_path / "run"
    args = ["train", f"output_dir={out}", *TINY, "max_steps=1", "eval.eval_examples=24"]
    assert main([*args, "--skip-preflight"]) == 0
    printed = capsys.readouterr().out
    for done in (8, 16):  # batches of a step's 8 rows; the last one is the result line
        line = rf"held-out accuracy before GRPO: {done} of 24 problems \(\d+ s\)"
        assert re.search(line, printed), printed
