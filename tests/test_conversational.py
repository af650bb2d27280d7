"""Conversational prompts (TRL's convention): a row's prompt is a list of {"role", "content"}
messages, rendered through the chat template; reward functions get the messages as `prompts`
and each completion as one assistant message; the built-ins read text."""

import json
import pickle

import pytest

from grpolab.config import load_config, replaced
from grpolab.model.policy import build_char_tokenizer, build_tiny_model, save_policy
from grpolab.rewards import load_rewards, score
from grpolab.rollout.common import render_prompt
from grpolab.tasks import load_task
from grpolab.tasks.base import Example, TaskConfig
from grpolab.tasks.conversation import Conversation
from grpolab.train.loop import train

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CAPITALS = {
    "Spain": "Madrid", "France": "Paris", "Italy": "Rome", "Peru": "Lima",
    "Chile": "Santiago", "Japan": "Tokyo", "Kenya": "Nairobi", "Egypt": "Cairo",
}  # fmt: skip


def conversational_rows() -> list[dict]:
    return [
        {
            "prompt": [
                {"role": "system", "content": "Answer with the city only."},
                {"role": "user", "content": f"What is the capital of {country}?"},
            ],
            "answer": city,
            "country": country,
        }
        for country, city in CAPITALS.items()
    ]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_list_of_messages_is_a_conversation(tmp_path):
    path = write_rows(tmp_path / "rows.jsonl", conversational_rows())
    task = load_task(TaskConfig(name="jsonl", path=str(path), num_eval=2))
    prompt = task.train[0].prompt
    assert isinstance(prompt, Conversation)
    assert prompt.messages[0] == {"role": "system", "content": "Answer with the city only."}
    assert str(prompt).endswith("?") and "Answer with the city only." in prompt
    assert task.answer_kind == "string"
    assert pickle.loads(pickle.dumps(prompt)).messages == prompt.messages


def test_a_bad_message_names_its_row(tmp_path):
    rows = conversational_rows()
    rows[3]["prompt"][1] = {"role": "human", "content": "hi"}
    path = write_rows(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ValueError, match=r"line 4: field 'prompt': message 1 has role 'human'"):
        load_task(TaskConfig(name="jsonl", path=str(path), num_eval=2))
    path = write_rows(tmp_path / "ok.jsonl", conversational_rows())
    with pytest.raises(ValueError, match="applies to text prompts only"):
        load_task(
            TaskConfig(name="jsonl", path=str(path), num_eval=2, prompt_template="Q: {prompt}")
        )


def test_a_conversation_is_rendered_by_the_template_always():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    user_only = Conversation([{"role": "user", "content": "q"}])
    assert render_prompt(tokenizer, user_only) == "<user>q\n<assistant>"
    # the task's system prompt comes first unless the conversation has its own
    assert render_prompt(tokenizer, user_only, True, "s") == "<system>s\n<user>q\n<assistant>"
    own = Conversation([{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}])
    assert render_prompt(tokenizer, own, True, "s") == "<system>mine\n<user>q\n<assistant>"
    with pytest.raises(ValueError, match="no chat_template to render them"):
        render_prompt(build_char_tokenizer(), user_only)


def test_user_rewards_get_messages_and_the_builtins_text():
    seen = {}

    def mine(prompts, completions, **kwargs):
        seen["prompts"], seen["completions"] = prompts, completions
        return [1.0 if c[0]["content"].strip() == "Paris" else 0.0 for c in completions]

    prompt = Conversation([{"role": "user", "content": "What is the capital of France?"}])
    rewards = load_rewards(["accuracy", mine], task=None)
    result = score(["Paris", "Rome"], [Example(prompt, "Paris")], rewards, num_generations=2)
    assert seen["prompts"][0] == [{"role": "user", "content": "What is the capital of France?"}]
    assert seen["completions"] == [[{"role": "assistant", "content": "Paris"}],
                                   [{"role": "assistant", "content": "Rome"}]]  # fmt: skip
    assert result.per_function["mine"].tolist() == [1.0, 0.0]
    assert result.per_function["accuracy"].tolist() == [1.0, 0.0]


def test_training_on_conversations(tmp_path):
    """A chat model (tiny, with a template) trains on conversational rows; the rollout's
    prompts are the template's rendering and every reward call gets messages."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    save_policy(build_tiny_model(tokenizer), tokenizer, tmp_path / "model")
    path = write_rows(tmp_path / "rows.jsonl", conversational_rows())
    calls = []

    def city_letters(prompts, completions, answer, country, **kwargs):
        calls.append((prompts, completions, country))
        return [float(sum(ch in c[0]["content"] for ch in a)) for c, a in
                zip(completions, answer, strict=True)]  # fmt: skip

    cfg = load_config(
        None,
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.name_or_path={tmp_path / 'model'}",
            "task.name=jsonl",
            f"task.path={path}",
            "task.num_eval=2",
            "max_steps=2",
            "batch.prompts_per_step=2",
            "batch.num_generations=4",
            "eval.eval_examples=0",
            "logging.log_completions_steps=1",
            "rollout.max_completion_length=8",
        ],
    )
    cfg = replaced(cfg, {"rewards.functions": ["accuracy", city_letters]})
    train(cfg, skip_preflight=True)
    assert len(calls) >= 2  # the two steps (and the probes that read the reward's scale)
    for prompts, completions, countries in calls:
        assert prompts[0][0] == {"role": "system", "content": "Answer with the city only."}
        assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)
        assert countries[0] in CAPITALS
    logged = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").open()]
    assert any("What is the capital of" in r["prompt"] for r in logged)


def test_a_task_without_references_trains_on_its_rewards(tmp_path):
    """Rows with neither 'answer' nor 'solution': the rewards alone judge. The accuracy reward
    is refused, named; nothing is held out; the preflight passes without the reward probes;
    no accuracy is logged (there is nothing to be right about)."""
    rows = [{"prompt": f"{a}+1=", "target_len": 2} for a in range(10, 60)]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    task = load_task(TaskConfig(name="jsonl", path=str(path)))
    assert not task.has_references and task.eval == [] and len(task.train) == 50
    assert "no reference answers" in task.describe_split()
    with pytest.raises(ValueError, match="'accuracy' reward needs reference answers"):
        load_rewards(["accuracy"], task=task)

    def near_two(completions, target_len, **kwargs):
        return [-abs(len(c) - t) for c, t in zip(completions, target_len, strict=True)]

    run = tmp_path / "run"
    cfg = load_config(
        None,
        [f"output_dir={run}", "task.name=jsonl", f"task.path={path}", "max_steps=2"],
    )
    cfg = replaced(cfg, {"rewards.functions": [near_two]})
    summary = train(cfg)  # the preflight runs and passes
    assert summary["steps"] == 2 and summary["accuracy_before"] is None
    assert json.loads((run / "preflight.json").read_text())["passed"]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert all("rewards/near_two/mean" in s and "strict_accuracy" not in s for s in steps)


def test_the_reference_may_be_in_solution(tmp_path):
    rows = [{"prompt": f"{a}+1=", "solution": str(a + 1)} for a in range(10, 30)]
    task = load_task(TaskConfig(name="jsonl", path=str(write_rows(tmp_path / "r.jsonl", rows))))
    assert task.has_references and task.train[0].answer.isdigit()
