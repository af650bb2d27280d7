"""A run a user can trust: same seed, same weights with any thread count, a kill or Ctrl-C that
loses nothing, resumes that tell the truth, and one-line errors instead of tracebacks.

The runs here are real `grpolab train` processes on the shipped demo model."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from finished_runs import assert_same_run, metric_rows

from grpolab.train.checkpoint import latest_checkpoint, list_checkpoints

RUN = [
    "batch.prompts_per_step=4",
    "batch.num_generations=4",
    "eval.eval_examples=0",
    "logging.progress=false",
    "checkpoints.save_steps=1",
    "checkpoints.save_total_limit=null",
    "seed=7",
]


def grpolab(*args: str, threads: int = 1) -> subprocess.Popen:
    """A `grpolab` process; `threads` torch threads (runtime.num_threads for train)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "grpolab", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def train_args(out: Path, steps: int, threads: int, *extra: str) -> list[str]:
    return [
        "train",
        f"output_dir={out}",
        f"max_steps={steps}",
        f"runtime.num_threads={threads}",
        *RUN,
        "--skip-preflight",  # checked elsewhere; here only the numbers matter
        *extra,
    ]


def one_line_error(err: str) -> str:
    """The single error line a failed command printed (and no traceback)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("grpolab")]
    assert len(lines) == 1, err
    return lines[0]


# --- Determinism and resume ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_sigkill_then_resume_ends_where_a_straight_run_ends(tmp_path, threads):
    # Two same-seed runs at the same time, the straight one and the killed one (then its
    # resume): each slows the other, which is what changed the order of multi-threaded
    # accumulations before (index_put_ with repeated indices). With 2 threads, this is also
    # "two same-seed runs at once end bit-identical".
    steps = 8
    straight = grpolab(*train_args(tmp_path / "straight", steps, threads), threads=threads)
    killed_dir = tmp_path / "killed"
    killed = grpolab(*train_args(killed_dir, steps, threads), threads=threads)
    # Kill at a random moment after a random checkpoint (mid-step, mid-save, ...), at least two
    # steps before the end.
    rng = random.Random(threads)
    target = killed_dir / f"checkpoint-{rng.randint(1, steps - 3)}"
    deadline = time.time() + 300
    while not target.is_dir() and killed.poll() is None:
        assert time.time() < deadline, "the checkpoint did not appear"
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.05))
    killed.kill()
    killed.communicate()
    assert latest_checkpoint(killed_dir).name != f"checkpoint-{steps}", "killed too late"
    resumed = grpolab(*train_args(killed_dir, steps, threads), "--resume", threads=threads)
    rc, _, err = finish(straight)  # it ran on while the killed run resumed
    assert rc == 0, err
    rc, out, err = finish(resumed)
    assert rc == 0, err
    assert "resuming from" in out
    assert not [p for p in killed_dir.iterdir() if p.name.startswith(".tmp-")]
    assert_same_run(tmp_path / "straight", killed_dir, steps=steps)


# --- Ctrl-C, SIGTERM --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_stops_after_the_step_with_a_checkpoint_and_resumes(tmp_path, sig):
    out = tmp_path / "run"
    args = train_args(out, 40, 1, "checkpoints.save_steps=0")
    proc = grpolab(*args)
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(sig)
    rc, _, err = finish(proc)
    assert rc == 130, err
    line = one_line_error(err)
    assert "stopped after step" in line and "--resume" in line
    saved = latest_checkpoint(out)
    assert saved is not None
    step = int(saved.name.split("-")[1])
    assert [r["step"] for r in metric_rows(out)] == list(range(1, step + 1))
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
    args = train_args(out, step + 1, 1, "checkpoints.save_steps=0")
    rc, _, err = finish(grpolab(*args, "--resume"))
    assert rc == 0, err
    assert [r["step"] for r in metric_rows(out)] == list(range(1, step + 2))


@pytest.mark.slow
def test_ctrl_c_during_the_preflight_leaves_output_dir_as_it_was(tmp_path):
    out = tmp_path / "run"
    args = ["train", f"output_dir={out}", "max_steps=2", *RUN]  # the preflight runs first
    proc = grpolab(*args)
    deadline = time.time() + 300
    while "preflight " not in proc.stdout.readline():  # its first group has started
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
    proc.send_signal(signal.SIGINT)
    rc, _, err = finish(proc)
    assert rc == 130, err
    assert one_line_error(err) == (
        "grpolab: interrupted while running the preflight, before training started; nothing "
        f"was written (output_dir={out} is as it was)"
    )
    assert not out.exists()
    rc, _, err = finish(grpolab(*args))  # the same command again, no --overwrite needed
    assert rc == 0, err


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.3, 1.0, 2.5])
def test_ctrl_c_at_any_moment_ends_in_one_line_without_a_traceback(tmp_path, delay):
    # 0.3 s: Python's imports; later: the model, the preflight, the first steps, whatever
    # this machine's speed puts there. Every moment ends the same way.
    out = tmp_path / "run"
    proc = grpolab("train", f"output_dir={out}", "max_steps=40", *RUN)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    rc, _, err = finish(proc)
    assert rc == 130, err
    line = one_line_error(err)
    if out.exists():  # training had started: stopped after a step, with its checkpoint
        assert "stopped after step" in line and latest_checkpoint(out) is not None, line
    else:
        assert line.startswith("grpolab: interrupted"), line


# --- Damaged files -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 3-step run with a checkpoint after every step."""
    out = tmp_path_factory.mktemp("finished") / "run"
    rc, _, err = finish(grpolab(*train_args(out, 3, 1)))
    assert rc == 0, err
    return out


def copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.slow
def test_resume_passes_over_a_damaged_latest_checkpoint_and_names_it(finished_run, tmp_path):
    out = copy_run(finished_run, tmp_path / "run")
    truncate(out / "checkpoint-3" / "model.safetensors")
    rc, stdout, err = finish(grpolab(*train_args(out, 4, 1), "--resume"))
    assert rc == 0, err
    assert "checkpoint-3 is damaged (model.safetensors has" in " ".join(stdout.split())
    assert "resuming from" in stdout and "checkpoint-2 at step 2" in stdout
    assert (out / "damaged-checkpoint-3").is_dir()  # kept for a look, out of the listing
    assert [p.name for p in list_checkpoints(out)][-1] == "checkpoint-4"


@pytest.mark.slow
def test_resume_from_a_named_damaged_checkpoint_offers_the_intact_one(finished_run, tmp_path):
    out = copy_run(finished_run, tmp_path / "run")
    (out / "checkpoint-3" / "trainer_state.pt").write_bytes(b"not a torch file")
    before = sorted(p.name for p in out.iterdir())
    config_before = (out / "config.yaml").read_text()
    rc, _, err = finish(grpolab(*train_args(out, 4, 1), "--resume", str(out / "checkpoint-3")))
    assert rc == 2
    line = one_line_error(err)
    assert "checkpoint-3" in line and "trainer_state.pt" in line
    assert f"--resume {out / 'checkpoint-2'}" in line
    assert sorted(p.name for p in out.iterdir()) == before  # a failed command changes nothing
    assert (out / "config.yaml").read_text() == config_before


@pytest.mark.slow
def test_a_torn_metrics_line_is_dropped_and_reported_on_resume(finished_run, tmp_path):
    out = copy_run(finished_run, tmp_path / "run")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 0.1')  # what a crash mid-write leaves
    rc, stdout, err = finish(grpolab(*train_args(out, 4, 1), "--resume"))
    assert rc == 0, err
    assert "dropped 1 unreadable line" in " ".join(stdout.split())
    assert [r["step"] for r in metric_rows(out)] == [1, 2, 3, 4]


# --- Resume with another config ----------------------------------------------------------------


@pytest.mark.slow
def test_resume_with_another_learning_rate_is_refused_then_applied_for_real(finished_run, tmp_path):
    out = copy_run(finished_run, tmp_path / "run")
    config_before = (out / "config.yaml").read_text()
    args = train_args(out, 4, 1, "--resume", "optim.learning_rate=1e-3")
    rc, _, err = finish(grpolab(*args))
    assert rc == 2
    line = one_line_error(err)
    assert "optim.learning_rate (was 0.0003, now 0.001)" in line
    assert "--allow-config-change" in line
    assert (out / "config.yaml").read_text() == config_before

    rc, _, err = finish(grpolab(*args, "--allow-config-change"))
    assert rc == 0, err
    assert metric_rows(out)[-1]["lr"] == pytest.approx(1e-3, rel=1e-12)  # reached AdamW
    assert yaml.safe_load((out / "config.yaml").read_text())["optim"]["learning_rate"] == 1e-3
    saved = yaml.safe_load((latest_checkpoint(out) / "config.yaml").read_text())
    assert saved["optim"]["learning_rate"] == 1e-3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config_changes"] == [
        {"step": 3, "changes": {"optim.learning_rate": [0.0003, 0.001]}}
    ]


@pytest.mark.slow
def test_resume_may_change_bookkeeping_keys_without_asking(finished_run, tmp_path):
    out = copy_run(finished_run, tmp_path / "run")
    args = train_args(out, 4, 1, "--resume", "logging.log_completions_steps=2")
    rc, _, err = finish(grpolab(*args))
    assert rc == 0, err


# --- The command line ----------------------------------------------------------------------------


@pytest.mark.slow
def test_flags_and_overrides_in_any_order(finished_run, tmp_path):
    out = copy_run(finished_run, tmp_path / "run")
    # --resume before an override: the override is not taken for a checkpoint path.
    args = ["train", "--resume", f"output_dir={out}", "max_steps=4", *RUN]
    rc, stdout, err = finish(grpolab(*args, "--skip-preflight", "runtime.num_threads=1"))
    assert rc == 0, err
    assert f"resuming from {out / 'checkpoint-3'}" in " ".join(stdout.split())


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "--config", "no/such.yaml"], "no/such.yaml"),
        (["train", "batch.num_generations=abc"], "batch.num_generations"),
        (["train", "output_dir=/dev/null/run", "max_steps=1"], "output_dir='/dev/null/run'"),
        (["train", "--resume", "output_dir=/nonexistent/run"], "/nonexistent/run"),
        (["eval", "--model", "/nonexistent/model"], "/nonexistent/model"),
        (["rollout", "task.name=nosuchtask"], "task.name"),
        (["preflight", "objective.epsilon=2"], "objective.epsilon"),
        (["report", "/nonexistent/run"], "/nonexistent/run"),
    ],
)
def test_user_mistakes_end_in_one_line_naming_what_is_wrong(args, expected, capsys):
    from grpolab.commands.cli import main

    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert expected in one_line_error(err)


@pytest.mark.slow
def test_a_file_where_output_dir_should_be_created_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, _, err = finish(grpolab("train", f"output_dir={blocker}/run", "max_steps=1"))
    assert rc == 2
    assert f"{blocker}" in one_line_error(err) and "is a file" in err
    assert not (tmp_path / "runs").exists()
