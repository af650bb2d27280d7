"""A user's own run through the real command: one run per directory, what is knowable at the
start refused in its first seconds with nothing written, a start that never trained does not
block the same command, --overwrite replaces the report too, the user's rows are trained on,
a passing preflight is reused, a checkpoint is data, keys without effect are a warning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpolab.rollout.advice import sampling_advice
from grpolab.train.monitors import flat_cause
from grpolab.train.rundir import LOCK_FILE


def grpolab(*args: str, cwd: Path, timeout: int = 600, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "grpolab", *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, **(env or {})},
    )  # fmt: skip


def start(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "grpolab", *args], cwd=cwd, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def error_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("grpolab")]
    assert lines, done.stdout[-2000:] + done.stderr[-2000:]
    return lines[-1]


def write_rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i + 1}=", "answer": str(2 * i + 1)})
                            + "\n" for i in range(n)))  # fmt: skip
    return path


# --- One run per directory ------------------------------------------------------------------------


@pytest.mark.slow  # the real command
def test_a_second_train_on_a_held_directory_stops_at_once_naming_the_holder(tmp_path):
    first = start("train", "output_dir=twin", "max_steps=100000", cwd=tmp_path)
    lock = tmp_path / "twin" / LOCK_FILE
    for _ in range(600):  # the first run takes its lock after its imports
        if lock.is_file() and lock.read_text().strip():
            break
        time.sleep(0.1)
    assert first.poll() is None, first.communicate()
    for flags in ((), ("--overwrite",), ("--resume",)):
        second = grpolab("train", "output_dir=twin", "max_steps=40", *flags, cwd=tmp_path)
        assert second.returncode == 2, second.stdout[-2000:]
        line = error_line(second)
        assert "in use by a run in progress" in line and f"pid {first.pid} on " in line
        assert "started 20" in line and "grpolab train output_dir=twin max_steps=100000" in line
    first.send_signal(signal.SIGINT)  # stops after its step, with a checkpoint
    out, err = first.communicate(timeout=600)
    assert first.returncode == 130, out[-2000:] + err[-2000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "twin/metrics.jsonl").open()]
    assert steps == list(range(1, len(steps) + 1))  # the first run's rows alone, each once
    assert (tmp_path / "twin" / f"checkpoint-{steps[-1]}").is_dir()
    assert not lock.exists()  # released when the run ended


@pytest.mark.slow  # the real command
def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_note(tmp_path):
    run = tmp_path / "killed"
    first = start("train", "output_dir=killed", "max_steps=400", "checkpoints.save_steps=5",
                  cwd=tmp_path)  # fmt: skip
    for _ in range(1200):
        if (run / "checkpoint-5" / "COMPLETE").is_file():
            break
        time.sleep(0.1)
    first.kill()  # SIGKILL: no handler runs, the lock file stays behind
    first.communicate()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == first.pid
    again = grpolab("train", "output_dir=killed", "max_steps=7", "checkpoints.save_steps=5",
                    "--resume", "--allow-config-change", cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"took over the lock of a run that is no longer running (pid {first.pid}" in (
        again.stdout
    )
    assert (run / "checkpoint-7").is_dir() and not (run / LOCK_FILE).exists()


# --- What is knowable at the start ----------------------------------------------------------------


@pytest.mark.slow  # the real command
def test_a_dataset_too_small_for_the_batch_is_refused_first_naming_the_fixes(tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl", 10)
    tic = time.perf_counter()
    done = grpolab("train", "task.name=jsonl", f"task.path={rows}", "output_dir=small",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and time.perf_counter() - tic < 120  # no model, no preflight
    assert error_line(done) == (
        "grpolab: error: task 'jsonl' has 10 training rows, and each step draws "
        "batch.prompts_per_step=16 distinct ones: set batch.prompts_per_step to at most 10, "
        "or give the task more rows"
    )
    assert "preflight" not in done.stdout and not (tmp_path / "small").exists()
    held = grpolab("train", "task.name=jsonl", f"task.path={rows}", "task.num_eval=4",
                   "batch.prompts_per_step=8", "output_dir=small", cwd=tmp_path)  # fmt: skip
    assert held.returncode == 2 and "6 training rows, 4 held out (task.num_eval=4" in (
        error_line(held)
    )
    assert "hold out fewer rows (task.num_eval, task.eval_fraction)" in error_line(held)


@pytest.mark.slow  # the real command
def test_a_missing_tracker_is_refused_before_anything_slow(tmp_path):
    done = grpolab("train", "logging.report_to=[wandb]", "output_dir=tracked", cwd=tmp_path)
    assert done.returncode == 2
    assert error_line(done).endswith(
        "logging.report_to lists 'wandb' but wandb is not installed (pip install wandb)"
    )
    assert "preflight" not in done.stdout and not (tmp_path / "tracked").exists()


@pytest.mark.slow  # the real command
def test_a_misspelt_model_name_fails_in_seconds_with_a_did_you_mean(tmp_path):
    done = grpolab("train", "model.name_or_path=smollm2-135m", "output_dir=typo",
                   cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert done.returncode == 2
    line = error_line(done)
    assert "model.name_or_path='smollm2-135m' is not a packaged model" in line
    assert line.endswith("did you mean 'smollm2-135m-instruct'?")
    assert not (tmp_path / "typo").exists()


# --- A start that never trained, --overwrite ------------------------------------------------------


@pytest.mark.slow  # the real command
def test_a_run_that_stopped_before_its_first_checkpoint_is_started_over(tmp_path):
    run = tmp_path / "unfinished"
    run.mkdir()
    (run / "config.yaml").write_text("max_steps: 3\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.0}) + "\n")
    resumed = grpolab("train", "output_dir=unfinished", "max_steps=3", "--resume", cwd=tmp_path)
    assert resumed.returncode == 2
    assert "stopped before its first checkpoint, so there is nothing to resume" in (
        error_line(resumed)
    )
    again = grpolab("train", "output_dir=unfinished", "max_steps=3", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "replaced the files of a run that stopped before its first checkpoint" in again.stdout
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()]
    assert steps == [1, 2, 3]


@pytest.mark.slow  # the real command
def test_overwrite_removes_every_file_of_the_previous_run_report_included(tmp_path):
    assert grpolab("train", "output_dir=r", "max_steps=2", cwd=tmp_path).returncode == 0
    assert grpolab("report", "r", cwd=tmp_path).returncode == 0
    run = tmp_path / "r"
    drawn = {p.name for p in run.glob("*.png")} | {"report.html", "report.md"}
    assert {"report.html", "report.md", "reward.png"} <= drawn
    (run / "notes.txt").write_text("mine")  # not the run's: kept
    again = grpolab("train", "output_dir=r", "max_steps=3", "--overwrite", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    left = {p.name for p in run.iterdir()}
    assert not drawn & left and "notes.txt" in left
    assert {"checkpoint-3", "summary.json"} <= left and "checkpoint-2" not in left


# --- The user's data, the preflight reused --------------------------------------------------------


@pytest.mark.slow  # the real command
def test_a_trl_style_train_dataset_is_all_training_data(tmp_path):
    from grpolab import GRPOConfig, GRPOTrainer
    from grpolab.tasks import load_task

    rows = [{"prompt": f"{i}+11=", "answer": str(i + 11)} for i in range(10, 74)]
    trainer = GRPOTrainer(model="demo", train_dataset=rows,
                          args=GRPOConfig(output_dir=str(tmp_path / "run")))  # fmt: skip
    task = load_task(trainer.config.task)
    assert (len(task.train), len(task.eval)) == (64, 0)  # TRL's meaning: none held out
    with_eval = GRPOTrainer(model="demo", train_dataset=rows, eval_dataset=rows[:8])
    task = load_task(with_eval.config.task)
    assert (len(task.train), len(task.eval)) == (64, 8)


@pytest.mark.slow  # the real command
def test_a_repeated_train_reuses_its_passing_preflight(tmp_path):
    first = grpolab("preflight", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    reused = grpolab("train", "output_dir=a", "max_steps=1", cwd=tmp_path)
    assert reused.returncode == 0, reused.stderr[-2000:]
    assert "preflight: reusing the pass of" in reused.stdout and "--recheck" in reused.stdout
    record = json.loads((tmp_path / "a/preflight.json").read_text())
    assert record["passed"] and len(record["fingerprint"]) == 16
    changed = grpolab("train", "output_dir=b", "max_steps=1", "objective.epsilon=0.1",
                      cwd=tmp_path)  # fmt: skip
    assert "preflight: all" in changed.stdout and "reusing" not in changed.stdout
    forced = grpolab("train", "output_dir=c", "max_steps=1", "--recheck", cwd=tmp_path)
    assert "preflight: all" in forced.stdout and "reusing" not in forced.stdout


# --- A checkpoint is data -------------------------------------------------------------------------

EVIL = """
import os, sys, torch
class Payload:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
torch.save({"optimizer": Payload()}, sys.argv[1])
"""


@pytest.mark.slow  # the real command
def test_a_crafted_trainer_state_is_refused_and_runs_nothing(tmp_path):
    from grpolab.train.checkpoint import _manifest

    assert grpolab("train", "output_dir=r", "max_steps=1", cwd=tmp_path).returncode == 0
    checkpoint = tmp_path / "r" / "checkpoint-1"
    marker = tmp_path / "code-ran"
    state = checkpoint / "trainer_state.pt"
    made = subprocess.run([sys.executable, "-c", EVIL, str(state), str(marker)],
                          capture_output=True, text=True)  # fmt: skip
    assert made.returncode == 0, made.stderr
    complete = json.loads((checkpoint / "COMPLETE").read_text())
    complete["files"] = _manifest(checkpoint)  # the manifest matches the crafted file
    (checkpoint / "COMPLETE").write_text(json.dumps(complete))
    done = grpolab("train", "output_dir=r", "max_steps=2", "--resume", cwd=tmp_path)
    assert done.returncode == 2 and not marker.exists()
    assert "holds more than tensors and plain values (it asks for posix.system): refused" in (
        error_line(done)
    )


# --- Keys without effect --------------------------------------------------------------------------


@pytest.mark.slow  # the real command
def test_a_key_without_effect_is_a_warning_and_strict_refuses_it(tmp_path):
    said = grpolab("train", "output_dir=w", "max_steps=1", "objective.kl_estimator=k2",
                   cwd=tmp_path)  # fmt: skip
    assert said.returncode == 0, said.stderr[-2000:]
    warning = ("objective.kl_estimator='k2' has no effect with objective.beta=0: there is no KL "
               "term (set objective.beta > 0 for one): ignored (--strict refuses it)")  # fmt: skip
    assert warning in said.stdout.replace("\n", " ")
    assert json.loads((tmp_path / "w/preflight.json").read_text())["config_warnings"] == [warning]
    strict = grpolab("train", "output_dir=s", "max_steps=1", "objective.kl_estimator=k2",
                     "--strict", cwd=tmp_path)  # fmt: skip
    assert strict.returncode == 2 and "(strict refuses it)" in error_line(strict)
    assert not (tmp_path / "s").exists()


@pytest.mark.slow  # the real command
def test_the_first_step_explains_a_loss_of_zero_and_the_console_shows_changed_keys(tmp_path):
    done = grpolab("train", "output_dir=z", "max_steps=1", "optim.learning_rate=1e-4",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.replace("\n", " ")
    assert "note: a loss of ~0 is expected" in out
    assert "optim.learning_rate = 0.0001" in out and "Resolved config" not in out
    assert "z/config.yaml holds every value" in out


# --- What a batch says (no command) ---------------------------------------------------------------


def test_sampling_advice_names_the_likely_setting():
    empty = ["", " ", "", "cold"]
    chat = sampling_advice(empty, torch.zeros(4), has_chat_template=True, chat_template_on=False)
    assert chat == [
        "3 of 4 completions are empty; the tokenizer has a chat template that the task does "
        "not apply: a chat model answers its own format (task.chat_template=true)",
        "every reward is 0; the tokenizer has a chat template that the task does not apply: "
        "a chat model answers its own format (task.chat_template=true)",
    ]
    plain = sampling_advice(empty, torch.zeros(4), has_chat_template=False, chat_template_on=False)
    assert plain == ["3 of 4 completions are empty; the model ends them at once: word the prompt "
                     "so that it asks for an answer (task.prompt_template)"]  # fmt: skip
    assert sampling_advice(["a", "", "b", "c"], torch.ones(4), True, True) == []


def test_the_flat_group_monitor_tells_a_solved_batch_from_one_out_of_reach():
    solved = {"frac_reward_zero_std": 0.96, "frac_reward_zero_std/all_right": 0.9,
              "frac_reward_zero_std/all_wrong": 0.06}  # fmt: skip
    assert flat_cause(solved).startswith("94% of the flat groups are all right: the model has")
    hard = {"frac_reward_zero_std": 1.0, "frac_reward_zero_std/all_right": 0.0,
            "frac_reward_zero_std/all_wrong": 1.0}  # fmt: skip
    assert flat_cause(hard).startswith("100% of the flat groups are all wrong: the task is out")
    assert flat_cause({"frac_reward_zero_std": 1.0}) is None  # no references: no verdict
