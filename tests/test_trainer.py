"""The trainer on the real demo model (a tiny Llama): the loop, resume (of the whole model and of
LoRA adapters), the non-finite guard."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from finished_runs import assert_resumed_is_straight
from tolerances import assert_gradients_close, logprob_tolerance, reduction_terms

from grpolab import core
from grpolab.commands.cli import main
from grpolab.config import load_config
from grpolab.functions import core_functions
from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model, load_policy
from grpolab.train.checkpoint import latest_checkpoint, save_checkpoint
from grpolab.train.loop import train
from grpolab.train.monitors import NonFiniteError
from grpolab.train.setup import build_run, load_start_model, lr_lambda
from grpolab.train.step import grpo_step

SMALL = [
    "batch.prompts_per_step=4",
    "batch.num_generations=4",
    "eval.eval_examples=16",
    "logging.progress=false",
    "logging.log_completions_steps=1",
]


def small_config(tmp_path, *extra: str, name: str = "run"):
    return load_config(None, [f"output_dir={tmp_path / name}", "max_steps=2", *SMALL, *extra])


def seq_logp(run, batch) -> torch.Tensor:
    """Sum of completion log-probs per sequence under the run's model: [B]."""
    with torch.no_grad():
        logp, mask = core.sequence_logprobs(
            run.model, batch.input_ids, batch.attention_mask, batch.completion_mask
        )
    return (logp * mask).sum(1)


def test_one_step_moves_logprobs_toward_positive_advantages(tmp_path):
    cfg = small_config(tmp_path, "batch.prompts_per_step=8", "optim.learning_rate=1e-3")
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = build_run(cfg, model, tokenizer)
    metrics, batch = grpo_step(run, 1)
    adv = batch.advantages  # [B]
    assert adv.abs().sum() > 0, "no group had mixed rewards; pick another seed"
    after_logp = seq_logp(run, batch)
    model.load_state_dict(before)
    before_logp = seq_logp(run, batch)
    delta = after_logp - before_logp  # [B]
    assert not torch.equal(after_logp, before_logp)
    # First order: the step raises the log-prob of positive-advantage samples and lowers the
    # others; a sign error in the loss makes this negative.
    assert (adv * delta).sum() > 0
    assert delta[adv > 0].mean() > delta[adv < 0].mean()
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["skipped"] == 0


@pytest.mark.parametrize("loss_type", ["sequence", "token", "constant"])
def test_gradient_accumulation_equals_one_pass(tmp_path, loss_type):
    grads = []
    for accumulation in (1, 4):
        cfg = small_config(
            tmp_path,
            f"objective.loss_type={loss_type}",
            f"batch.gradient_accumulation_steps={accumulation}",
            "optim.max_grad_norm=0",  # compare raw gradients
            "objective.beta=0.1",  # the reference path too
            "runtime.logprobs=core",
        )
        model, tokenizer = load_start_model(cfg, torch.device("cpu"))
        run = build_run(cfg, model, tokenizer)
        _, batch = grpo_step(run, 1)
        assert batch.advantages.abs().sum() > 0
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    # Four micro-batches' forwards and summed gradients round differently from one pass; a
    # wrong loss scale would be off by a factor (1/4, or a token-count ratio).
    terms = reduction_terms(model, tokens=batch.attention_mask.numel())
    assert_gradients_close(grads[1], grads[0], terms)


