"""The shape of the code: layers that import downwards only, no import cycle, and functions
short enough to read (every one in the package)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "grpolab"
MAX_FUNCTION_LINES = 80


@pytest.mark.slow
def test_the_layers_contract_holds():
    # In a process of its own: import-linter reconfigures logging for the process it runs in.
    lint_imports = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(lint_imports), "--no-cache", "--config", "pyproject.toml"],
        cwd=SRC.parent.parent,  # the contract lives in pyproject.toml
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Contracts: 4 kept, 0 broken" in done.stdout


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("grpolab", cache_dir=None)
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if graph.chain_exists(importer=imported, imported=module):
                chain = graph.find_shortest_chain(importer=imported, imported=module)
                cycles.append(f"{module} -> {' -> '.join(chain)}")
    assert not cycles, "\n".join(cycles)


def test_every_function_fits_on_a_screen():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    name = path.relative_to(SRC)
                    long.append(f"{name}:{node.lineno} {node.name} is {lines} lines")
    assert not long, "\n".join(long)
