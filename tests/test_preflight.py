"""`grpolab preflight` end to end: the real CLI on the demo model and a real rollout."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

MUTANTS = Path(__file__).parent / "mutants"
SMALL = ["rollout.max_completion_length=6", "batch.num_generations=4"]


def preflight(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "grpolab", "preflight", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_preflight_passes_on_the_demo_and_prints_json():
    out = preflight("--json", *SMALL)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["passed"] is True and report["impl"] is None
    ids = {c["id"] for c in report["checks"]}
    for goal_check in [
        "logprobs.shift",
        "advantages.zero_std_groups",
        "ratio.initial",
        "clip.values",
        "kl.tracks_exact",
        "norm.aggregation",
        "loss.sgd_direction",
    ]:
        assert goal_check in ids
    for extra in [
        "engine.agreement",
        "split.gradient_invariance",
        "memory.worst_case",
        "rewards.variance",
        "logprobs.fused_vs_naive",
        "rewards.reference",
        "rewards.wrong_answer",
        "rewards.echo",
        "rewards.no_answer",
        "tokenizer.coverage",
    ]:
        assert extra in ids
    assert all(c["passed"] for c in report["checks"])


# Options under which every check of the 2026 bug classes runs: top-k and top-p sampling,
# importance weights, GSPO, KL, and the hf engine's bf16 copies for the sync check.
EVERY_ENGINE_CHECK = [
    "rollout.temperature=0.8", "rollout.top_k=12", "rollout.top_p=0.95",
    "objective.tis_cap=2.0", "objective.tis_mode=sequence_mask",
    "objective.importance_sampling_level=sequence", "objective.beta=0.04",
    "runtime.precision=bf16", "batch.mini_batch_size=8", "batch.gradient_accumulation_steps=2",
]  # fmt: skip
NEW_CHECKS = {
    "kl.gradient", "norm.eos", "norm.token_count", "engine.trained_tokens", "engine.sampling",
    "engine.is_step_one", "engine.is_finite", "gspo.sequence_ratio", "engine.sync_coverage",
}  # fmt: skip


@pytest.mark.slow
def test_preflight_json_lists_the_checks_of_the_2026_bug_classes():
    out = preflight("--json", *EVERY_ENGINE_CHECK, *SMALL)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    checks = {c["id"]: c for c in json.loads(out.stdout)["checks"]}
    assert set(checks) >= NEW_CHECKS
    assert all(c["passed"] for c in checks.values())


@pytest.mark.slow
def test_preflight_names_a_kl_without_gradient_first():
    out = preflight("--impl", str(MUTANTS / "kl_no_grad.py"), *SMALL)
    assert out.returncode == 1
    first = next(line for line in out.stdout.splitlines() if line.startswith("FAIL"))
    assert first.startswith("FAIL kl.gradient:") and "kl_k3's 1.0e+00" in first


@pytest.mark.slow
def test_preflight_table_and_exit_1_on_a_buggy_impl():
    out = preflight("--impl", str(MUTANTS / "eps_swapped.py"), *SMALL)
    assert out.returncode == 1
    assert "clip.asymmetric" in out.stdout and "FAIL" in out.stdout
    assert "likely bug" in out.stdout and "eps_low" in out.stdout


@pytest.mark.slow
def test_a_reward_that_accepts_the_echoed_question_fails_the_preflight():
    mutant = f"{MUTANTS / 'reward_accepts_echo.py'}:evaluated_accuracy"
    out = preflight(f"rewards.functions=[{mutant}]", *SMALL)
    assert out.returncode == 1, out.stderr[-2000:]
    text = " ".join(out.stdout.split())  # the table wraps; the FAIL lines name it all
    assert "FAIL rewards.echo: rows where the prompt echoed or restated scores as much" in text
    assert "first: reward 'evaluated_accuracy' gives the question restated as an expression" in text
    assert "on train row 0 (" in text and "likely bug: a reward accepts the prompt echoed" in text
    assert "FAIL rewards.reference" not in text and "FAIL rewards.wrong_answer" not in text


@pytest.mark.slow
def test_a_task_the_demo_tokenizer_cannot_write_fails_tokenizer_coverage_first():
    capitals = Path(__file__).parent / "data" / "capitals.jsonl"
    out = preflight("task.name=jsonl", f"task.path={capitals}", "task.num_eval=10", *SMALL)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "task jsonl: answers judged as string (inferred from the data: 40 of 40" in out.stdout
    text = " ".join(out.stdout.split())
    fails = [line.split(":")[0] for line in out.stdout.splitlines() if line.startswith("FAIL")]
    assert fails[0] == "FAIL tokenizer.coverage"  # the cause, before its consequences
    assert "(encode, then decode, no <unk>; 40 rows); it cannot write 48 characters:" in text
    assert "train row 0's prompt 'What is the capital of" in text and "= 40" in text
    assert "likely bug: the tokenizer cannot write these characters" in text


@pytest.mark.slow
def test_preflight_usage_errors_exit_2(tmp_path):
    out = preflight("trainer.no_such_key=1")
    assert out.returncode == 2 and "trainer.no_such_key" in out.stderr
    out = preflight("--impl", str(tmp_path / "missing.py"))
    assert out.returncode == 2 and "missing.py" in out.stderr
    broken = tmp_path / "broken.py"
    broken.write_text("def kl_k3(a, b)\n    return a\n")
    out = preflight("--impl", str(broken))
    assert out.returncode == 2 and "broken.py:1" in out.stderr


@pytest.mark.slow
def test_a_trl_users_advantages_pass_under_the_trl_profile_and_fail_under_the_seed():
    trl = str(Path(__file__).parent / "impls" / "trl_advantages.py")
    out = preflight("--json", "--impl", trl, "objective.profile=trl", *SMALL)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    ids = {c["id"] for c in json.loads(out.stdout)["checks"]}
    assert "advantages.sample_std" in ids and "advantages.population_std" not in ids
    out = preflight("--json", "--impl", trl, *SMALL)
    assert out.returncode == 1
    failed = {c["id"] for c in json.loads(out.stdout)["checks"] if not c["passed"]}
    assert "advantages.population_std" in failed


def test_reward_variance_is_judged_on_enough_groups_and_says_why_when_none_varies():
    """A sparse reward can leave the preflight's few groups flat while a step's groups teach:
    then more groups are sampled (a step's prompts_per_step, at least FLAT_EVIDENCE_GROUPS)
    and the check judges those; a reward that never varies still fails there, and the hint
    names the batch that would see a right answer, or the function that scored nothing."""
    import dataclasses

    import torch

    from grpolab.checks.context import Context
    from grpolab.checks.registry import BY_ID
    from grpolab.checks.rewards import FLAT_EVIDENCE_GROUPS
    from grpolab.checks.runner import run_check
    from grpolab.config import load_config
    from grpolab.rewards import load_rewards
    from grpolab.train.preflight import sample_batch, settings_from_config
    from grpolab.train.setup import build_run, load_start_model

    cfg = load_config(None, ["batch.prompts_per_step=4", "batch.num_generations=8"])
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    run = build_run(cfg, model, tokenizer)
    batch, _ = sample_batch(run)  # 4 groups of 8
    flat = dataclasses.replace(batch, rewards=torch.zeros_like(batch.rewards))

    def reward_variance(run, batch):  # as the preflight runs it, with the run
        ctx = Context(run.functions, settings_from_config(run.cfg), run.model, batch, run)
        return run_check(BY_ID["rewards.variance"], ctx)

    judged = reward_variance(run, flat)
    # 16 groups judged: the preflight's 4 (made flat here) and 12 new ones of the demo model,
    # which answers about a third right, so some of those vary.
    n = FLAT_EVIDENCE_GROUPS
    assert judged.id == "rewards.variance" and judged.passed
    assert judged.measured in {k / n for k in range(4, n)} and f"over {n} groups" in judged.what
    assert "batch.prompts_per_step=4 has no varying group with probability" in judged.what
    never = dataclasses.replace(run, rewards=[lambda completions, **_: [0.0] * len(completions)])
    flat_out = reward_variance(never, flat)
    assert not flat_out.passed and flat_out.measured == 1.0
    assert "rarer than 1 in 43 samples" in flat_out.hint  # 3 / (16 x 8), the rule of three
    assert "batch.prompts_per_step >= 16" in flat_out.hint and "dynamic_sampling" in flat_out.hint

    def scores_nothing(completions, **_):
        return [None] * len(completions)

    unscored = dataclasses.replace(run, rewards=load_rewards([scores_nothing]))
    named = reward_variance(unscored, dataclasses.replace(flat, unscored=("scores_nothing",)))
    assert not named.passed and "'scores_nothing' returned None for every sample" in named.hint