def test_demo_end_to_end_through_the_cli(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(["train", f"output_dir={out}", "max_steps=2", "checkpoints.save_steps=1", *SMALL])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy before GRPO" in printed and "GRPO objective" in printed
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "accuracy_before",
        "accuracy_after",
        "strict_accuracy_before",
        "strict_accuracy_after",
        "steps",
        "wall_seconds",
    ):
        assert summary[key] is not None, key
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in (
        "reward/mean",
        "reward/std",
        "rewards/accuracy/mean",
        "accuracy",
        "strict_accuracy",
        "frac_reward_zero_std",
        "completion_length/mean",
        "loss",
        "kl",
        "clip_frac_low",
        "clip_frac_high",
        "ratio_mean",
        "adv_std",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "time/rollout",
        "time/score",
        "time/logprobs",
        "time/update",
    ):
        assert key in rows[0], key
    assert (out / "completions.jsonl").read_text().strip()
    assert (out / "config.yaml").is_file() and (out / "objective.txt").is_file()
    # Hugging Face format: transformers loads the final checkpoint directly.
    latest = latest_checkpoint(out)
    assert latest is not None and latest.name == "checkpoint-2"
    model, _ = load_policy(latest)
    assert sum(p.numel() for p in model.parameters()) > 0

    assert main(["report", str(out)]) == 0
    for name in ("reward.png", "kl.png", "clip_frac.png", "lengths.png", "time.png"):
        assert (out / name).stat().st_size > 1000, name
    report = (out / "report.md").read_text()
    assert "Held-out accuracy" in report and "Strict held-out accuracy" in report
    # Sample completions beside the curves, with the strict verdict.
    assert "### Step 1 (early)" in report and "### Step 2 (late)" in report
    assert "| prompt | completion | answer | reward | strict |" in report


def test_refuses_an_output_dir_holding_another_run(tmp_path):
    cfg = small_config(tmp_path, "max_steps=1", "eval.eval_examples=0")
    train(cfg, skip_preflight=True)  # the run directory is the point here
    with pytest.raises(FileExistsError, match="holds another run"):
        train(cfg, skip_preflight=True)
    summary = train(cfg, overwrite=True, skip_preflight=True)
    assert summary["steps"] == 1


# The model a resume restores: the whole model with its reference copy, or LoRA adapters over
# the frozen base (which is their reference).
RESUMED = {
    "full": ("objective.beta=0.05",),
    "lora": ("lora.r=4", "objective.beta=0.04", "rollout.max_completion_length=6"),
}


@pytest.mark.parametrize("model", sorted(RESUMED))
def test_resume_is_bit_exact(tmp_path, model):
    extra = (
        "eval.eval_examples=0",
        "objective.num_iterations=2",  # several optimizer steps per batch: Adam state matters
        "batch.mini_batch_size=8",
        *RESUMED[model],
    )
    train(small_config(tmp_path, *extra, name="straight"), skip_preflight=True)
    assert_resumed_is_straight(small_config, tmp_path, *extra, stop_at=1, steps=2)


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    tokenizer = build_char_tokenizer()
    other = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=64, num_heads=2))
    out = tmp_path / "run"
    save_checkpoint(out, 1, other, tokenizer, {}, {})
    cfg = small_config(tmp_path, "eval.eval_examples=0")
    with pytest.raises(ValueError, match="different model"):
        train(cfg, resume=True)


def test_missing_model_path_is_a_clear_error(tmp_path, capsys):
    rc = main(["train", f"output_dir={tmp_path / 'x'}", "model.name_or_path=/no/such/model"])
    assert rc == 2
    assert "/no/such/model" in capsys.readouterr().err
    rc = main(["eval", "--model", "runs/nothing/checkpoint-5"])
    assert rc == 2
    assert "runs/nothing/checkpoint-5" in capsys.readouterr().err


