"""Every shell and Python block of README.md and docs/*.md runs as written, in order, in a
fresh directory, or says why it does not, so the docs cannot drift from the code.

A fenced block names its kind (```bash, ```python; ```text, ```yaml, ```json are shown, never
run). A marker on the line right before the fence says what else to do with it:

    <!-- not run: REASON -->   shown, not run (a GPU, vLLM, several processes, a long run)
    <!-- file: NAME -->        written to NAME in the directory, not run
    <!-- exit N -->            run; it must end with exit status N (else 0)
    <!-- output -->            (a text block) an excerpt of the output of the block run last:
                               every line of it is in that output ("..." lines skip; numbers
                               with a decimal point and runs of spaces may differ)

Shell blocks run under `bash -e`, where `.venv/bin/grpolab`, `.venv/bin/python` and
`./demo.sh` are this interpreter's `-m grpolab`, this interpreter and `-m grpolab train`;
Python blocks run with this interpreter. The directory links the repository's examples/ and
tests/, which the docs name from the repository root. `python tests/test_docs.py FILE` runs
one file's blocks and prints what each printed (to paste a real output).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"bash", "python"}
SHOWN = {"text", "yaml", "json"}
LINKED = ("examples", "tests")  # repository folders the docs' commands name
MARKER = re.compile(r"<!-- (not run|file|exit|output)(?::? (.*?))? -->")
FENCE = re.compile(r"^```(.*)$")
BLOCK_TIMEOUT_S = 900  # a loaded 2-core machine; a block takes seconds when idle


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None  # "not run", "file", "exit", "output" or None
    arg: str  # the marker's argument (the reason, the file name, the status)

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUN and self.marker not in ("not run", "file")


def blocks(doc: Path) -> list[Block]:
    """The fenced blocks of `doc` in order, each with the marker on the line before it."""
    lines = doc.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), None)
        assert end is not None, f"{doc.relative_to(ROOT)}:{i + 1}: a fence that never closes"
        before = next((s for s in reversed(lines[:i]) if s.strip()), "").strip()
        marker = MARKER.fullmatch(before)
        assert marker or not before.startswith("<!--"), (
            f"{doc.relative_to(ROOT)}:{i}: not a marker: {before}"
        )
        kind, arg = (marker.group(1), (marker.group(2) or "").strip()) if marker else (None, "")
        text = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(doc, i + 1, opening.group(1).strip(), text, kind, arg))
        i = end + 1
    return found


def problems(block: Block) -> list[str]:
    """What is wrong with how `block` is marked (nothing: it runs or says why not)."""
    if block.lang not in RUN | SHOWN:
        return [
            f"{block.where}: a fence without a kind ({block.lang!r}): write one of "
            f"{sorted(RUN | SHOWN)}"
        ]
    out = []
    if block.marker == "not run" and not block.arg:
        out.append(f"{block.where}: 'not run' says no reason")
    if block.marker == "file" and not block.arg:
        out.append(f"{block.where}: 'file' names no file")
    if block.marker == "exit" and (block.lang not in RUN or not block.arg.isdigit()):
        out.append(f"{block.where}: 'exit N' belongs on a run block, with a number")
    if block.marker == "output" and block.lang != "text":
        out.append(f"{block.where}: 'output' belongs on a text block")
    if block.marker == "not run" and block.lang not in RUN:
        out.append(f"{block.where}: a {block.lang} block is never run; drop the marker")
    return out


def indented_code(doc: Path) -> list[str]:
    """Lines of indented code blocks (4 spaces after a blank line, outside fences): they would
    escape the checks, so commands go in fenced blocks."""
    out, fenced, previous = [], False, ""
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("    ") and line.strip() and not previous.strip():
            out.append(f"{doc.relative_to(ROOT)}:{n}: an indented code block; fence it")
        previous = line
    return out


def shell(script: str) -> str:
    """The block with the repository's commands as this interpreter runs them."""
    python = shlex.quote(sys.executable)
    for written, meant in (
        (r"\.venv/bin/grpolab", f"{python} -m grpolab"),
        (r"\.venv/bin/python", python),
        (r"\./demo\.sh", f"{python} -m grpolab train"),
    ):
        script = re.sub(rf"(?<![\w./-]){written}(?![\w.-])", meant, script)
    return script


