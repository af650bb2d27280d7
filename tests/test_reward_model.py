"""Reward models: a sequence-classification model named in rewards.functions (a directory or a
hub id) or handed over loaded scores completions in-process, through the same accounting and
probes as any reward function. The models are tiny, built here, real transformers models."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from grpolab.checks.rewards import check_reward_probes
from grpolab.model.policy import build_char_tokenizer, build_tiny_model, save_policy
from grpolab.rewards import RewardModel, RewardsConfig, load_rewards, score
from grpolab.rewards.probes import run_probes
from grpolab.tasks.base import Example

ROOT = Path(__file__).resolve().parents[1]


def tiny_reward_model(seed: int = 0) -> tuple[LlamaForSequenceClassification, object]:
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(config).eval(), tokenizer


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    model, tokenizer = tiny_reward_model()
    path = tmp_path_factory.mktemp("rm") / "tiny-rm"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


ROWS = [Example(f"{a}+{b}=", str(a + b)) for a, b in ((5, 7), (12, 30), (8, 9), (40, 2))]
COMPLETIONS = ["12", "13", "a much longer completion than the others", "", "42", "7", "17", "x"]


def test_a_directory_in_rewards_functions_is_a_reward_model(rm_dir):
    rewards = load_rewards(["accuracy", str(rm_dir)])
    assert [fn.name for fn in rewards] == ["accuracy", "tiny-rm"]
    assert rewards[1].learned and not rewards[0].learned
    assert isinstance(rewards[1].fn, RewardModel)


def test_batched_scores_are_each_texts_own_logit(rm_dir):
    """Padding a batch changes no score: each equals the model's logit on its text alone,
    prompt then completion (this tokenizer has no chat template)."""
    rm = RewardModel(str(rm_dir), batch_size=3)
    prompts = [ROWS[i // 2].prompt for i in range(len(COMPLETIONS))]
    values = rm(prompts=prompts, completions=COMPLETIONS)
    model, tokenizer = tiny_reward_model()
    model = model.double()
    for value, prompt, completion in zip(values, prompts, COMPLETIONS, strict=True):
        ids = tokenizer(prompt + completion, return_tensors="pt")["input_ids"]
        alone = model(input_ids=ids).logits[0, 0].item()
        # float32 against float64 over one small layer: rounding of O(1) sums, far below 1e-4
        assert value == pytest.approx(alone, abs=1e-4 * max(1.0, abs(alone)))
    assert len(set(values)) > 1  # the completions are told apart


def test_a_chat_template_renders_the_conversation(rm_dir):
    model, tokenizer = tiny_reward_model()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    )
    rm = RewardModel(model, tokenizer=tokenizer)
    assert rm.texts(["5+7="], ["12"]) == ["<user>5+7=<assistant>12"]
    conversation = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert rm.texts([conversation], [[{"role": "assistant", "content": "a"}]]) == [
        "<system>s<user>q<assistant>a"
    ]


def test_a_loaded_model_is_a_reward_and_recorded_by_name(rm_dir):
    model, _ = tiny_reward_model()
    model.name_or_path = str(rm_dir)
    rewards = load_rewards([model])
    assert rewards[0].name == "tiny-rm" and rewards[0].learned
    result = score(COMPLETIONS[:4], ROWS[:1], rewards, num_generations=4)
    assert torch.isfinite(result.per_function["tiny-rm"]).all()


def test_what_is_not_a_reward_model_is_named(tmp_path):
    tokenizer = build_char_tokenizer()
    save_policy(build_tiny_model(tokenizer), tokenizer, tmp_path / "lm")
    with pytest.raises(ValueError, match="LlamaForCausalLM, not a reward model"):
        load_rewards([str(tmp_path / "lm")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_rewards([str(tmp_path / "empty")])
    with pytest.raises(ValueError, match=re.escape("unknown reward './nowhere'")):
        load_rewards(["./nowhere"])
    with pytest.raises(ValueError, match=r"LlamaForCausalLM is not a reward model"):
        RewardModel(build_tiny_model(tokenizer), tokenizer=tokenizer)


def test_a_reward_model_past_its_timeout_is_counted_not_fatal(rm_dir):
    rewards = load_rewards(RewardsConfig(functions=[str(rm_dir)], timeout=1e-9, fallback=-1.0))
    result = score(COMPLETIONS, ROWS[:2], rewards, num_generations=4)
    assert result.errors["tiny-rm"] == len(COMPLETIONS)
    assert result.per_function["tiny-rm"].tolist() == [-1.0] * len(COMPLETIONS)
    assert "timed out" in result.error_texts["tiny-rm"]


def test_the_probes_report_a_reward_model_and_hold_it_to_no_demand(rm_dir):
    """The same scores from a plain function fail the probes (this random model prefers a
    wrong answer on some row), so it is the learned exemption that passes them; the model's
    ranking is in the check's line."""
    rows = [(i, Example(f"What is {a} + {b}?", str(a + b))) for i, (a, b) in
            enumerate(((31, 4), (7, 60), (18, 18), (52, 9), (3, 3), (70, 11)))]  # fmt: skip
    learned = load_rewards([str(rm_dir)])
    report = run_probes(rows, learned, kind="number")
    right, compared = report.preferences("tiny-rm")
    assert compared == len(rows) and right < compared  # it misranks some row
    results = list(check_reward_probes(report))
    assert all(r.passed for r in results), [r.what for r in results if not r.passed]
    assert f"tiny-rm prefers the reference to a wrong answer on {right} of {compared}" in (
        results[0].what
    )
    assert report.reward_scale() is None  # a learned scale is no rule for the monitors

    rm = learned[0].fn

    def same_scores(prompts, completions, **_):
        return rm(prompts=prompts, completions=completions)

    ruled = run_probes(rows, load_rewards([same_scores]), kind="number")
    assert not all(r.passed for r in check_reward_probes(ruled))


