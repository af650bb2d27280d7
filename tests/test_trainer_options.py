"""Trainer options that trade compute for memory must not change the gradient."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_gradients_close, gradient_norm_tolerance, reduction_terms

from grpolab.config import ConfigError, load_config, load_notes
from grpolab.model.precision import resolve_precision
from grpolab.train.setup import build_run, load_start_model
from grpolab.train.step import grpo_step


def small_run_config(output_dir, *overrides: str):
    """4 prompts x G = 4 on the demo model, plus the option under test."""
    return load_config(
        None,
        [
            f"output_dir={output_dir}",
            "batch.prompts_per_step=4",
            "batch.num_generations=4",
            *overrides,
        ],
    )


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_gradient_checkpointing_gives_the_same_gradient(tmp_path):
    grads, checkpointed = [], []
    for on in (False, True):
        cfg = small_run_config(
            tmp_path / str(on),
            "optim.max_grad_norm=0",
            "objective.logprob_source=trainer",
            "objective.num_iterations=2",  # logp_old from a separate no-grad pass too
            # The gradient left is the second epoch's. A real first update (Adam: ~lr * sign(g))
            # would turn the two paths' rounding in near-zero gradients into different weights
            # for it; an update of at most 1e-12 per weight leaves the weights the same, so the
            # two gradients differ by rounding alone.
            "optim.learning_rate=1e-12",
            f"runtime.gradient_checkpointing={str(on).lower()}",
        )
        model, tokenizer = load_start_model(cfg, torch.device("cpu"))
        run = build_run(cfg, model, tokenizer)
        _, batch = grpo_step(run, 1)
        assert batch.advantages.abs().sum() > 0
        grads.append(grads_of(model))
        checkpointed.append(model.is_gradient_checkpointing)
    assert checkpointed == [False, True]
    # The recompute (and the plain forward that checkpointing takes instead of the shared
    # prompt's KV cache) rounds differently: float32 tolerance at each tensor's scale.
    terms = reduction_terms(model, tokens=batch.attention_mask.numel())
    assert_gradients_close(grads[1], grads[0], terms)


@pytest.mark.parametrize("lora", ["0", "4"])
def test_gradient_checkpointing_under_bf16_passes_its_preflight_and_trains(tmp_path, lora):
    """bf16 with gradient checkpointing: the recompute runs under the forward's bf16 region,
    so the preflight (its memory probe runs a checkpointed forward and backward) passes and
    a step trains; the recompute once ran short attention in bf16 where the forward had run
    it in float32, and the checkpoint refused the step."""
    from grpolab.train.preflight import preflight

    cfg = small_run_config(
        tmp_path,
        "runtime.gradient_checkpointing=true",
        "runtime.precision=bf16",
        f"lora.r={lora}",
    )
    failed = [(r.id, r.error) for r in preflight(cfg) if not r.passed]
    assert not failed, failed
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    run = build_run(cfg, model, tokenizer)
    metrics, _ = grpo_step(run, 1)
    assert model.is_gradient_checkpointing and metrics["grad_norm"] > 0


def test_bf16_precision_keeps_fp32_master_weights_and_an_exact_first_ratio(tmp_path):
    updates = {}
    for mode in ("fp32", "bf16"):
        cfg = small_run_config(
            tmp_path / mode,
            # Two updates, logp_old from its own forward. The first update's minibatch is the
            # whole batch, the rows of that forward in the same order: the same kernels on the
            # same inputs, so the first ratio is exactly 1. (Other rows in one forward would
            # round differently, by ~1e-7 in float32 with 2 threads.)
            # Every row in that forward: skipping the rows without gradient would change them.
            "objective.num_iterations=2",
            "runtime.skip_zero_advantage=false",
            f"runtime.precision={mode}",
        )
        model, tokenizer = load_start_model(cfg, torch.device("cpu"))
        start = [p.detach().clone() for p in model.parameters()]
        run = build_run(cfg, model, tokenizer)
        assert run.precision.name == mode
        metrics, _ = grpo_step(run, 1)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert any(not torch.equal(a, p) for a, p in zip(start, model.parameters(), strict=True))
        # logp_old runs in the loss forward's precision (a float32 logp_old against bf16
        # forwards would be ~1e-2 off).
        assert metrics["monitor/ratio_dev"] == 0.0
        updates[mode] = torch.cat(
            [(p.detach() - a).flatten() for a, p in zip(start, model.parameters(), strict=True)]
        )
    # bf16 matmuls did run. No rounding bound compares the two: bf16's rounding (eps 7.8e-3)
    # over these reductions can turn around the Adam step (~lr * sign(g)) of any parameter whose
    # gradient is within a few percent of its tensor's largest. What holds is that most
    # parameters step the same way (cosine 1 - 2f with a share f turned around), where a bf16
    # path computing another gradient would give an unrelated update (cosine ~0).
    off, bf16 = updates["fp32"], updates["bf16"]
    assert not torch.equal(off, bf16)
    assert torch.nn.functional.cosine_similarity(off, bf16, dim=0) > 0.5


def test_precision_takes_auto_fp32_or_bf16_and_autocast_is_its_older_name():
    with pytest.raises(ConfigError, match=r"runtime\.precision.*'auto', 'fp32', 'bf16'"):
        load_config(None, ["runtime.precision=fp16"])
    with pytest.raises(ConfigError, match=r"trainer\.autocast.*off or bf16"):
        load_config(None, ["trainer.autocast=fp8"])
    for old, new in (("off", "fp32"), ("bf16", "bf16")):
        cfg = load_config(None, [f"trainer.autocast={old}"])
        assert cfg.runtime.precision == new
        assert f"trainer.autocast={old} -> runtime.precision={new}" in load_notes(cfg)[0]
    assert (
        load_config(None, ["trainer.autocast=bf16", "runtime.precision=bf16"]).runtime.precision
        == "bf16"
    )
    with pytest.raises(
        ConfigError,
        match=r"trainer\.autocast=off \(now runtime\.precision\) and runtime\.precision=bf16 "
        "disagree",
    ):
        load_config(None, ["trainer.autocast=off", "runtime.precision=bf16"])


def test_auto_precision_is_bf16_exactly_where_the_device_multiplies_bf16_natively():
    """auto follows the hardware (AMX or AVX512-BF16 on a CPU, native bf16 on a GPU); fp32 and
    bf16 are kept as given. Never bf16 on a CPU with neither, where bf16 would be emulated."""
    cpu = torch.device("cpu")
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    avx512_bf16 = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    auto = resolve_precision("auto", cpu)
    assert auto.name == ("bf16" if amx or avx512_bf16 else "fp32")
    named = "AMX" if amx else "AVX512-BF16" if avx512_bf16 else "neither AMX nor AVX512-BF16"
    assert auto.reason.startswith("auto: ") and named in auto.reason
    assert resolve_precision("fp32", cpu).name == "fp32"
    assert resolve_precision("bf16", cpu).name == "bf16"
    assert load_config(None, []).runtime.precision == "fp32"  # the demo's numbers everywhere


@pytest.mark.slow  # inductor starts g++ and its compile workers
def test_torch_compile_compiles_the_layer_parts_and_changes_nothing(tmp_path):
    """runtime.torch_compile: the MLP and norms of each decoder layer compiled (attention, which
    takes the KV cache, stays eager); each of two steps gives the eager model's gradient."""
    from grpolab.train.setup import compile_decoder_layers

    runs = {}
    for on in (False, True):
        cfg = small_run_config(
            tmp_path / str(on),
            "optim.max_grad_norm=0",  # compare raw gradients
            f"runtime.torch_compile={str(on).lower()}",
        )
        model, tokenizer = load_start_model(cfg, torch.device("cpu"))
        runs[on] = build_run(cfg, model, tokenizer)
    eager, compiled = runs[False].model, runs[True].model
    for step in (1, 2):
        # Each step from the same weights: after an update (Adam: ~lr * sign(g)) the two paths'
        # rounding in near-zero gradients would leave different weights, whose gradients
        # differ by more than rounding.
        compiled.load_state_dict(eager.state_dict())
        metrics, batch = grpo_step(runs[False], step)
        compiled_metrics, _ = grpo_step(runs[True], step)
        # The same samples: the two forwards' logits are float32 rounding apart, which changes a
        # token only for a draw within ~1e-6 of the boundary between two.
        assert compiled_metrics["reward/mean"] == metrics["reward/mean"]
        want, got = grads_of(eager), grads_of(compiled)
        terms = reduction_terms(eager, tokens=batch.attention_mask.numel())
        assert_gradients_close(got, want, terms)
        rel = gradient_norm_tolerance(want, terms)
        assert compiled_metrics["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=rel)
    layer = compiled.model.layers[0]
    compiled_parts = [name for name, m in layer.named_children() if m._compiled_call_impl]
    assert compiled_parts == ["mlp", "input_layernorm", "post_attention_layernorm"]
    assert not any(m._compiled_call_impl for m in eager.model.layers[0].children())
    with pytest.raises(ValueError, match=r"runtime\.torch_compile=true: Linear has no"):
        compile_decoder_layers(torch.nn.Linear(2, 2))
