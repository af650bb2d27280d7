"""TRL scripts run whole by grpolab, each as a user runs it (a process of its own), written for
TRL with only the import changed (and a model and dataset that need no download): TRL's own
GRPO quickstart, and two scripts in TRL's documented style (examples/trl_*.py). What each
trained is checked in its run directory, and what it saved loads with transformers."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.slow


def run_script(name: str, cwd: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def only_the_import_differs_from_trl(name: str) -> None:
    """The script imports grpolab where TRL's imports trl, and nothing else of grpolab."""
    text = (EXAMPLES / name).read_text()
    grpolab_lines = [line for line in text.splitlines() if "grpolab" in line and "import" in line]
    trl = "from trl import GRPOConfig, GRPOTrainer"
    assert grpolab_lines == [f"{trl.replace('trl', 'grpolab')}  # was: {trl}"]


def loads_and_generates(directory: Path, prompt: str) -> str:
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_trls_quickstart_runs_as_written(tmp_path):
    only_the_import_differs_from_trl("trl_quickstart.py")
    run_script("trl_quickstart.py", tmp_path)
    out = tmp_path / "Qwen2-0.5B-GRPO"  # the script's own output_dir, in its working directory
    summary = json.loads((out / "summary.json").read_text())
    # GRPOConfig(output_dir=...) alone: TRL's 3 epochs of 40 rows, 16 prompts a step
    assert summary["steps"] == 3 * math.ceil(40 / 16)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == summary["steps"]
    assert all(s["rewards/reward_len/mean"] <= 0 for s in steps)  # -|20 - len|
    task = yaml.safe_load((out / "config.yaml").read_text())["task"]
    assert task["rows"].startswith("(40 rows given in Python as train_dataset, sha256 ")


def test_a_script_with_two_rewards_trains_logs_evaluates_and_saves(tmp_path):
    only_the_import_differs_from_trl("trl_multi_reward.py")
    out = tmp_path / "run"
    stdout = run_script("trl_multi_reward.py", tmp_path, str(out))
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    o = cfg["objective"]
    assert (o["beta"], o["loss_type"], o["scale_rewards"]) == (0.04, "dapo", "batch")
    assert cfg["rewards"]["weights"] == [1.0, 0.5] and cfg["runtime"]["precision"] == "bf16"
    assert cfg["eval"]["eval_batch_size"] == 40
    # the reward that returns None for rows it cannot judge: only those rows count in it
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 6
    assert all(0 < s["rewards/digit_count/none_frac"] < 1 for s in steps)
    # log_history (trainer_state.json, save_state): every logging_steps=2, TRL's names
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    logged = [e for e in history if "reward" in e]
    assert [e["step"] for e in logged] == [2, 4, 6]
    for entry in logged:
        assert {
            "reward",
            "reward_std",
            "kl",
            "entropy",
            "clip_ratio/region_mean",
            "completions/mean_length",
            "frac_reward_zero_std",
            "rewards/exact_sum/mean",
            "rewards/digit_count/mean",
            "loss",
            "learning_rate",
            "grad_norm",
        } <= set(entry)
    assert any(e.get("eval_accuracy") is not None and e["step"] == 3 for e in history)
    evaluation = history[-1]
    assert {"eval_reward", "eval_rewards/exact_sum/mean", "eval_rewards/digit_count/mean"} <= set(
        evaluation
    )
    # the callback's view, printed by the script
    assert "callback: training begins, 6 steps" in stdout
    assert "callback: saves at [3, 6], ended with a LlamaForCausalLM" in stdout
    rewards = re.search(r"rewards \[(.*)\]", stdout).group(1).split(", ")
    assert [float(r) for r in rewards] == [round(e["reward"], 3) for e in logged]  # as printed
    # save_model: the trained weights (the last checkpoint's) as a transformers directory
    saved, last = (
        load_file(str(out / "model.safetensors")),
        load_file(str(out / "checkpoint-6" / "model.safetensors")),
    )
    assert saved.keys() == last.keys() and all(torch.equal(saved[k], last[k]) for k in saved)
    assert loads_and_generates(out, "23+45=").strip().isdigit()


def test_a_lora_script_counted_in_epochs_stops_on_its_callback_and_saves_merged(tmp_path):
    only_the_import_differs_from_trl("trl_lora_epochs.py")
    out = tmp_path / "run"
    stdout = run_script("trl_lora_epochs.py", tmp_path, str(out))
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    b = cfg["batch"]
    # 16 a micro-batch x 2 accumulated = 32 an update; 4 micro-batches = 64 a generation
    assert (b["generation_batch_size"], b["mini_batch_size"], b["gradient_accumulation_steps"]) == (
        64,
        32,
        2,
    )
    # 2 epochs of 48 rows, 8 prompts a step: 12 steps; warm-up: 10% of 12 x 2 updates
    assert cfg["max_steps"] == 12 and cfg["schedule"] == {
        "lr_scheduler": "cosine",
        "warmup_steps": 3,
    }
    assert (cfg["eval"]["eval_steps"], cfg["checkpoints"]["save_steps"]) == (6, 6)
    assert cfg["lora"]["r"] == 8 and cfg["runtime"]["gradient_checkpointing"]
    assert (cfg["rollout"]["top_p"], cfg["rollout"]["top_k"]) == (0.95, 10)
    # the callback stopped it after 8 of the 12 steps; the run finished there
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["checkpoint"].endswith("checkpoint-8")
    assert "trained 8 of 12 steps" in stdout
    # save_model: the adapters merged into plain weights, the same as the last checkpoint's
    saved = load_file(str(out / "model.safetensors"))
    last = load_file(str(out / "checkpoint-8" / "model.safetensors"))
    assert not any("lora" in k for k in saved)
    assert saved.keys() == last.keys() and all(torch.equal(saved[k], last[k]) for k in saved)
    assert not (out / "adapter_config.json").exists()
    assert loads_and_generates(out, "71+13=").strip().isdigit()
