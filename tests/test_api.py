"""The Python API: TRL's names onto grpolab's config, TRL's reward call, grpolab's own trainer
(preflight included) underneath, and examples/python_api.py as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpolab import GRPOConfig, GRPOTrainer
from grpolab.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


def rows(n: int, start: int = 10) -> list[dict]:
    return [
        {"prompt": f"{a}+11=", "answer": str(a + 11), "parity": a % 2}
        for a in range(start, start + n)
    ]


def test_trl_names_land_on_grpolab_keys():
    cfg = GRPOTrainer(
        args=GRPOConfig(
            learning_rate=1e-5,
            num_generations=4,
            epsilon=0.1,
            beta=0.04,
            loss_type="dapo",
            max_completion_length=12,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
            max_steps=7,
            seed=3,
            scale_rewards=False,
            output_dir="somewhere",
            **{"objective.kl_estimator": "k1", "task.num_eval": 20},
        )
    ).config
    o, b = cfg.objective, cfg.batch
    assert (cfg.optim.learning_rate, b.num_generations, o.epsilon, o.beta) == (1e-5, 4, 0.1, 0.04)
    assert o.loss_type == "dapo" and o.scale_rewards == "none" and o.kl_estimator == "k1"
    # 8 completions per micro-batch x 2 accumulated = 16 per step = 4 prompts x G=4
    assert (b.generation_batch_size, b.prompts_per_step) == (16, 4)
    assert b.gradient_accumulation_steps == 2
    assert (cfg.rollout.max_completion_length, cfg.max_steps, cfg.seed) == (12, 7, 3)
    assert (cfg.output_dir, cfg.task.num_eval) == ("somewhere", 20)


def test_an_unknown_or_unsupported_name_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"GRPOConfig\(learnin_rate=\.\.\.\)"):
        GRPOConfig(learnin_rate=1e-5)
    with pytest.raises(ConfigError, match=r"num_train_epochs.*max_steps"):
        GRPOConfig(num_train_epochs=3)
    with pytest.raises(ConfigError, match=r"trainer\.bogus"):
        GRPOConfig(**{"trainer.bogus": 1})
    with pytest.raises(ConfigError, match="processing_class"):
        GRPOTrainer(processing_class=object())


def test_trl_reward_call_runs_the_real_trainer_and_records_the_function(tmp_path):
    calls = []

    # TRL's order: prompts first, completions second, dataset columns as keyword arguments.
    def parity_aware(prompts, completions, answer, parity, completion_ids, **kwargs):
        calls.append((len(prompts), set(parity), len(completion_ids)))
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    out = tmp_path / "run"
    trainer = GRPOTrainer(
        model="demo",
        reward_funcs=parity_aware,
        args={"output_dir": str(out), "max_steps": 1, "per_device_train_batch_size": 16,
              "num_generations": 4, "eval_steps": 0, "eval.eval_examples": 8},
        train_dataset=rows(40),
        eval_dataset=rows(8, start=70),
    )  # fmt: skip
    summary = trainer.train()
    assert summary["steps"] == 1 and summary["eval_examples"] == 8
    # the preflight ran (its record is in the run directory) and every check passed
    preflight = json.loads((out / "preflight.json").read_text())
    assert preflight["passed"] and all(c["passed"] for c in preflight["checks"])
    # each call saw one value per completion of every column
    assert calls and all(n == ids and parity <= {0, 1} for n, parity, ids in calls)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["rewards"]["functions"] == [
        f"{__name__}:test_trl_reward_call_runs_the_real_trainer_and_records_the_function."
        "<locals>.parity_aware"
    ]
    assert saved["task"]["name"] == "jsonl" and saved["task"]["eval_path"].endswith("eval.jsonl")


@pytest.mark.slow
def test_the_example_script_runs_as_written(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "python_api.py"), "--steps", "1",
         "--output-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "preflight: all" in done.stdout
    assert "held-out accuracy" in done.stdout.splitlines()[-1]


def test_a_datasets_dataset_is_read_as_its_rows():
    datasets = pytest.importorskip("datasets")
    from grpolab.tasks import load_task

    trainer = GRPOTrainer(
        train_dataset=datasets.Dataset.from_list(rows(30)),
        args=GRPOConfig(**{"task.eval_fraction": 0.2}),
    )
    task = load_task(trainer.config.task)
    assert (len(task.train), len(task.eval)) == (24, 6)
    assert all(e.columns["parity"] in (0, 1) for e in task.train + task.eval)


def test_logging_steps_is_the_console_lines_interval():
    from grpolab import GRPOConfig

    assert "logging.logging_steps=5" in GRPOConfig(logging_steps=5).overrides()
    with pytest.raises(ConfigError, match=r"logging\.logging_steps"):
        load_config(None, ["logging.logging_steps=0"])
