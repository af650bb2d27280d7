"""tokenizer.coverage: a task whose prompts or answers the tokenizer cannot write fails, naming
the rows and the characters; `grpolab rollout` shows what the model reads instead."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from tokenizers import normalizers

from grpolab.checks.registry import HINTS
from grpolab.checks.rewards import check_tokenizer_coverage
from grpolab.commands.rollout import run_rollout
from grpolab.model.policy import build_char_tokenizer
from grpolab.tasks import SAMPLE_GSM8K, TaskConfig, load_task
from grpolab.tasks.coverage import round_trip

FIXTURES = Path(__file__).parent / "data"
CAPITALS = TaskConfig(name="jsonl", path=str(FIXTURES / "capitals.jsonl"), num_eval=10)
CHOICE = TaskConfig(name="jsonl", path=str(FIXTURES / "choice.jsonl"), num_eval=6)


def test_the_demo_model_cannot_write_a_task_of_words(demo_tokenizer):
    assert len(demo_tokenizer) == 18  # the demo's own: 18 symbols, digits and arithmetic
    task = load_task(CAPITALS)
    result = check_tokenizer_coverage(task, demo_tokenizer)
    assert not result.passed and result.measured == 40 and result.expected == "0 of 40"
    assert result.hint == HINTS["tokenizer.coverage"] and "<unk>" in result.hint
    index, first = 0, task.train[0]
    # The rows and the characters are named, with what the model reads instead.
    assert f"train row {index}'s prompt {first.prompt!r} is read as '<unk><unk>" in result.what
    assert f"and its answer {first.answer!r} as '<unk>" in result.what
    assert "then train row 1, train row 2 (and 37 more)" in result.what
    # Every letter of the task and its '?', the most frequent first.
    letters = {c for e in task.train + task.eval for c in e.prompt + e.answer if c.isalpha()}
    assert f"it cannot write {len(letters) + 1} characters: 'a', " in result.what


def test_the_demo_model_writes_its_own_task_and_a_printable_tokenizer_writes_words(
    demo_tokenizer,
):
    assert check_tokenizer_coverage(load_task(), demo_tokenizer).passed
    ascii_tokenizer = build_char_tokenizer()
    for cfg in (CAPITALS, CHOICE, TaskConfig(name="gsm8k", path=str(SAMPLE_GSM8K))):
        result = check_tokenizer_coverage(load_task(cfg), ascii_tokenizer)
        assert result.passed and result.measured == 0, result.what
    assert not check_tokenizer_coverage(load_task(CHOICE), demo_tokenizer).passed


def test_a_character_lost_without_an_unknown_token_fails(tmp_path):
    # A tokenizer that strips accents: "Bogotá" comes back as "Bogota", no <unk> anywhere.
    path = tmp_path / "accents.jsonl"
    rows = [("Colombia", "Bogotá"), ("Peru", "Lima"), ("Chile", "Santiago"), ("Cuba", "Havana")]
    path.write_text("".join(json.dumps({"prompt": f"Capital of {c}?", "answer": a}) + "\n"
                            for c, a in rows))  # fmt: skip
    tokenizer = build_char_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFD(), normalizers.StripAccents()]
    )
    task = load_task(TaskConfig(name="jsonl", path=str(path), num_eval=0))
    result = check_tokenizer_coverage(task, tokenizer)
    assert not result.passed and result.measured == 1
    assert "it cannot write 1 character: 'á'" in result.what and "<unk> token" not in result.what
    assert "train row 0's answer 'Bogotá' is read as 'Bogota'" in result.what


def test_the_system_prompt_and_a_spelt_unknown_token(demo_tokenizer):
    task = load_task()
    result = check_tokenizer_coverage(task, demo_tokenizer, system_prompt="Add the numbers.")
    assert not result.passed and result.measured == 1
    assert "task.system_prompt's system prompt 'Add the numbers.' is read as" in result.what
    # A text that spells the unknown token is not an unknown character.
    (trip,) = round_trip(build_char_tokenizer(), ["a <unk> b"]).values()
    assert trip.ok and trip.unknown == 0


def test_rollout_shows_what_the_model_reads(tmp_path):
    overrides = [
        f"task.path={CAPITALS.path}",
        "task.name=jsonl",
        "batch.num_generations=2",
        "rollout.max_completion_length=2",
    ]
    console = Console(file=open(tmp_path / "log.txt", "w"))  # noqa: SIM115
    report = run_rollout(None, overrides, 1, console)
    (warn_prompts, warn_answers) = report["warnings"]
    sample = report["samples"][0]
    assert sample["prompt"].startswith("What is the capital of")  # the task's text, and
    assert sample["prompt_read"].startswith("<unk><unk><unk><unk> <unk><unk>")  # what is read
    assert warn_prompts.startswith("the tokenizer cannot write ") and "'W'" in warn_prompts
    assert "the prompt column shows what the model reads" in warn_prompts
    assert "the model can never write these answers" in warn_answers
    # The demo's own task: nothing to say.
    report = run_rollout(None, overrides[2:], 1, console)
    assert report["warnings"] == [] and "prompt_read" not in report["samples"][0]
