"""The runtime monitors: each quantity out of its range gives a warning naming it and the step."""

import json
import math

import pytest
from tolerances import EPS32, logprob_tolerance

from grpolab.config import load_config
from grpolab.model.policy import load_policy, save_policy
from grpolab.train.checkpoint import latest_checkpoint
from grpolab.train.loop import train
from grpolab.train.monitors import (
    MonitorLimits,
    MonitorStop,
    RewardDivergence,
    check_step,
    zeroed_step,
)
from grpolab.train.preflight import PreflightFailed

HEALTHY = {
    "skipped": 0,
    "monitor/ratio_dev": 0.0,
    "kl": 0.01,
    "monitor/adv_group_sum": 3e-7,
    "monitor/engine_gap": 2e-6,
    "clip_frac": 0.02,
    "frac_reward_zero_std": 0.3,
}


def test_a_healthy_step_gives_no_warning():
    assert check_step(7, HEALTHY, MonitorLimits(), trainer_logp_old=True) == []


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("skipped", 1, "non-finite"),
        ("monitor/ratio_dev", 0.05, "ratio - 1"),
        ("kl", -0.2, "kl"),
        ("monitor/adv_group_sum", 0.8, "group sum"),
        ("monitor/engine_gap", 0.4, "engine logp"),
        ("clip_frac", 0.6, "clip_frac"),
        ("frac_reward_zero_std", 1.0, "frac_reward_zero_std"),
        ("tis/capped_frac", 0.5, "share of tokens whose importance weight"),
        ("tis/capped_seq_frac", 0.5, "share of sequences with an importance weight"),
    ],
)
def test_each_quantity_out_of_range_is_named_with_its_step(key, value, named):
    warnings = check_step(12, HEALTHY | {key: value}, MonitorLimits(), trainer_logp_old=True)
    assert len(warnings) == 1
    assert warnings[0].startswith("step 12:") and named in warnings[0]


def test_ratio_is_watched_only_for_scheme_a():
    # Scheme B's logp_old comes from the engine: its gap is watched instead.
    bad_ratio = HEALTHY | {"monitor/ratio_dev": 0.05}
    assert check_step(3, bad_ratio, MonitorLimits(), trainer_logp_old=False) == []


def test_a_step_whose_every_importance_weight_was_dropped_is_an_error():
    assert zeroed_step(4, HEALTHY | {"tis/dropped_frac": 0.99}) is None
    assert zeroed_step(4, HEALTHY) is None  # truncate modes, or no tis_cap: never zeroed
    said = zeroed_step(4, HEALTHY | {"tis/dropped_frac": 1.0})
    assert said.startswith("step 4: every token's importance weight was dropped")
    assert "loss was exactly 0" in said


def test_missing_or_nan_quantities_are_not_warnings():
    assert check_step(1, {"kl": float("nan")}, MonitorLimits(), trainer_logp_old=True) == []


# --- The reward against the strict accuracy -------------------------------------------------


def divergence_warnings(rows, scale):
    """Feed (reward/mean, accuracy, strict_accuracy) per step; (gaps, warnings) per step."""
    watch = RewardDivergence(MonitorLimits(), scale)
    out = []
    for step, (reward, accuracy, strict) in enumerate(rows, start=1):
        metrics = {"reward/mean": reward, "accuracy": accuracy, "strict_accuracy": strict}
        out.append(watch.update(step, metrics))
    return out


def test_divergence_waits_for_a_full_window_and_names_the_gap():
    window = MonitorLimits().divergence_window
    # A reward paying everything from step 1 while nothing is right.
    out = divergence_warnings([(1.0, 0.0, 0.0)] * (window + 1), scale=(0.0, 1.0))
    assert all(not warnings for _, warnings in out[: window - 1])
    gaps, warnings = out[window - 1]
    assert gaps == {"monitor/accuracy_strict_gap": 0.0, "monitor/reward_strict_gap": 1.0}
    (w,) = warnings
    assert w.startswith(f"step {window}: rewarded-as-right fraction - strict_accuracy = 1 ")
    assert "gamed reward" in w and "expected <= 0.1" in w


# (reward/mean, accuracy, strict_accuracy) of the first 9 steps of a real run: SmolLM2-135M-
# Instruct, chat-template "What is 59 + 63?" prompts, 8 prompts x G=8, lr 1e-5, trained on
# tests/mutants/reward_accepts_echo.py (math-verify on the whole completion). The reward pays
# for restated sums ("To add 19 + 92, ...") while the built-in accuracy and the strict check
# agree on every step.
GAMED_RUN = [
    (0.125, 0.015625, 0.015625),
    (0.1875, 0.0, 0.0),
    (0.125, 0.0, 0.0),
    (0.171875, 0.03125, 0.03125),
    (0.234375, 0.046875, 0.046875),
    (0.171875, 0.015625, 0.015625),
    (0.203125, 0.015625, 0.015625),
    (0.21875, 0.03125, 0.03125),
    (0.171875, 0.015625, 0.015625),
]


