"""bf16 precision: one cached bf16 copy per weight gives autocast's own values and gradients,
the copies follow every update, the hf engine samples from them and its canary catches a
stale one, and the preflight holds a bf16 engine to a plain bf16 forward's error."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from grpolab.model.policy import build_char_tokenizer, build_tiny_model
from grpolab.model.precision import (
    CPU_FLOAT32_ATTENTION_MAX_KEYS,
    Precision,
    autocast,
    cached_cast,
    checkpoint_contexts,
    forget_casts_on_step,
)
from grpolab.rollout.base import SamplingParams
from grpolab.rollout.common import WeightSyncError
from grpolab.rollout.hf import HFEngine

BF16 = Precision("bf16", "test")
CPU = torch.device("cpu")


def mlp(frozen_first: bool) -> torch.nn.Sequential:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8))
    net[0].weight.requires_grad_(not frozen_first)
    return net


def forward_and_grads(net, x, context):
    """Output and every trained parameter's gradient of a forward under `context`."""
    net.zero_grad(set_to_none=True)
    with context:
        out = net(x)
    out.float().square().sum().backward()
    return out.detach(), [p.grad.clone() for p in net.parameters() if p.requires_grad]


@pytest.mark.parametrize("frozen_first", [False, True])
def test_cached_copies_give_autocasts_values_and_gradients_exactly(frozen_first):
    net, x = mlp(frozen_first), torch.randn(3, 5, 24)
    plain = forward_and_grads(net, x, torch.autocast("cpu", dtype=torch.bfloat16))
    for _ in range(2):  # the second forward reads the cached copies
        cached = forward_and_grads(net, x, autocast(BF16, CPU))
        assert cached[0].dtype == torch.bfloat16
        # The same round-to-nearest cast of the same float32 weights, the same kernels.
        assert torch.equal(cached[0], plain[0])
        for a, b in zip(cached[1], plain[1], strict=True):
            assert a.dtype == torch.float32 and torch.equal(a, b)


def test_cached_copies_follow_a_fused_optimizer_step_and_a_load():
    net, x = mlp(frozen_first=True), torch.randn(4, 24)
    trained = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=0.1, fused=True)  # writes without a version bump
    forget_casts_on_step(optimizer)
    forward_and_grads(net, x, autocast(BF16, CPU))
    optimizer.step()
    net[0].weight.data.zero_()  # a frozen weight written where no version counter sees it...
    net.load_state_dict({k: v.clone() for k, v in net.state_dict().items()})  # ...then a load
    after = forward_and_grads(net, x, autocast(BF16, CPU))
    fresh = forward_and_grads(net, x, torch.autocast("cpu", dtype=torch.bfloat16))
    assert torch.equal(after[0], fresh[0])
    assert torch.equal(cached_cast(net[2].weight, torch.bfloat16), net[2].weight.bfloat16())


def test_short_attention_runs_in_float32_on_the_cpu_and_long_attention_in_bf16():
    for keys in (16, CPU_FLOAT32_ATTENTION_MAX_KEYS + 1):
        q, k, v = (torch.randn(2, 3, keys, 32).bfloat16() for _ in range(3))
        with autocast(BF16, CPU):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if keys <= CPU_FLOAT32_ATTENTION_MAX_KEYS:
            expected = F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), is_causal=True
            )
            assert out.dtype == torch.float32 and torch.equal(out, expected)
        else:
            assert out.dtype == torch.bfloat16


def test_a_strided_input_reads_the_head_without_expanding_it():
    """The last position of [n, P, H] (what a prefill keeps) gives the contiguous result."""
    head, hidden = torch.nn.Linear(24, 300, bias=False), torch.randn(4, 7, 24)
    with autocast(BF16, CPU):
        strided = head(hidden[:, -1:])
        dense = head(hidden[:, -1:].contiguous())
    assert torch.equal(strided, dense)


def tiny_engine():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    return model, tokenizer, HFEngine(model, tokenizer, precision=BF16)


