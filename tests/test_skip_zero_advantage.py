"""Skipping the rows without gradient (runtime.skip_zero_advantage): rows whose advantage is
exactly 0 or that are out of the loss add exactly 0 to the gradient when beta = 0 and there
is no entropy bonus, so the update skips their forward and backward; the normaliser still
counts them. The preflight's update.skip_invariance proves it on the run's own functions."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpolab import core
from grpolab.checks.context import Context, PreflightSettings
from grpolab.checks.registry import BY_ID
from grpolab.checks.runner import run_check
from grpolab.config import ConfigError, load_config, objective_of, skips_zero_advantage
from grpolab.functions import core_functions, load_impl
from grpolab.train.loop import train

MUTANTS = Path(__file__).parent / "mutants"
SKIP = BY_ID["update.skip_invariance"]


def skip_invariance(impl, model, batch, s):
    """The registry's update.skip_invariance on a model and a batch, as the preflight runs it."""
    return run_check(SKIP, Context(impl, s, model, batch))


# Valid configs off the default: loss types, GSPO, CISPO, dual-clip and delta at tight clip
# values, another temperature, the peers' profiles.
OBJECTIVES = {
    "sequence": [],
    "token": ["objective.loss_type=token"],
    "constant": ["objective.loss_type=dr_grpo"],
    "gspo": ["objective.importance_sampling_level=sequence"],
    "cispo": ["objective.loss_type=cispo", "objective.epsilon_high=5"],
    "dual_clip": ["objective.dual_clip=3", "objective.epsilon=0.1", "objective.epsilon_high=0.1"],
    "delta": ["objective.delta=2", "rollout.temperature=0.7"],
    "trl": ["objective.profile=trl"],
    "verl": ["objective.profile=verl"],
}


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_grpolab_passes_the_check_and_a_loss_reading_every_row_fails_it(model_and_batch, name):
    model, batch = model_and_batch
    cfg = load_config(None, ["batch.num_generations=4", "batch.prompts_per_step=4",
                             "rollout.max_completion_length=8", *OBJECTIVES[name]])  # fmt: skip
    s = PreflightSettings(objective=objective_of(cfg))
    ours = skip_invariance(core_functions("naive"), model, batch, s)
    assert ours.passed, ours
    fused = skip_invariance(core_functions("fused"), model, batch, s)
    assert fused.passed, fused
    # As the preflight runs it: a mutant without a declared option's keyword fails by raising.
    mutant = load_impl(MUTANTS / "loss_reads_every_row.py")
    theirs = skip_invariance(mutant, model, batch, s)
    assert theirs.id == SKIP.id and not theirs.passed
    assert theirs.hint or theirs.error


def test_rows_without_gradient():
    advantages = torch.tensor([0.0, 1.0, -0.0, 0.5])
    assert core.rows_without_gradient(advantages).tolist() == [True, False, True, False]
    in_loss = torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert core.rows_without_gradient(advantages, in_loss).tolist() == [True, True, True, False]


def test_it_applies_only_where_nothing_else_reads_the_rows():
    assert skips_zero_advantage(load_config(None, []))
    assert not skips_zero_advantage(load_config(None, ["objective.beta=0.04"]))
    assert not skips_zero_advantage(load_config(None, ["objective.entropy_coef=0.01"]))
    assert not skips_zero_advantage(load_config(None, []), distributed=True)
    assert not skips_zero_advantage(load_config(None, ["runtime.skip_zero_advantage=false"]))
    with pytest.raises(ConfigError, match="skip_zero_advantage=False has no effect"):
        load_config(None, ["objective.beta=0.04", "runtime.skip_zero_advantage=false",
                           "strict=true"])  # fmt: skip


def run(tmp_path, name, *overrides):
    out = tmp_path / name
    cfg = load_config(None, [f"output_dir={out}", "eval.eval_examples=0", *overrides])
    train(cfg, skip_preflight=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return [r for r in rows if "loss" in r], out


def test_skipping_trains_as_the_full_update(tmp_path):
    """Same seed, with and without skipping: the same losses and gradient norms up to
    float32 rounding (the micro-batches hold other rows, so sums are taken in another order:
    relative differences of a few ulp per step, growing slowly over 6 steps; 1e-4 leaves two
    orders of magnitude), while the skipped groups are reported."""
    steps = ["max_steps=6", "batch.prompts_per_step=8", "batch.num_generations=8"]
    skipped, _ = run(tmp_path, "skip", *steps)
    full, _ = run(tmp_path, "full", *steps, "runtime.skip_zero_advantage=false")
    assert sum(r["update/skipped_groups"] for r in skipped) > 0
    assert all("update/skipped_groups" not in r for r in full)
    for a, b in zip(skipped, full, strict=True):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-7)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)


def test_a_batch_without_gradient_still_steps_adamw_exactly(tmp_path):
    """Every group flat (a constant reward): no row runs, and the weights after 3 steps are
    bit for bit the full update's (AdamW steps its moments and decay on exact zeros)."""
    const = tmp_path / "const.py"
    const.write_text("def one(completions, **kw):\n    return [1.0] * len(completions)\n")
    common = ["max_steps=3", f"rewards.functions=[{const}:one]", "optim.weight_decay=0.1"]
    skipped, a = run(tmp_path, "skip", *common)
    _, b = run(tmp_path, "full", *common, "runtime.skip_zero_advantage=false")
    assert all(r["update/skipped_rows_frac"] == 1.0 for r in skipped)
    wa = load_file(next((a / "checkpoint-3").glob("*.safetensors")))
    wb = load_file(next((b / "checkpoint-3").glob("*.safetensors")))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