def test_the_gamed_reward_of_a_real_run_is_caught_when_the_window_fills():
    # The probes measured the mutant's scale as (0, 1): a wrong answer 0, the reference 1.
    out = divergence_warnings(GAMED_RUN, scale=(0.0, 1.0))
    window = MonitorLimits().divergence_window
    assert not any(warnings for _, warnings in out[: window - 1])
    gaps, warnings = out[window - 1]
    assert gaps["monitor/reward_strict_gap"] == pytest.approx(0.16015625)  # as the run logged
    assert gaps["monitor/accuracy_strict_gap"] == 0.0  # the built-in accuracy is honest
    assert len(warnings) == 1 and warnings[0].startswith(
        f"step {window}: rewarded-as-right fraction - strict_accuracy = 0.16 "
    )
    # Every later step warns too; the accuracy never does.
    assert all(len(w) == 1 for _, w in out[window - 1 :])


def test_the_reward_is_read_on_the_scale_the_probes_measured():
    # accuracy + 0.1 * format: a formatted wrong answer earns 0.1, a formatted right one 1.1.
    # All formatted, a quarter right: the reward is a quarter of the way; no gap.
    out = divergence_warnings([(0.1 + 0.25, 0.25, 0.25)] * 10, scale=(0.1, 1.1))
    assert out[-1][0]["monitor/reward_strict_gap"] == pytest.approx(0.0, abs=1e-12)
    assert not out[-1][1]
    # Without a scale (a reward that pays right and wrong alike) only the accuracy is watched.
    out = divergence_warnings([(1.0, 0.9, 0.1)] * 10, scale=None)
    gaps, warnings = out[-1]
    assert set(gaps) == {"monitor/accuracy_strict_gap"} and gaps[
        "monitor/accuracy_strict_gap"
    ] == pytest.approx(0.8)
    assert len(warnings) == 1 and "accuracy - strict_accuracy" in warnings[0]


def test_an_exact_reward_stricter_than_the_strict_check_is_no_warning():
    # Exact match rejects "85abc", the strict check reads 85: the reward behind, never ahead.
    out = divergence_warnings([(0.2, 0.2, 0.5)] * 12, scale=(0.0, 1.0))
    assert not any(warnings for _, warnings in out)


def test_steps_without_a_strict_accuracy_are_not_watched():
    watch = RewardDivergence(MonitorLimits(), (0.0, 1.0))
    assert watch.update(1, {"reward/mean": 1.0, "accuracy": 1.0}) == ({}, [])


# --- In the trainer -----------------------------------------------------------------------------

TINY = [
    "batch.prompts_per_step=4",
    "batch.num_generations=4",
    "rollout.max_completion_length=6",
    "eval.eval_examples=0",
]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_trainer_records_the_monitored_quantities(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path / 'ok'}", "max_steps=2", *TINY])
    train(cfg, skip_preflight=True)
    rows = _rows(tmp_path / "ok")
    # A group's G float32 advantages of 0/1 rewards sum to 0 up to a few roundings each: the
    # mean's, eps32 * max r / std <= eps32 * G / sqrt(G - 1), and the entry's own two, eps32 *
    # |adv| <= eps32 * sqrt(G - 1) each (2.8e-6 in all at G = 4); twice that.
    G = cfg.batch.num_generations
    group_sum_tol = 2 * G * (G / math.sqrt(G - 1) + 2 * math.sqrt(G - 1)) * EPS32
    # The HF engine's own log-probs (its decode against the trainer's forward), under weights
    # that two steps moved by ~2 lr each: the logits' bound by well under the factor 2 to spare.
    model, _ = load_policy(latest_checkpoint(tmp_path / "ok"))
    engine_tol = logprob_tolerance(model)
    for row in rows:
        # Scheme A, one update per batch: logp_old is the loss forward's own detached log-probs,
        # so exp(x - x) - 1 = 0 exactly.
        assert row["monitor/ratio_dev"] == 0.0
        assert row["monitor/adv_group_sum"] <= group_sum_tol
        assert row["monitor/engine_gap"] <= engine_tol
        # Exact match is never looser than the strict check: the reward never runs ahead.
        assert row["strict_accuracy"] >= row["accuracy"]
        assert row["monitor/accuracy_strict_gap"] <= 0
        assert row["monitor/reward_strict_gap"] <= 0
        assert "warnings" not in row