def test_the_hf_engine_samples_in_bf16_and_its_canary_catches_a_stale_copy():
    model, _, engine = tiny_engine()
    rollout = engine.generate(["12+34=", "7*8="], 4, SamplingParams(max_completion_length=6))
    assert rollout.engine_logprobs is not None and torch.isfinite(rollout.engine_logprobs).all()
    engine.sync_weights(model)
    assert engine.last_sync_gap == 0.0  # current copies: the same values as a fresh cast
    # An update that no version counter or optimizer hook saw (through .data): the copies
    # are stale, the canary says so, and a sync (which drops the trained copies) repairs it.
    with torch.no_grad():
        for p in model.parameters():
            p.data.mul_(1.5)
    with pytest.raises(WeightSyncError, match="stale bf16 copy"):
        engine.check_sync(model)
    engine.sync_weights(model)
    assert engine.last_sync_gap == 0.0


@pytest.mark.slow
def test_preflight_passes_in_bf16_and_holds_the_engine_to_plain_bf16(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "grpolab", "preflight", "--json", "runtime.precision=bf16",
         "rollout.max_completion_length=6", "batch.num_generations=4"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    checks = {c["id"]: c for c in json.loads(out.stdout)["checks"]}
    agreement = checks["engine.agreement"]
    assert "plain bf16 autocast forward" in agreement["expected"]
    assert agreement["measured"] > 0  # a bf16 engine against the float32 trainer: not exact


def tiny_qwen2(tokenizer) -> torch.nn.Module:
    """A tiny Qwen2: its q, k and v projections have biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def lora_engine(family: str = "llama"):
    """A tiny LoRA model whose adapters are not zero (peft starts B at 0), its bf16 engine."""
    pytest.importorskip("peft")
    from grpolab.config import load_config
    from grpolab.model.lora import wrap_lora

    model, tokenizer, _ = tiny_engine()
    if family == "qwen2":
        model = tiny_qwen2(tokenizer)
    model = wrap_lora(model, load_config(None, ["lora.r=4"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return model, tokenizer, HFEngine(model, tokenizer, precision=BF16)


def canary_logprobs(model, ids, context) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    with torch.no_grad(), context:
        logits = model(input_ids=input_ids).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, input_ids[0, 1:, None])[:, 0]


def test_a_lora_engine_samples_from_merged_bf16_copies_as_close_to_float64_as_plain_bf16():
    """Under bf16 a LoRA model's engine multiplies bf16(W + scaling * B @ A), one matmul per
    linear: each copy is that sum rounded once, its log-probs no further from the float64
    model's than the trainer's own bf16 forward is (the preflight's bound), the adapters are
    back on afterwards, and fp32 merges nothing."""
    import copy

    from grpolab.checks.tolerance import precision_tolerance
    from grpolab.model.lora import lora_layers

    model, tokenizer, engine = lora_engine()
    copies = engine.merged_copies(model)
    layers = [layer for _, layer in lora_layers(model)]
    assert copies is not None and len(copies) == len(layers) > 0
    for layer in layers:
        (adapter,) = layer.active_adapters
        exact = layer.base_layer.weight.double() + layer.scaling[adapter] * (
            layer.lora_B[adapter].weight.double() @ layer.lora_A[adapter].weight.double()
        )
        copy_ = copies[layer.base_layer.weight]
        assert copy_.dtype == torch.bfloat16
        # One rounding to bf16 (half an ulp), after float32 arithmetic (a few float32 ulps).
        ulp = torch.finfo(torch.bfloat16).eps * exact.abs()
        assert ((copy_.double() - exact).abs() <= ulp + 1e-6 * exact.abs().max()).all()

    ids = list(tokenizer("12+34=46 and 7*8=56", add_special_tokens=True)["input_ids"])
    reference = canary_logprobs(copy.deepcopy(model).double(), ids, contextlib.nullcontext())
    plain = canary_logprobs(model, ids, autocast(BF16, CPU))
    merged = canary_logprobs(model, ids, engine.sampling_context())
    plain_err = float((plain - reference).abs().max())
    merged_err = float((merged - reference).abs().max())
    assert merged_err > 0  # bf16 copies: not the float64 model
    bound = precision_tolerance(plain_err, float(reference.abs().max()), torch.bfloat16)
    assert merged_err <= bound, (merged_err, plain_err)
    assert not any(layer.disable_adapters for layer in layers)  # the adapters back on
    engine.generate(["12+34="], 2, SamplingParams(max_completion_length=4))
    assert not any(layer.disable_adapters for layer in layers)
    assert HFEngine(model, tokenizer).merged_copies(model) is None  # fp32: nothing merged


def lora_gradients(model, ids: torch.Tensor, context) -> dict[str, torch.Tensor]:
    """Each adapter weight's gradient (float64) of a signed sum of the tokens' log-probs, as
    GRPO's loss weighs them, from a forward under `context`."""
    model.zero_grad(set_to_none=True)
    signs = torch.linspace(-1, 1, ids.shape[1] - 1, dtype=torch.float64)
    with context:
        logits = model(input_ids=ids).logits[0, :-1]
    logp = torch.log_softmax(logits.double(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    (logp * signs).sum().backward()
    return {n: p.grad.double() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_lora_models_bf16_forward_trains_through_the_engines_merged_copies(family):
    """Under bf16 a run's LoRA layer multiplies bf16(W + scaling * B @ A), the very copy the
    engine samples from (one matmul forward, one for the input's gradient); the adapters'
    gradients are no further from float64's than peft's own bf16 path (the preflight's
    bound); gradient checkpointing recomputes the same forward; fp32 runs peft's forward."""
    import copy

    from grpolab.checks.tolerance import precision_tolerance
    from grpolab.model.lora import forward_through_merged_weights, lora_layers, merged_bf16

    model, tokenizer, engine = lora_engine(family)
    peft_path = copy.deepcopy(model)
    assert forward_through_merged_weights(model) == len(list(lora_layers(model))) > 0
    model.train()  # dropout 0: the merged path trains too
    name, layer = next(iter(lora_layers(model)))
    x = torch.randn(2, 5, layer.base_layer.in_features, generator=torch.Generator().manual_seed(2))
    with autocast(BF16, CPU):
        y = layer(x)
    copies = engine.merged_copies(model)
    assert copies[layer.base_layer.weight] is merged_bf16(layer)  # one copy for both
    bias = layer.base_layer.bias  # Qwen2's q/k/v have one, cast as autocast casts it
    assert (bias is not None) == (family == "qwen2")
    low_bias = None if bias is None else bias.to(torch.bfloat16)
    assert torch.equal(y, F.linear(x.to(torch.bfloat16), merged_bf16(layer), low_bias))
    with torch.no_grad():
        assert torch.equal(layer(x), peft_path.get_submodule(f"base_model.model.{name}")(x))
        # a copy (the preflight's float64 one) runs its own layers, not the original's
        twin = dict(lora_layers(copy.deepcopy(model).double()))[name]
        assert twin.forward.args[0] is twin and twin(x.double()).dtype == torch.float64

    ids = torch.tensor([tokenizer("12+34=46 and 7*8=56 so 9-4=5")["input_ids"]])
    reference = lora_gradients(copy.deepcopy(peft_path).double(), ids, contextlib.nullcontext())
    peft_bf16 = lora_gradients(peft_path, ids, autocast(BF16, CPU))
    merged = lora_gradients(model, ids, autocast(BF16, CPU))
    assert reference.keys() == merged.keys() == peft_bf16.keys()
    for key, exact in reference.items():
        largest = float(exact.abs().max())
        peft_err = float((peft_bf16[key] - exact).abs().max())
        merged_err = float((merged[key] - exact).abs().max())
        assert merged_err <= precision_tolerance(peft_err, largest, torch.bfloat16), key
    checkpointing = {"use_reentrant": False, "context_fn": checkpoint_contexts}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    recomputed = lora_gradients(model, ids, autocast(BF16, CPU))
    assert all(torch.equal(recomputed[k], merged[k]) for k in merged)


def test_the_merged_forward_is_taken_only_where_it_computes_what_peft_would():
    """bf16 autocast, adapters on, no active dropout, a frozen base: elsewhere peft's own
    forward (fp32, adapters switched off, dropout while training, a trained base)."""
    from grpolab.model.lora import forward_through_merged_weights, lora_layers, merged_adapter

    model, _, _ = lora_engine()
    forward_through_merged_weights(model)
    _, layer = next(iter(lora_layers(model)))
    x = torch.randn(3, layer.base_layer.in_features)

    def applies(layer, x) -> bool:
        return merged_adapter(layer, x) is not None

    assert not applies(layer, x)  # no autocast: fp32
    with autocast(BF16, CPU):
        assert applies(layer, x)
        with model.disable_adapter():
            assert not applies(layer, x)
        (adapter,) = layer.active_adapters
        layer.lora_dropout[adapter] = torch.nn.Dropout(0.1)
        assert applies(layer.eval(), x) and not applies(layer.train(), x)
        layer.lora_dropout[adapter] = torch.nn.Identity()
        layer.base_layer.weight.requires_grad_(True)
        assert not applies(layer, x)


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_under_bf16_recomputes_the_forward_it_ran(lora):
    """A checkpointed layer's recompute runs under the forward's bf16 region (float32 short
    attention on the CPU, the cached and merged weight copies), not under autocast alone:
    the gradients equal those without checkpointing, where a bf16 recompute of a float32
    attention was refused by the checkpoint (a bf16 run with gradient_checkpointing failed)."""
    from grpolab.config import load_config
    from grpolab.model.dist import Dist
    from grpolab.train.setup import prepare_model

    tokenizer = build_char_tokenizer()
    ids = torch.tensor([tokenizer("12+34=46 and 7*8=56 so 9-4=5")["input_ids"]])
    grads = []
    for checkpointing in (False, True):
        overrides = [f"runtime.gradient_checkpointing={checkpointing}", f"lora.r={4 * lora}"]
        cfg = load_config(None, overrides)
        torch.manual_seed(0)  # the same adapters
        model, _ = prepare_model(build_tiny_model(tokenizer, seed=0), cfg, Dist())
        grads.append(lora_gradients(model.train(), ids, autocast(BF16, CPU)))
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def test_a_lora_engines_merged_copies_follow_each_update_and_the_canary_catches_a_stale_one():
    model, _, engine = lora_engine()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=0.1)
    forget_casts_on_step(optimizer)
    engine.sync_weights(model)
    assert engine.last_sync_gap == 0.0
    before = {id(w): c.clone() for w, c in engine.merged_copies(model).items()}
    sum(p.sum() for p in trained).backward()
    optimizer.step()  # fused or not, the hook marks every copy stale
    after = engine.merged_copies(model)
    assert all(not torch.equal(before[id(w)], c) for w, c in after.items())
    engine.sync_weights(model)
    assert engine.last_sync_gap == 0.0
    loaded = {id(w): c.clone() for w, c in engine.merged_copies(model).items()}
    with torch.no_grad():  # a write that moves the version counters (a load): remade
        for p in trained:
            p.add_(0.5)
    assert any(not torch.equal(loaded[id(w)], c) for w, c in engine.merged_copies(model).items())
    assert engine.check_sync(model) == 0.0
    with torch.no_grad():  # an update nothing saw: the merged copies are stale
        for p in trained:
            p.data.mul_(1.5)
    with pytest.raises(WeightSyncError, match="stale bf16 copy"):
        engine.check_sync(model)
    engine.sync_weights(model)
    assert engine.last_sync_gap == 0.0
