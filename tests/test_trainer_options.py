"""Trainer options that trade compute for memory must not change the gradient."""

from __future__ import annotations

import pytest
import torch

from grpolab.config import ConfigError, load_config
from grpolab.setup import build_run, load_start_model
from grpolab.step import grpo_step


def small_run_config(output_dir, *overrides: str):
    """4 prompts x G = 4 on the demo model, plus the option under test."""
    return load_config(
        None,
        [
            f"output_dir={output_dir}",
            "trainer.prompts_per_step=4",
            "trainer.num_generations=4",
            *overrides,
        ],
    )


def test_gradient_checkpointing_gives_the_same_gradient(tmp_path):
    grads, checkpointed = [], []
    for on in (False, True):
        cfg = small_run_config(
            tmp_path / str(on),
            "trainer.max_grad_norm=0",
            "trainer.logprob_source=trainer",
            "trainer.num_iterations=2",  # logp_old from a separate no-grad pass too
            f"trainer.gradient_checkpointing={str(on).lower()}",
        )
        model, tokenizer = load_start_model(cfg, torch.device("cpu"))
        run = build_run(cfg, model, tokenizer)
        _, batch = grpo_step(run, 1)
        assert batch.advantages.abs().sum() > 0
        grads.append([p.grad.clone() for p in model.parameters()])
        checkpointed.append(model.is_gradient_checkpointing)
    assert checkpointed == [False, True]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_bf16_autocast_keeps_fp32_master_weights_and_an_exact_first_ratio(tmp_path):
    weights = {}
    for mode in ("off", "bf16"):
        cfg = small_run_config(
            tmp_path / mode,
            "trainer.mini_batch_size=8",  # two updates: logp_old from its own forward
            f"trainer.autocast={mode}",
        )
        model, tokenizer = load_start_model(cfg, torch.device("cpu"))
        start = [p.detach().clone() for p in model.parameters()]
        run = build_run(cfg, model, tokenizer)
        metrics, _ = grpo_step(run, 1)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert any(not torch.equal(a, p) for a, p in zip(start, model.parameters(), strict=True))
        # logp_old and the first loss forward run in the same precision: the ratio is 1.
        assert metrics["monitor/ratio_dev"] <= 1e-6
        weights[mode] = [p.detach().clone() for p in model.parameters()]
    diffs = [
        float((a - b).abs().max()) for a, b in zip(weights["off"], weights["bf16"], strict=True)
    ]
    assert 0 < max(diffs) < 1e-2  # bf16 matmuls did run, and stayed close to fp32


def test_autocast_takes_off_or_bf16():
    with pytest.raises(ConfigError, match=r"trainer\.autocast"):
        load_config(None, ["trainer.autocast=fp8"])


def test_torch_compile_compiles_the_layer_parts_and_changes_nothing(tmp_path):
    """trainer.torch_compile: the MLP and norms of each decoder layer compiled (attention, which
    takes the KV cache, stays eager); two steps give what the eager model gives."""
    from grpolab.setup import compile_decoder_layers

    results = {}
    for on in (False, True):
        cfg = small_run_config(tmp_path / str(on), f"trainer.torch_compile={str(on).lower()}")
        model, tokenizer = load_start_model(cfg, torch.device("cpu"))
        run = build_run(cfg, model, tokenizer)
        metrics = [grpo_step(run, step)[0] for step in (1, 2)]
        layer = model.model.layers[0]
        compiled = [name for name, m in layer.named_children() if m._compiled_call_impl]
        results[on] = (metrics, model.state_dict(), compiled)
    assert results[False][2] == []
    assert results[True][2] == ["mlp", "input_layernorm", "post_attention_layernorm"]
    for eager, comp in zip(results[False][0], results[True][0], strict=True):
        assert comp["reward/mean"] == eager["reward/mean"]  # the same samples
        assert comp["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-5)
    # Adam divides by sqrt(v) ~ |g|: rounding in near-zero gradients moves a weight by ~1e-6.
    for name, tensor in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], tensor, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"trainer\.torch_compile=true: Linear has no"):
        compile_decoder_layers(torch.nn.Linear(2, 2))