def test_warn_names_the_quantity_and_training_goes_on(tmp_path):
    # Any group without reward variance is "out of range" with this limit.
    cfg = load_config(
        None,
        [f"output_dir={tmp_path / 'warn'}", "max_steps=2", "monitors.zero_std_max=0", *TINY],
    )
    summary = train(cfg, skip_preflight=True)
    assert summary["steps"] == 2
    warned = [w for row in _rows(tmp_path / "warn") for w in row.get("warnings", [])]
    assert warned and all("frac_reward_zero_std" in w for w in warned)
    assert warned[0].startswith("step 1:")


def test_stop_saves_a_checkpoint_and_stops(tmp_path):
    out = tmp_path / "stop"
    overrides = [f"output_dir={out}", "max_steps=3", "monitors.action=stop", *TINY]
    cfg = load_config(None, [*overrides, "monitors.zero_std_max=0"])
    with pytest.raises(MonitorStop, match=r"step 1.*frac_reward_zero_std"):
        train(cfg, skip_preflight=True)
    assert latest_checkpoint(out).name == "checkpoint-1"


def test_the_importance_weights_are_recorded_and_a_zeroed_step_stops_the_run(tmp_path):
    # fp32, the hf engine on the trainer's own weights: no weight is near a cap of 2.
    tis = ["objective.tis_cap=2.0", "objective.tis_mode=sequence_mask"]
    cfg = load_config(None, [f"output_dir={tmp_path / 'ok'}", "max_steps=1", *tis, *TINY])
    train(cfg, skip_preflight=True)
    (row,) = _rows(tmp_path / "ok")
    assert row["tis/capped_frac"] == row["tis/capped_seq_frac"] == row["tis/dropped_frac"] == 0
    assert abs(row["tis/weight_mean"] - 1) < 1e-4
    assert "warnings" not in row
    # A cap below 1 drops every weight at step 1: the loss is exactly 0. Under
    # monitors.action=warn too, the run stops there with a checkpoint.
    out = tmp_path / "zeroed"
    cfg = load_config(None, [f"output_dir={out}", "max_steps=3", *tis, *TINY,
                             "objective.tis_cap=0.5"])  # fmt: skip
    with pytest.raises(MonitorStop, match=r"step 1: every token's importance weight was dropped"):
        train(cfg, skip_preflight=True)
    assert latest_checkpoint(out).name == "checkpoint-1"
    (row,) = _rows(out)
    assert row["tis/dropped_frac"] == 1 and row["loss"] == 0
    assert any("importance weight" in w for w in row["warnings"])


def test_dropout_breaks_the_first_ratio_and_both_guards_see_it(
    tmp_path, demo_model, demo_tokenizer
):
    # A policy with dropout: the extra forward for logp_old and the loss forward see different
    # masks, so the ratio is not 1 before the first update. The preflight refuses to start;
    # past it (--skip-preflight) the monitor names the ratio.
    model, tokenizer = demo_model, demo_tokenizer  # this test's own copy of the model
    model.config.attention_dropout = 0.5
    save_policy(model, tokenizer, tmp_path / "dropout-model")
    base = [f"model.name_or_path={tmp_path / 'dropout-model'}", "max_steps=1", *TINY]
    base.append("batch.mini_batch_size=8")  # two optimizer steps: logp_old by a forward
    cfg = load_config(None, [f"output_dir={tmp_path / 'gated'}", *base])
    with pytest.raises(PreflightFailed, match=r"ratio\.initial"):
        train(cfg)
    cfg = load_config(None, [f"output_dir={tmp_path / 'monitored'}", *base])
    train(cfg, skip_preflight=True)
    (row,) = _rows(tmp_path / "monitored")
    assert row["monitor/ratio_dev"] > 1e-2
    assert any("ratio - 1" in w for w in row["warnings"])


def test_under_bf16_the_mean_engine_gap_is_watched_not_its_rounding_tail():
    """bf16 engines round apart: a max gap of 2 nats over a step's tokens is rounding (seen on
    the real-model example) and warns of nothing; a mean of 0.3 nats per token (a wrong
    temperature, other weights) does. Under fp32 the max stays watched at 1e-3."""
    from grpolab.config.sections import MonitorsConfig
    from grpolab.model.precision import FP32, Precision
    from grpolab.train.monitors import limits_for

    trainer = MonitorsConfig()  # the section's defaults
    bf16 = limits_for(trainer, "float32", Precision("bf16", "test"))
    rounding = HEALTHY | {"monitor/engine_gap": 2.04, "monitor/engine_gap_mean": 0.03}
    assert check_step(6, rounding, bf16, trainer_logp_old=True) == []
    wrong = rounding | {"monitor/engine_gap_mean": 0.35}
    (warning,) = check_step(6, wrong, bf16, trainer_logp_old=True)
    assert "mean |engine logp - trainer logp| = 0.35" in warning
    fp32 = limits_for(trainer, "float32", FP32)
    (warning,) = check_step(6, HEALTHY | {"monitor/engine_gap": 0.01}, fp32, trainer_logp_old=True)
    assert "max |engine logp - trainer logp|" in warning
