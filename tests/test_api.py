"""The Python API: TRL's names onto grpolab's config, TRL's reward call, grpolab's own trainer
(preflight included) underneath, and examples/python_api.py as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

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
    with pytest.raises(ConfigError, match=r"GRPOConfig\(learnin_rate=\.\.\.\).*learning_rate\?"):
        GRPOConfig(learnin_rate=1e-5)
    with pytest.raises(ConfigError, match=r"repetition_penalty=1\.2.*distribution"):
        GRPOConfig(repetition_penalty=1.2)
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
    # the rows stayed in memory: config.yaml says where they came from, and that they are not
    # on disk (no file was written for them)
    task = saved["task"]
    assert task["name"] == "jsonl" and task["path"] is None and task["eval_path"] is None
    assert task["rows"].startswith("(40 rows given in Python as train_dataset, sha256 ")
    assert task["eval_rows"].startswith("(8 rows given in Python as eval_dataset, sha256 ")


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

    assert GRPOConfig(logging_steps=5).values == {"logging.logging_steps": 5}
    with pytest.raises(ConfigError, match=r"logging\.logging_steps"):
        load_config(None, ["logging.logging_steps=0"])


# --- What a TRL script reads: callbacks, state, evaluate, save_model ----------------------------


class Recorder(TrainerCallback):
    """Every event a TrainerCallback gets, with what it was given."""

    def __init__(self, stop_at: int | None = None):
        self.events, self.stop_at = [], stop_at

    def on_init_end(self, args, state, control, **kwargs):
        self.events.append(("init_end",))

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.events.append(("train_begin", state.max_steps, type(optimizer).__name__))
        self.model, self.tokenizer = model, kwargs["processing_class"]

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step))
        if state.global_step == self.stop_at:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", state.global_step, "reward" in logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(("evaluate", state.global_step, sorted(metrics)))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.events.append(("train_end", state.global_step, model is self.model))


def exact(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


TRL_STEP_KEYS = {"reward", "reward_std", "kl", "entropy", "clip_ratio/low_mean",
                 "clip_ratio/high_mean", "clip_ratio/region_mean", "completions/mean_length",
                 "frac_reward_zero_std", "rewards/exact/mean", "rewards/exact/std", "loss",
                 "learning_rate", "grad_norm", "step", "epoch"}  # fmt: skip


@pytest.mark.slow
def test_callbacks_state_evaluate_and_save_model_as_trl_scripts_use_them(tmp_path):
    out = tmp_path / "run"
    recorder = Recorder()
    args = GRPOConfig(output_dir=str(out), max_steps=4, per_device_train_batch_size=32,
                      num_generations=4, logging_steps=2, save_steps=2, eval_steps=2, beta=0.04,
                      learning_rate=1e-3)  # fmt: skip
    trainer = GRPOTrainer(model="demo", reward_funcs=exact, args=args, train_dataset=rows(40),
                          eval_dataset=rows(8, start=70), callbacks=[recorder])  # fmt: skip
    summary = trainer.train()
    assert (summary.global_step, summary["steps"]) == (4, 4)
    # transformers' events, in transformers' order, with its arguments
    held_out = ["eval_accuracy", "eval_strict_accuracy"]
    assert recorder.events == [
        ("init_end",), ("train_begin", 4, "AdamW"), ("step_end", 1), ("step_end", 2),
        ("log", 2, True), ("log", 2, False), ("evaluate", 2, held_out), ("save", 2),
        ("step_end", 3), ("step_end", 4), ("log", 4, True), ("save", 4), ("train_end", 4, True),
    ]  # fmt: skip
    # log_history: one entry per logged step in TRL's names, the mean of its steps
    logged = [e for e in trainer.state.log_history if "reward" in e]
    assert [e["step"] for e in logged] == [2, 4]
    assert all(set(e) >= TRL_STEP_KEYS for e in logged)
    per_step = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for entry, (a, b) in zip(logged, [(0, 1), (2, 3)], strict=True):
        for trl, ours in (("reward", "reward/mean"), ("kl", "kl"), ("loss", "loss"),
                          ("clip_ratio/region_mean", "clip_frac")):  # fmt: skip
            assert entry[trl] == pytest.approx((per_step[a][ours] + per_step[b][ours]) / 2)
        assert entry["learning_rate"] == per_step[b]["lr"]
        assert entry["grad_norm"] == per_step[b]["grad_norm"]
    assert trainer.state.log_history[-1]["train_loss"] == pytest.approx(
        sum(s["loss"] for s in per_step) / 4
    )
    # the trained model is the trainer's, and what the last checkpoint holds
    assert recorder.model is trainer.model and recorder.tokenizer is trainer.processing_class
    trained = trainer.model.state_dict()
    final = load_file(str(out / "checkpoint-4" / "model.safetensors"))
    assert all(torch.equal(v, trained[k]) for k, v in final.items())

    metrics = trainer.evaluate()
    assert {"eval_reward", "eval_reward_std", "eval_rewards/exact/mean", "eval_accuracy",
            "eval_completions/mean_length", "eval_frac_reward_zero_std",
            "eval_runtime"} <= set(metrics)  # fmt: skip
    # the same greedy evaluation of the same model as the trainer's after training
    assert metrics["eval_accuracy"] == summary["accuracy_after"]
    assert trainer.state.log_history[-1]["eval_reward"] == metrics["eval_reward"]
    assert recorder.events[-1][:2] == ("evaluate", 4)
    other = trainer.evaluate(eval_dataset=rows(4, start=80), metric_key_prefix="test")
    assert "test_reward" in other and "eval_reward" not in other

    trainer.save_model(tmp_path / "saved")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert all(torch.equal(v, trained[k]) for k, v in saved.state_dict().items())
    encode = {"return_tensors": "pt", "add_special_tokens": False}
    ids = tokenizer("71+11=", **encode).input_ids
    assert ids.tolist() == trainer.processing_class("71+11=", **encode).input_ids.tolist()
    with torch.no_grad():
        ours = saved.generate(ids, max_new_tokens=4, do_sample=False)
        theirs = trainer.model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(ours, theirs) and ours.shape[1] > ids.shape[1]


@pytest.mark.slow
def test_a_callback_ends_training_early_and_a_python_resume_goes_on(tmp_path):
    out = tmp_path / "run"
    args = {"output_dir": str(out), "max_steps": 4, "per_device_train_batch_size": 16,
            "num_generations": 4, "eval.eval_examples": 0}  # fmt: skip
    trainer = GRPOTrainer(reward_funcs=exact, args=args, train_dataset=rows(40),
                          callbacks=[Recorder(stop_at=2)])  # fmt: skip
    summary = trainer.train()
    assert summary["steps"] == 2 and summary["checkpoint"].endswith("checkpoint-2")
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    # the same script resumed: the rows given again are the same rows (config.yaml's line)
    again = GRPOTrainer(reward_funcs=exact, args=args, train_dataset=rows(40))
    assert again.train(resume_from_checkpoint=True)["steps"] == 4
    changed = GRPOTrainer(reward_funcs=exact, args=args, train_dataset=rows(40, start=11))
    with pytest.raises(ValueError, match=r"task\.rows"):
        changed.train(resume_from_checkpoint=True)