def test_a_reward_model_on_the_probes_that_fails_is_a_failed_check(rm_dir):
    rewards = load_rewards(RewardsConfig(functions=[str(rm_dir)], timeout=1e-9))
    report = run_probes([(0, ROWS[0])], rewards, kind="number")
    first = next(iter(check_reward_probes(report)))
    assert first.id == "rewards.reference" and not first.passed
    assert "tiny-rm" in first.what and "timed out" in first.what


@pytest.mark.slow
def test_the_cli_trains_on_a_reward_model(rm_dir, tmp_path):
    """`grpolab train rewards.functions=[accuracy, DIR]`: the preflight passes on a random
    reward model, its reward is logged every step, the run directory names the model."""
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "grpolab", "train", f"rewards.functions=[accuracy,{rm_dir}]",
         "max_steps=2", f"output_dir={out}", "eval.eval_steps=0"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "all 3" in done.stdout or "checks pass" in done.stdout
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "rewards/tiny-rm/mean" in s]
    assert len(steps) == 2 and all(s["reward_errors/tiny-rm"] == 0 for s in steps)
    assert str(rm_dir) in (out / "config.yaml").read_text()


def test_the_api_takes_a_reward_model(rm_dir, tmp_path):
    from grpolab import GRPOConfig, GRPOTrainer

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 30) for b in (1, 2)]
    args = GRPOConfig(output_dir=str(tmp_path / "api"), max_steps=1, num_generations=4,
                      per_device_train_batch_size=16, max_completion_length=4,
                      **{"task.eval_fraction": 0.1, "eval.eval_steps": 0})  # fmt: skip
    trainer = GRPOTrainer(model="demo", reward_funcs=["accuracy", str(rm_dir)], args=args,
                          train_dataset=rows)  # fmt: skip
    summary = trainer.train(overwrite=True, skip_preflight=True)  # the preflight: the CLI's
    assert summary["steps"] == 1
    logged = (tmp_path / "api" / "metrics.jsonl").read_text()
    assert "rewards/tiny-rm/mean" in logged


def test_the_api_takes_a_loaded_reward_model(rm_dir, tmp_path):
    """TRL's reward_funcs=[model]: scored in-process, logged by its name_or_path's last part,
    recorded in config.yaml by its name_or_path."""
    from grpolab import GRPOConfig, GRPOTrainer

    model, _ = tiny_reward_model()
    model.name_or_path = str(rm_dir)
    args = GRPOConfig(output_dir=str(tmp_path / "api"), max_steps=1, num_generations=4,
                      per_device_train_batch_size=16, max_completion_length=4,
                      **{"eval.eval_steps": 0})  # fmt: skip
    trainer = GRPOTrainer(model="demo", reward_funcs=["accuracy", model], args=args)
    assert isinstance(trainer.config.rewards.functions[1], RewardModel)
    trainer.train(overwrite=True, skip_preflight=True)
    assert "rewards/tiny-rm/mean" in (tmp_path / "api" / "metrics.jsonl").read_text()
    assert str(rm_dir) in (tmp_path / "api" / "config.yaml").read_text()


def test_reward_processing_classes_give_a_loaded_reward_model_its_tokenizer():
    """TRL's reward_processing_classes: one per reward, the tokenizer a reward model scores
    with; a function reads text, so a tokenizer given for one is refused, named."""
    from grpolab import GRPOConfig, GRPOTrainer
    from grpolab.config import ConfigError

    model, tokenizer = tiny_reward_model()
    tokenizer.model_max_length = 77  # what tells the given tokenizer from any other
    args = GRPOConfig(max_steps=1)
    trainer = GRPOTrainer(reward_funcs=["accuracy", model], args=args,
                          reward_processing_classes=[None, tokenizer])  # fmt: skip
    scorer = trainer.config.rewards.functions[1]
    assert isinstance(scorer, RewardModel) and scorer.tokenizer is tokenizer
    with pytest.raises(ConfigError, match=r"reward_processing_classes\[0\]: reward_funcs\[0\] is "
                                          r"a function"):  # fmt: skip
        GRPOTrainer(reward_funcs=[len, model], args=args,
                    reward_processing_classes=[tokenizer, None])  # fmt: skip
    with pytest.raises(ConfigError, match=r"1 given for 2 reward_funcs"):
        GRPOTrainer(reward_funcs=["accuracy", model], args=args,
                    reward_processing_classes=[tokenizer])  # fmt: skip