def run_block(block: Block, work: Path, scripts: Path) -> subprocess.CompletedProcess:
    if block.lang == "python":
        script = scripts / f"{block.doc.stem}-{block.line}.py"
        script.write_text(block.text)
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-e", "-c", shell(block.text)]
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1"}
    return subprocess.run(
        command,
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )


def normalised(text: str) -> str:
    """Numbers with a decimal point (times, measured values) as '#', whitespace as one space."""
    text = re.sub(r"\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+", "#", text)
    return " ".join(text.split())


def missing_lines(excerpt: str, output: str) -> list[str]:
    said = normalised(output)
    return [
        line
        for line in excerpt.splitlines()
        if line.strip() and line.strip() != "..." and normalised(line) not in said
    ]


def run_doc(doc: Path, base: Path, echo: bool = False) -> list[str]:
    """Run `doc`'s blocks in order in `base`/work; returns the failures (empty: all ran)."""
    work, scripts = base / "work", base / "blocks"
    work.mkdir()
    scripts.mkdir()
    for name in LINKED:
        (work / name).symlink_to(ROOT / name)
    last = None  # (block, its output)
    for block in blocks(doc):
        if block.marker == "file":
            (work / block.arg).write_text(block.text)
        elif block.runs:
            done = run_block(block, work, scripts)
            output = done.stdout + done.stderr
            if echo:
                print(f"===== {block.where} (exit {done.returncode})\n{output}")
            expected = int(block.arg) if block.marker == "exit" else 0
            if done.returncode != expected:
                return [
                    f"{block.where}: exit {done.returncode}, expected {expected}:\n"
                    f"{block.text}\n--- its output (end) ---\n{output[-4000:]}"
                ]
            last = (block, output)
        elif block.marker == "output":
            if last is None:
                return [f"{block.where}: an output excerpt with no block run before it"]
            missing = missing_lines(block.text, last[1])
            if missing:
                return [
                    f"{block.where}: lines not in the output of {last[0].where}: "
                    f"{missing}\n--- that output (end) ---\n{last[1][-4000:]}"
                ]
    return []


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def broken_links(doc: Path) -> list[str]:
    """Relative links to a file that does not exist, or to a heading it does not have."""
    out = []
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            out.append(f"{doc.relative_to(ROOT)}: link to {target}: no such file")
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.MULTILINE)
            if anchor not in {slug(h) for h in headings}:
                out.append(f"{doc.relative_to(ROOT)}: link to {target}: no such heading")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_block_runs_or_says_why(doc):
    found = [p for b in blocks(doc) for p in problems(b)] + indented_code(doc)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_links_resolve(doc):
    assert not broken_links(doc), "\n".join(broken_links(doc))


def test_the_preflight_page_names_every_check_and_mutant():
    """docs/PREFLIGHT.md lists the checks and the known bugs; the registry is their home."""
    from grpolab.checks.registry import ALL

    page = (ROOT / "docs" / "PREFLIGHT.md").read_text()
    missing = [c.id for c in ALL if f"`{c.id}`" not in page]
    missing += [
        f.stem for f in (ROOT / "tests" / "mutants").glob("*.py") if f"`{f.stem}`" not in page
    ]
    assert not missing, f"docs/PREFLIGHT.md does not name: {missing}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "doc", [d for d in DOCS if any(b.runs for b in blocks(d))], ids=lambda d: d.name
)
def test_the_blocks_run_as_written(doc, tmp_path):
    failures = run_doc(doc, tmp_path)
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    import tempfile

    for name in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as base:
            print("\n".join(run_doc(Path(name).resolve(), Path(base), echo=True)) or "all ran")
