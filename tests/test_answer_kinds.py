"""The whole chain on tasks of words and of option letters, with a real tiny model that has
learned to answer them: the strict check, the accuracy reward, the reward probes, the held-out
evaluation and the reward-vs-strict monitor all judge the task's answer kind, and an honest
reward keeps the gap at exactly 0 where the model is right in many writings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpolab.checks.rewards import PROBES, check_reward_probes, check_tokenizer_coverage
from grpolab.commands.report import write_report
from grpolab.commands.warmup import sft_batch
from grpolab.config import load_config
from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model, save_policy
from grpolab.rewards import load_rewards
from grpolab.rewards.probes import probe_task
from grpolab.rollout.hf import HFEngine
from grpolab.tasks import Example, TaskConfig, load_task
from grpolab.train.evaluate import accuracy_rewards, evaluate_greedy, strict_correct
from grpolab.train.loop import train

FIXTURES = Path(__file__).parent / "data"
TASKS = {
    "string": TaskConfig(name="jsonl", path=str(FIXTURES / "capitals.jsonl"), num_eval=8),
    "choice": TaskConfig(name="jsonl", path=str(FIXTURES / "choice.jsonl"), num_eval=6),
}
# How the model is taught to write each answer, row by row: the judges must read them all.
WRITINGS = {
    "string": ("{}", "The answer is {}.", "{}.", "**{}**", "answer: {}"),
    "choice": ("{}", "The answer is ({}).", "{})", "**{}**", "Answer: {}"),
}
SPEC = TinyModelSpec(hidden_size=64, num_heads=2, num_layers=2, max_position_embeddings=160)
# SFT steps: right greedily (97-100% of the training rows) yet unsure enough at T = 1 that
# many groups vary (15 and 9 of 16 here), so the preflight and training have something to do.
SFT_STEPS = {"string": 90, "choice": 60}


def memorised(kind: str, steps: int) -> tuple[torch.nn.Module, object, list[Example]]:
    """A tiny printable-character model trained by SFT on the task's training rows, each answer
    in one of WRITINGS[kind]; and those rows as they were taught."""
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, SPEC, seed=0)
    task = load_task(TASKS[kind])
    taught = [
        Example(e.prompt, WRITINGS[kind][i % len(WRITINGS[kind])].format(e.answer))
        for i, e in enumerate(task.train)
    ]
    input_ids, labels = sft_batch(tokenizer, taught)
    attention_mask = (input_ids != tokenizer.pad_token_id).long()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval(), tokenizer, taught


# The option letters' SFT runs on long prompts: tens of seconds, the slow lane's.
@pytest.fixture(scope="module", params=[pytest.param("choice", marks=pytest.mark.slow), "string"])
def learned(request):
    kind = request.param
    model, tokenizer, taught = memorised(kind, SFT_STEPS[kind])
    return kind, load_task(TASKS[kind]), model, tokenizer, taught


def test_the_model_answers_in_many_writings_and_every_judge_agrees(learned):
    kind, task, model, tokenizer, taught = learned
    assert task.answer_kind == kind
    assert check_tokenizer_coverage(task, tokenizer).passed
    accuracy = accuracy_rewards(None, task)
    engine = HFEngine(model, tokenizer)
    # Greedy on the rows it learned: right in each of the writings it was taught.
    held = evaluate_greedy(engine, task.train, accuracy, 32, answer_kind=task.answer_kind)
    assert held.accuracy >= 80 and held.strict_accuracy == held.accuracy
    rollout = engine.generate([e.prompt for e in task.train], 1, _greedy())
    written = {c.strip() for c in rollout.completions}
    assert {e.answer for e in taught} & written and len(written - {e.answer for e in task.train})
    # Judged as numbers (the old strict check), the very same answers are all wrong.
    answers = [e.answer for e in task.train]
    assert not strict_correct(rollout.completions, answers).any()
    assert strict_correct(rollout.completions, answers, kind).float().mean() * 100 == held.accuracy


def test_the_probes_ask_the_accuracy_every_question(learned):
    _, task, _, tokenizer, _ = learned
    report = probe_task(task, load_rewards(["accuracy", "format"], task=task), tokenizer)
    results = {r.id: r for r in check_reward_probes(report)}
    assert set(results) == {d.check.id for d in PROBES}
    assert all(r.passed for r in results.values()), [r.what for r in results.values()]
    # The total's scale: a boxed wrong answer earns the format reward, 1; a boxed right one, 2.
    assert report.answer_checking() == ["accuracy"] and report.reward_scale() == (1.0, 2.0)


def test_training_keeps_the_reward_strict_gap_at_zero(learned, tmp_path):
    kind, _, model, tokenizer, _ = learned
    save_policy(model, tokenizer, tmp_path / "model")
    cfg = TASKS[kind]
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"output_dir={run_dir}",
            f"model.name_or_path={tmp_path / 'model'}",
            "task.name=jsonl",
            f"task.path={cfg.path}",
            f"task.num_eval={cfg.num_eval}",
            "max_steps=2",
            "batch.prompts_per_step=4",
            "batch.num_generations=4",
            "eval.eval_examples=0",
            "logging.log_completions_steps=1",
            "rollout.max_completion_length=32",
        ],
    )
    train(cfg)  # the preflight passes on it: tokenizer.coverage and the probes included
    assert json.loads((run_dir / "preflight.json").read_text())["passed"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and sum(r["accuracy"] for r in rows) > 0  # right at T = 1, often
    for row in rows:
        assert row["strict_accuracy"] == row["accuracy"]
        assert row["monitor/accuracy_strict_gap"] == 0.0
        assert row["monitor/reward_strict_gap"] == 0.0
        assert "warnings" not in row
    # The report's strict verdicts judge the same kind: a right completion is "yes".
    report = write_report(run_dir).read_text()
    logged = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert any(r["reward"] == 1 for r in logged) and "| 1 | yes |" in report


def _greedy():
    from grpolab.rollout.base import SamplingParams

    return SamplingParams(temperature=0.0, max_completion_length=32)
