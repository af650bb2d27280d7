"""The preflight gate: `grpolab train` checks every quantity first and refuses to start on a
failure, unless --skip-preflight (which leaves a warning in the log and the run directory)."""

import json
import re
from pathlib import Path

from grpolab.commands.cli import main

MUTANTS = Path(__file__).parent / "mutants"
TINY = [
    "max_steps=1",
    "batch.prompts_per_step=2",
    "batch.num_generations=4",
    "rollout.max_completion_length=6",
    "eval.eval_examples=20",
]


def test_train_runs_the_preflight_first(tmp_path, capsys):
    out = tmp_path / "ok"
    assert main(["train", f"output_dir={out}", *TINY]) == 0
    report = json.loads((out / "preflight.json").read_text())
    assert report["passed"] is True
    assert {c["id"] for c in report["checks"]} >= {"clip.asymmetric", "logprobs.fused_vs_naive"}
    printed = capsys.readouterr().out
    assert "preflight: all" in printed
    # One line per group of checks as it starts, with the time so far: a real model's
    # preflight takes minutes.
    groups = re.findall(r"^preflight +(\d+\.\d) s  (\S.*)$", printed, re.MULTILINE)
    assert len(groups) >= 4 and groups[0][1].startswith("tokenizer.coverage")
    assert groups[1][1].startswith("sampling 8 prompts x 4")
    assert any(doing.startswith("the reward probes") for _, doing in groups)
    seconds = [float(t) for t, _ in groups]
    assert seconds == sorted(seconds)
    assert groups[-1][1].startswith("the worst-case memory")


def test_a_failing_check_refuses_to_start_and_leaves_output_dir_as_it_was(tmp_path, capsys):
    out = tmp_path / "bad"
    args = ["train", "--impl", str(MUTANTS / "eps_swapped.py"), f"output_dir={out}", *TINY]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "clip.asymmetric" in err and "--skip-preflight" in err
    assert f"output_dir={out} is as it was" in err
    assert not out.exists()  # not a file written: the same command may run again
    details = re.search(r"Details in (\S+\.json);", err).group(1)
    report = json.loads(Path(details).read_text())
    failed = {c["id"] for c in report["checks"] if not c["passed"]}
    assert "clip.asymmetric" in failed
    Path(details).unlink()
    assert main(args) == 1  # again, and not "holds another run"
    assert "holds another run" not in capsys.readouterr().err


def test_a_failed_start_with_overwrite_keeps_the_run_it_would_replace(tmp_path, capsys):
    out = tmp_path / "kept"
    assert main(["train", f"output_dir={out}", *TINY, "--skip-preflight"]) == 0
    before = sorted(p.name for p in out.iterdir())
    impl = str(MUTANTS / "eps_swapped.py")
    assert main(["train", "--impl", impl, "--overwrite", f"output_dir={out}", *TINY]) == 1
    assert sorted(p.name for p in out.iterdir()) == before
    assert (out / "checkpoint-1" / "COMPLETE").is_file()
    for line in capsys.readouterr().err.splitlines():
        if "Details in" in line:
            Path(re.search(r"Details in (\S+\.json);", line).group(1)).unlink()


def test_skip_preflight_trains_with_a_warning(tmp_path, capsys):
    out = tmp_path / "skipped"
    impl = str(MUTANTS / "eps_swapped.py")
    code = main(["train", "--impl", impl, "--skip-preflight", f"output_dir={out}", *TINY])
    assert code == 0
    assert "preflight skipped" in capsys.readouterr().out
    record = json.loads((out / "preflight.json").read_text())
    assert record["skipped"] is True and "not checked" in record["warning"]
    assert (out / "summary.json").exists()
