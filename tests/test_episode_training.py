"""Training on multi-turn episodes with a tool, end to end on the tool example's tiny model:
the preflight's episode checks pass, a run resumed in the middle is the straight run bit for
bit, and `grpolab rollout --json` shows the turns."""

import json
from pathlib import Path

import pytest
from finished_runs import assert_resumed_is_straight, metric_rows

from grpolab.checks.episodes import EPISODE_IDS
from grpolab.commands.cli import main
from grpolab.config import load_config
from grpolab.train.loop import train

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tool-calculator.yaml"
CALCULATOR = f"rollout.tools=[{ROOT / 'examples' / 'calculator.py'}:calculator]"
SMALL = [
    CALCULATOR,
    "batch.prompts_per_step=2",
    "batch.num_generations=8",
    "eval.eval_examples=0",
    "logging.progress=false",
    "logging.log_completions_steps=1",
]


def config(tmp_path, *extra: str, name: str):
    return load_config(str(EXAMPLE), [f"output_dir={tmp_path / name}", *SMALL, *extra])


@pytest.mark.slow  # three training runs and a preflight
def test_a_multi_turn_run_resumed_in_the_middle_is_the_straight_run(tmp_path):
    train(config(tmp_path, "max_steps=3", name="straight"))
    preflight = json.loads((tmp_path / "straight" / "preflight.json").read_text())
    checks = {c["id"]: c for c in preflight["checks"]}
    assert all(checks[i]["passed"] for i in EPISODE_IDS), [checks[i] for i in EPISODE_IDS]
    rows = metric_rows(tmp_path / "straight")
    assert any(r["episode/tool_calls"] > 0 for r in rows)  # the episodes had tool turns
    assert all(r["episode/turns_max"] <= 3 for r in rows)  # max_turns=2: call, result, answer
    logged = [json.loads(line) for line in (tmp_path / "straight" / "completions.jsonl").open()]
    turns = [t for row in logged for s in row.get("samples", [row]) for t in s.get("turns", [])]
    assert {t["role"] for t in turns} >= {"assistant"}

    assert_resumed_is_straight(config, tmp_path, stop_at=2, steps=3)


def test_rollout_json_shows_the_turns(capsys):
    rc = main(["rollout", "--config", str(EXAMPLE), "--json", "--n-prompts", "2", CALCULATOR])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    samples = report["samples"]
    assert all(s["turns"] and s["turns"][0]["role"] == "assistant" for s in samples)
    for s in samples:
        for turn in s["turns"]:
            assert turn["role"] in ("assistant", "tool")
            assert turn["trained"] == (turn["role"] == "assistant")
            assert isinstance(turn["text"], str)
        assert s["completion"] == [t for t in s["turns"] if t["trained"]][-1]["text"]
    assert "episode/tool_calls" in report["metrics"]


def test_the_example_model_calls_the_calculator_with_the_exact_layout():
    import torch

    from grpolab.train.setup import load_start_model, task_engine

    cfg = load_config(str(EXAMPLE), [CALCULATOR])
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    engine = task_engine(cfg, model, tokenizer)
    params = cfg.rollout.sampling(seed=0)
    params.temperature = 0.0
    r = engine.generate(["616*927="], 1, params)  # greedy: this one calls the tool
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    call = enc("<tool_call>calculator(616*927)</tool_call>")
    tool = enc("<tool_response>571032</tool_response>")
    answer = [*enc("571032"), tokenizer.eos_token_id]
    P = r.prompt_length
    assert r.input_ids[0, P:].tolist() == call + tool + answer
    assert r.completion_mask[0, P:].tolist() == [1] * len(call) + [0] * len(tool) + [1] * 7
    assert [(t.role, t.end - t.start) for t in r.turns[0]] == [
        ("assistant", len(call)),
        ("tool", len(tool)),
        ("assistant", 7),
    ]
    assert r.turns[0][1].text == "571032" and not r.turns[0][1].error
    assert r.completions == ["571032"] and not r.truncated[0]
