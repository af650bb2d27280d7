"""The config stops at setup: the modules a step runs through read typed records built once
from it (`Run.objective`: the objective with G and the temperature; `Run.settings`:
`StepSettings`; `Run.plan`; an engine's own section), never the whole `Config`. Read from
the source's syntax tree, so that a new `run.cfg.x` in any of them fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import grpolab

SRC = Path(grpolab.__file__).parent
# The step and what it calls: the core functions, the log-prob paths, the engines, the
# checks on a batch. (checks/memory.py and checks/rewards.py check the configured run as a
# whole in the preflight: its eval lengths, its templates, its engine's memory.)
STEP_PATH = [
    "train/step.py",
    "core.py",
    "functions.py",
    "model/logprobs.py",
    "model/packed.py",
    "model/prefix.py",
    "model/lmhead.py",
    "model/decoder.py",
    "rollout/base.py",
    "rollout/common.py",
    "rollout/engine.py",
    "rollout/hf.py",
    "rollout/vllm.py",
    *(f"checks/{p.name}" for p in sorted((SRC / "checks").glob("*.py"))
      if p.name not in ("memory.py", "rewards.py")),
    *(f"objective/{p.name}" for p in sorted((SRC / "objective").glob("*.py"))),
]  # fmt: skip


# The training loop's inner parts, each step's (`Session.loop`: LoopSettings); the loop's
# start and finish set the run up from the config.
LOOP_INNER = ("steps", "watch", "count_reward_failures", "record", "stop_if_unhealthy", "save",
              "held_out_accuracy")  # fmt: skip


def config_reads(path: Path, functions: tuple[str, ...] = ()) -> list[str]:
    """Where the module (or only its `functions`, when named) names the whole config: a name
    or attribute `cfg`, or an import of `Config` (line: what)."""
    found = []
    tree = ast.parse(path.read_text())
    roots = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in functions]
    assert len(roots) == len(functions), "a named function is missing"
    for node in (n for root in (roots or [tree]) for n in ast.walk(root)):
        if isinstance(node, ast.Name) and node.id == "cfg":
            found.append(f"{node.lineno}: cfg")
        elif isinstance(node, ast.arg) and node.arg == "cfg":
            found.append(f"{node.lineno}: parameter cfg")
        elif isinstance(node, ast.Attribute) and node.attr == "cfg":
            found.append(f"{node.lineno}: .cfg")
        elif isinstance(node, ast.ImportFrom) and any(a.name == "Config" for a in node.names):
            found.append(f"{node.lineno}: imports Config")
    return found


def test_no_module_of_the_step_path_reads_the_config():
    reads = {name: config_reads(SRC / name) for name in STEP_PATH}
    assert {name: lines for name, lines in reads.items() if lines} == {}


def test_the_loops_inner_parts_read_no_config():
    assert config_reads(SRC / "train" / "loop.py", LOOP_INNER) == []


def test_the_scan_finds_each_kind_of_config_read(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from grpolab.config import Config\n"
        "def f(run, cfg):\n"
        "    return run.cfg.batch.num_generations + cfg.seed\n"
    )
    assert sorted(config_reads(probe)) == [
        "1: imports Config",
        "2: parameter cfg",
        "3: .cfg",
        "3: cfg",
    ]
