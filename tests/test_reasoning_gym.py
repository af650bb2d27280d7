"""task.name=reasoning_gym: real reasoning-gym generators, their score_answer as the gym_score
reward and as the strict judge, the config's errors and inert keys, the preflight on the demo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("reasoning_gym")

from grpolab.config import ConfigError, load_config
from grpolab.config.load import load_warnings
from grpolab.rewards import load_rewards, score
from grpolab.rewards.probes import (
    echo_findings,
    no_answer_findings,
    probe_task,
    reference_findings,
    wrong_findings,
)
from grpolab.tasks import TaskConfig, load_task
from grpolab.tasks.gym import final_answer
from grpolab.train.evaluate import task_strict_correct

SMALL = dict(name="reasoning_gym", num_eval=30, num_train=200)
WEIGHTED = [{"name": "chain_sum", "weight": 3}, {"name": "leg_counting", "weight": 1}]


def gym(**kwargs):
    return load_task(TaskConfig(**(SMALL | kwargs)))


def prompts(rows):
    return [e.prompt for e in rows]


def test_one_generator_deterministic_in_seed_and_disjoint():
    a, b = gym(dataset="chain_sum", seed=3), gym(dataset="chain_sum", seed=3)
    assert prompts(a.train) == prompts(b.train) and prompts(a.eval) == prompts(b.eval)
    assert len(a.eval) == 30 and 190 <= len(a.train) <= 200
    assert not set(prompts(a.train)) & set(prompts(a.eval))
    assert prompts(gym(dataset="chain_sum", seed=4).eval) != prompts(a.eval)
    assert a.answer_kind == "number" and "inferred" in a.answer_kind_reason
    assert all(e.columns["metadata"]["source_dataset"] == "chain_sum" for e in a.train)


def test_weighted_list_draws_each_generator_by_weight():
    task = gym(dataset=WEIGHTED, num_train=400)
    sources = [e.columns["metadata"]["source_dataset"] for e in task.train]
    assert set(sources) == {"chain_sum", "leg_counting"}
    assert sources.count("chain_sum") > 2 * sources.count("leg_counting")
    assert prompts(gym(dataset=WEIGHTED, num_train=400).train) == prompts(task.train)
    assert not set(prompts(task.train)) & set(prompts(task.eval))


def test_parameters_reach_the_generator_and_the_template_fills_metadata():
    task = gym(dataset="chain_sum", dataset_config={"min_terms": 4, "max_terms": 4},
               prompt_template="{expression} =")  # fmt: skip
    for e in task.train[:50]:
        assert e.columns["metadata"]["num_terms"] == 4
        assert e.prompt == e.columns["metadata"]["expression"] + " ="


def test_string_answers_are_inferred_as_strings():
    task = gym(dataset="spell_backward")
    assert task.answer_kind == "string"


def test_gym_score_scores_the_reference_1_and_a_wrong_answer_lower():
    task = gym(dataset=WEIGHTED)
    rewards = load_rewards(["gym_score"], task=task)
    for example in task.train[:20]:
        wrong = str(int(example.answer) + 1)
        texts = [
            f"<answer>{example.answer}</answer>",
            f"Adding up. The answer is {example.answer}.",
            f"<answer>{wrong}</answer>",
            "",
        ]
        values = score(texts, [example] * 4, rewards, num_generations=1).per_function
        right1, right2, wrong_value, empty = values["gym_score"].tolist()
        assert right1 == right2 == 1.0 and wrong_value < 1.0 and empty == 0.0


def test_strict_accuracy_is_judged_by_score_answer():
    task = gym(dataset="chain_sum")
    example = task.train[0]
    assert task.strict_judge is not None
    completions = [f"<answer>{example.answer}</answer>", f"{example.answer}!", "0"]
    # score_answer gives "-157!" partial credit (the reference inside it), not 1: not right.
    hits = task_strict_correct(task, completions, [example] * 3).tolist()
    assert hits == [True, False, example.answer == "0"]


def test_final_answer_reads_the_tags_first():
    assert final_answer("I think 3. <answer> 42 </answer>") == "42"
    assert final_answer("so \\boxed{7}") == "7"
    assert final_answer("The answer is 12.") == "12"
    assert final_answer("  ") is None


def test_the_reward_probes_pass_on_gym_score():
    task = gym(dataset=WEIGHTED)
    report = probe_task(task, load_rewards(["gym_score", "accuracy"], task=task))
    assert set(report.answer_checking()) == {"gym_score", "accuracy"}
    for findings in (reference_findings, wrong_findings, echo_findings, no_answer_findings):
        assert findings(report) == []


def test_gym_score_under_another_task_is_refused():
    with pytest.raises(ValueError, match=r"task\.name=reasoning_gym"):
        load_rewards(["gym_score"], task=load_task(TaskConfig(num_eval=10)))


def test_a_misspelt_generator_is_one_line_naming_task_dataset_with_a_did_you_mean():
    with pytest.raises(ValueError) as e:
        gym(dataset="chain_summ")
    message = str(e.value)
    assert "\n" not in message and "task.dataset='chain_summ'" in message
    assert "did you mean 'chain_sum'?" in message


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(dataset=None), "task.dataset=None: expected a reasoning-gym generator name"),
        (dict(dataset="chain_sum", dataset_config={"terms": 3}),
         "task.dataset_config: chain_sum has no parameter 'terms'"),
        (dict(dataset="chain_sum", dataset_config={"min_terms": 0}),
         "task.dataset_config={'min_terms': 0}: chain_sum refuses it"),
        (dict(dataset=[{"name": "chain_sum", "weight": 0}]),
         "task.dataset[0].weight=0: expected a number > 0"),
        (dict(dataset=["chain_sum", "leg_countin"]), "task.dataset[1]='leg_countin'"),
        (dict(dataset=["chain_sum", "chain_sum"]), "more than once"),
        (dict(dataset="chain_sum", prompt_template="{expr}"), "task.prompt_template='{expr}'"),
    ],
)  # fmt: skip
def test_bad_values_are_one_line_errors_naming_the_key(kwargs, says):
    with pytest.raises(ValueError) as e:
        gym(**kwargs)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_config_keys_load_and_are_inert_under_another_task():
    cfg = load_config(overrides=["task.name=reasoning_gym", "task.dataset=chain_sum",
                                 "task.dataset_config.min_terms=3"])  # fmt: skip
    assert cfg.task.dataset == "chain_sum" and cfg.task.dataset_config == {"min_terms": 3}
    assert cfg.task.num_eval == 500 and load_warnings(cfg) == []
    listed = load_config(
        overrides=[
            "task.name=reasoning_gym",
            "task.dataset=[chain_sum, {name: leg_counting, weight: 2}]",
        ]
    )
    assert listed.task.dataset == ["chain_sum", {"name": "leg_counting", "weight": 2}]
    other = load_config(overrides=["task.dataset=chain_sum", "task.dataset_config.min_terms=3"])
    warned = " ".join(load_warnings(other))
    assert "task.dataset='chain_sum' has no effect with task.name=arithmetic" in warned
    assert "task.dataset_config=" in warned and other.task.dataset is None
    with pytest.raises(ConfigError, match=r"task\.dataset"):
        load_config(overrides=["strict=true", "task.dataset=chain_sum"])


PREFLIGHT = [
    "task.name=reasoning_gym", "task.dataset=chain_sum", "task.prompt_template={expression} =",
    "task.dataset_config.max_digits=2", "task.dataset_config.max_terms=3",
    "rewards.functions=[gym_score]", "rollout.max_completion_length=6",
    "batch.num_generations=4",
]  # fmt: skip


@pytest.mark.slow
def test_preflight_on_the_demo_model_passes_the_reward_probes_on_gym_score():
    out = subprocess.run(
        [sys.executable, "-m", "grpolab", "preflight", "--json", *PREFLIGHT],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    checks = {c["id"]: c for c in report["checks"]}
    for probe in ("rewards.reference", "rewards.wrong_answer", "rewards.echo", "rewards.no_answer",
                  "tokenizer.coverage"):  # fmt: skip
        assert checks[probe]["passed"], checks[probe]
    assert report["passed"] is True