def test_config_error_from_the_cli_is_one_line(tmp_path, capsys):
    rc = main(["train", f"output_dir={tmp_path / 'x'}", "trainer.num_generation=4"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "trainer.num_generation" in err and "\n" not in err


def nan_after(step_from: int):
    """A grpo_loss that turns non-finite on every call from the step_from-th call on."""
    calls = {"n": 0}

    def grpo_loss(*args, **kwargs):
        calls["n"] += 1
        loss, metrics = core.grpo_loss(*args, **kwargs)
        if calls["n"] >= step_from:
            loss = loss * float("nan")
        return loss, metrics

    return grpo_loss


def test_nonfinite_guard_stops_with_checkpoint_and_capsule(tmp_path):
    cfg = small_config(
        tmp_path, "max_steps=5", "monitors.max_consecutive_nonfinite=2", "eval.eval_examples=0"
    )
    start, _ = load_start_model(cfg, torch.device("cpu"))
    bad_core = dataclasses.replace(core_functions("naive"), grpo_loss=nan_after(1))
    with pytest.raises(NonFiniteError, match="loss") as err:
        train(cfg, functions=bad_core, skip_preflight=True)  # the preflight would catch it first
    assert "step 2" in str(err.value)
    saved, _ = load_policy(latest_checkpoint(cfg.output_dir))
    for (name, p0), p1 in zip(start.state_dict().items(), saved.state_dict().values(), strict=True):
        assert torch.equal(p0, p1), f"a non-finite step reached the weights: {name}"
    capsule = torch.load(f"{cfg.output_dir}/nonfinite-capsule.pt", weights_only=False)
    assert {"input_ids", "advantages", "logp_old", "rng", "what"} <= set(capsule)
    assert capsule["what"].startswith("loss")
    assert capsule["logp_old"].shape == (16, capsule["input_ids"].shape[1] - 1)


def test_nonfinite_step_is_skipped_and_training_goes_on(tmp_path):
    cfg = small_config(tmp_path, "max_steps=3", "eval.eval_examples=0")
    calls = {"n": 0}

    def grpo_loss(*args, **kwargs):  # non-finite on the first step only
        calls["n"] += 1
        loss, metrics = core.grpo_loss(*args, **kwargs)
        return (loss * float("nan") if calls["n"] == 1 else loss), metrics

    bad_core = dataclasses.replace(core_functions("naive"), grpo_loss=grpo_loss)
    summary = train(cfg, functions=bad_core, skip_preflight=True)
    assert summary["steps"] == 3 and summary["skipped_steps"] == 1
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [1, 0, 0]
    model, _ = load_policy(latest_checkpoint(cfg.output_dir))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_lr_schedule():
    constant = lr_lambda("constant", 2, 10)
    assert [constant(s) for s in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    cosine = lr_lambda("cosine", 0, 10)
    assert cosine(0) == pytest.approx(1.0)
    assert cosine(5) == pytest.approx(0.5)
    assert cosine(10) == pytest.approx(0.0)


def test_eval_command(capsys):
    rc = main(["eval", "--examples", "16", "--pass-at-k", "2", "--samples", "4"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "accuracy (greedy)" in out and "pass@2" in out


def test_warmup_is_deterministic_and_loadable(tmp_path):
    from grpolab.commands.warmup import WarmupConfig, warmup

    accs = [
        warmup(tmp_path / f"w{i}", WarmupConfig(steps=2, num_threads=0, eval_examples=32))
        for i in range(2)
    ]
    assert accs[0] == accs[1] and 0.0 <= accs[0] <= 100.0
    a, tok = load_policy(tmp_path / "w0")
    b, _ = load_policy(tmp_path / "w1")
    assert tok("37+48=", add_special_tokens=False)["input_ids"]  # the character vocabulary
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert a.config.hidden_size // a.config.num_attention_heads >= 32  # vLLM CPU attention


def test_missing_tracker_package_is_a_clear_error(tmp_path, capsys):
    try:
        import wandb  # noqa: F401

        pytest.skip("wandb is installed")
    except ImportError:
        pass
    rc = main(["train", f"output_dir={tmp_path / 'x'}", "logging.report_to=wandb", *SMALL])
    assert rc == 2
    assert "pip install wandb" in capsys.readouterr().err


def test_scheme_b_takes_logp_old_from_the_engine(tmp_path):
    cfg = small_config(tmp_path, "objective.logprob_source=engine")
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    run = build_run(cfg, model, tokenizer)
    tol = logprob_tolerance(model)  # the engine's decode and the trainer's forward
    metrics, batch = grpo_step(run, 1)
    assert batch.logp_old is not None
    # The engine's log-probs are the sampler's own: the first ratio is 1 up to the two paths'
    # rounding of the log-probs d (|exp(d) - 1| ~ |d| <= tol).
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=tol)
    assert metrics["clip_frac"] == 0.0
