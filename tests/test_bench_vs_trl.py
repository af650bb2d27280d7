"""The benchmark's parity line: grpolab's loss equals TRL's GRPOTrainer loss on one fixed batch
for each matching loss_type (needs trl, the `bench` extra)."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="trl (the bench extra) is not installed")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "vs_trl.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_vs_trl", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


vs_trl = load_bench()


@pytest.mark.parametrize("loss_agg", sorted(vs_trl.LOSS_TYPES))
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_matches_trl(loss_agg: str, beta: float) -> None:
    ours, theirs = vs_trl.loss_parity(loss_agg, beta)
    assert abs(ours) > 1e-4  # off-policy batch: a loss of exactly 0 would prove nothing
    # The losses (~2e-2) differ only through the two paths' log-probs (grpolab's chunked
    # lm-head, TRL's full logits): each token's rounding is of random sign and the loss averages
    # ~50 of them (measured <= 5e-8 with AVX-512, AVX2 and SSE kernels). Every token off by the
    # log-prob tolerance (~2e-4) in the same direction would give ~6e-4, which would also hide
    # a KL convention (~4e-4 of the loss at beta 0.04); loss_parity keeps TRL's log-probs inside
    # compute_loss, so the test cannot bound them tighter.
    assert abs(ours - theirs) <= 1e-5


def test_mismatched_loss_type_is_caught() -> None:
    """The parity check can fail: the same batch under another aggregation differs."""
    seq, _ = vs_trl.loss_parity("sequence", 0.0)
    const, _ = vs_trl.loss_parity("constant", 0.0)
    assert abs(seq - const) > 1e-5


def test_lora_reaches_both_sides() -> None:
    """The real-model example's LoRA goes to grpolab's config and, as the same peft config, to
    TRL; --lora-r 0 trains every weight on both sides."""
    from grpolab.config import load_config

    example = load_config(vs_trl.REAL_EXAMPLE)
    args = ["--model", "smollm2-135m-instruct", "--steps", "1"]
    s = vs_trl.settings_from_args(vs_trl.build_parser().parse_args(args))
    assert s.lora_r == example.lora.r > 0
    ours = vs_trl.grpolab_config(s, 0, "unused").lora
    theirs = vs_trl.trl_lora(s)
    assert (ours.r, ours.alpha) == (theirs.r, theirs.lora_alpha)
    assert set(ours.target_modules) == set(theirs.target_modules)
    assert theirs.lora_dropout == ours.dropout == 0.0

    full = vs_trl.settings_from_args(vs_trl.build_parser().parse_args([*args, "--lora-r", "0"]))
    assert vs_trl.grpolab_config(full, 0, "unused").lora.r == 0
    assert vs_trl.trl_lora(full) is None


def test_trl_trains_the_same_adapters() -> None:
    """TRL under --lora-r trains only LoRA adapters on the warm-up model, as grpolab does."""
    s = vs_trl.Settings(steps=1, prompts_per_step=2, num_generations=2, lora_r=4)
    s = vs_trl.replace(s, lora_target_modules=["q_proj", "v_proj"])
    pairs = vs_trl.prompt_stream(s, 0)
    with tempfile.TemporaryDirectory() as tmp:
        trainer, _ = vs_trl.trl_trainer_on_same_prompts(s, 0, tmp, pairs)
        trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained} == {"q_proj", "v_proj"}


def test_precision_reaches_both_sides() -> None:
    """--precision bf16 is grpolab's runtime.precision=bf16 and TRL's bf16=True; the default
    is fp32 on both."""
    for flag, bf16 in (([], False), (["--precision", "bf16"], True)):
        s = vs_trl.settings_from_args(vs_trl.build_parser().parse_args(["--steps", "1", *flag]))
        precision = vs_trl.grpolab_config(s, 0, "unused").runtime.precision
        assert precision == ("bf16" if bf16 else "fp32")
        with tempfile.TemporaryDirectory() as tmp:
            assert vs_trl.trl_args(s, 0, tmp).bf16 is bf16
