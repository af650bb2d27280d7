"""The README's "Your own task" snippets, run as written (the CLI's `.venv/bin/grpolab` is
this interpreter's `-m grpolab`), so the docs cannot drift from the code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def snippets(language: str) -> list[str]:
    text = README.read_text()
    section = text.split("## Your own task", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, re.DOTALL)


@pytest.mark.slow
def test_the_python_snippet_trains(tmp_path):
    (code,) = snippets("python")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "preflight: all" in done.stdout
    assert re.search(
        r"task jsonl: 270 training rows, 30 held out \(task.eval_fraction=0.1", done.stdout
    )
    assert re.fullmatch(r"[\d.]+ -> [\d.]+", done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_the_cli_snippet_trains(tmp_path):
    (script,) = snippets("bash")
    script = script.replace(".venv/bin/grpolab", f"{sys.executable} -m grpolab")
    done = subprocess.run(["bash", "-euc", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "task jsonl: 72 training rows, 8 held out" in done.stdout
    assert (tmp_path / "runs" / "mine-cli" / "summary.json").is_file()
