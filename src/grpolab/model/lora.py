"""LoRA in one place: the adapters a run trains (peft's LoraConfig from trainer.lora_*),
wrapping a model in them, restoring them from a checkpoint, and the merged weights
(W + scaling * B @ A) every engine samples from and the bf16 forwards multiply. peft is an
optional dependency: nothing here imports it before it is needed."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from grpolab.model.policy import base_model
from grpolab.model.precision import casting_afresh, casts_forgotten


def lora_config(cfg):
    """peft's LoraConfig for the `lora` section: the adapters grpolab trains (and what a peer
    trainer is given to train the same ones)."""
    t = cfg.lora
    try:
        from peft import LoraConfig
    except ImportError as e:
        raise ImportError(f"lora.r={t.r} needs peft: pip install 'grpolab[lora]'") from e
    return LoraConfig(
        r=t.r,
        lora_alpha=t.alpha,
        lora_dropout=t.dropout,
        target_modules=list(t.target_modules),
        task_type="CAUSAL_LM",
    )


def wrap_lora(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """`model` with LoRA adapters on lora.target_modules; only they are trainable."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(cfg))


def load_lora_adapter(model: torch.nn.Module, checkpoint_dir: Path, adapter_dir: str) -> None:
    """Restore the adapter weights a LoRA checkpoint holds in adapter/."""
    from peft import load_peft_weights, set_peft_model_state_dict

    adapter = checkpoint_dir / adapter_dir
    if not adapter.is_dir():
        raise ValueError(
            f"--resume {str(checkpoint_dir)!r}: no {adapter_dir}/ there (a full fine-tuning "
            "checkpoint); resume it with lora.r=0"
        )
    result = set_peft_model_state_dict(model, load_peft_weights(str(adapter)))
    if result.unexpected_keys:
        raise ValueError(
            f"--resume {str(checkpoint_dir)!r}: its adapter does not match trainer.lora_* "
            f"(unexpected {result.unexpected_keys[:3]})"
        )


def is_lora(model: torch.nn.Module) -> bool:
    """A peft model (checked without importing peft, an optional dependency)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def all_lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name under the base model, layer) of each peft LoRA layer, in any state."""
    for name, module in base_model(model).named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
            yield name, module


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name under the base model, layer) of each peft LoRA layer whose adapters act on its
    base layer's output (not merged into it, not switched off)."""
    for name, module in all_lora_layers(model):
        if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
            continue  # already inside the base weight / switched off
        yield name, module


def merged_lora_weight(layer: torch.nn.Module) -> torch.Tensor:
    """A LoRA layer's base weight with its active adapters added (W + scaling * B @ A each,
    computed aside: the trained layer is not touched) [out, in]."""
    weight = layer.base_layer.weight.detach()
    for adapter in layer.active_adapters:
        weight = weight + layer.get_delta_weight(adapter).detach()
    return weight


def plain_lora(layer: torch.nn.Module) -> bool:
    """A LoRA layer whose output is exactly base_layer(x) + sum of scaling * B(A(x)) in eval
    mode, so merging it changes no value beyond rounding (no DoRA or other variant, no
    adapter bias, a linear base)."""
    return (
        isinstance(layer.base_layer, torch.nn.Linear)
        and not getattr(layer, "lora_variant", {})
        and not any(getattr(layer, "lora_bias", {}).values())
        and not getattr(layer, "fan_in_fan_out", False)
    )


# --- bf16 forwards through the merged weight --------------------------------------------------
# Under bf16 a LoRA layer as peft runs it is three matmuls and two elementwise passes forward
# (W x, then B (A x) scaled and added) and five matmuls backward, two of them skinny (rank
# r) ones over every position: on a CPU those are memory-bound, a few % of the FLOPs and ~10 %
# of the update. Through bf16(W + scaling * B @ A) -- the copy the hf engine samples from,
# made once per optimizer step -- the forward is one matmul and the input's gradient one; A
# and B get their gradients from four rank-r matmuls. The trainer's forward then multiplies
# exactly the weights the engine sampled with.


def merged_bf16(layer: torch.nn.Module, fresh: bool = False) -> torch.Tensor:
    """bf16(W + its adapters) of a LoRA layer [out, in], made once and reused while its
    weights are unchanged: their versions, and for trained ones until an optimizer step
    (`casts_forgotten`: a fused AdamW moves no version counter). fresh: made anew, not kept."""
    if fresh:
        with torch.no_grad():
            return merged_lora_weight(layer).to(torch.bfloat16)
    made_of = (casts_forgotten(), *((p._version, p.data_ptr()) for p in layer.parameters()))
    hit = _MERGED.get(layer)
    if hit is None or hit[0] != made_of:
        with torch.no_grad():
            hit = (made_of, merged_lora_weight(layer).to(torch.bfloat16))
        _MERGED[layer] = hit
    return hit[1]


_MERGED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # layer -> (made_of, bf16 copy)


class _MergedLinear(torch.autograd.Function):
    """x [..., in] -> x @ merged^T (+ bias) [..., out] in bf16, merged = bf16(W + s B A) with
    W frozen. Backward: the input's gradient through `merged`; A's and B's, the same bf16
    matmuls autocast runs for peft's path, returned in their own dtype:
        u = x A^T [N, r],  g = dy B [N, r],  dB = s dy^T u,  dA = s g^T x."""

    @staticmethod
    def forward(ctx, x, merged, bias, a, b, scaling: float):
        low = x.to(torch.bfloat16)
        ctx.save_for_backward(low, merged, a, b)
        ctx.scaling, ctx.input_dtype = scaling, x.dtype
        return F.linear(low, merged, None if bias is None else bias.to(torch.bfloat16))

    @staticmethod
    def backward(ctx, dy):
        low, merged, a, b = ctx.saved_tensors
        dy = dy.to(torch.bfloat16)
        dx = (dy @ merged).to(ctx.input_dtype) if ctx.needs_input_grad[0] else None
        x2, dy2 = low.reshape(-1, low.shape[-1]), dy.reshape(-1, dy.shape[-1])  # [N, in|out]
        a_low, b_low = a.to(torch.bfloat16), b.to(torch.bfloat16)
        u, g = x2 @ a_low.t(), dy2 @ b_low  # [N, r] each
        db = (dy2.t() @ u).to(b.dtype) * ctx.scaling  # [out, r]
        da = (g.t() @ x2).to(a.dtype) * ctx.scaling  # [r, in]
        return dx, None, None, da, db, None


def merged_adapter(layer: torch.nn.Module, x: torch.Tensor) -> str | None:
    """The adapter through whose merged bf16 weight `layer`'s forward on x runs, or None
    (peft's own forward): a bf16 autocast region, one active plain adapter without active
    dropout, a frozen plain base (not sharded, not compiled: a compiled graph keeps peft's
    path)."""
    if torch.compiler.is_compiling() or not x.is_floating_point():
        return None
    device = x.device.type
    if not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) != torch.bfloat16:
        return None
    if layer.disable_adapters or layer.merged or not plain_lora(layer):
        return None
    adapters = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(adapters) != 1:
        return None
    dropout = layer.lora_dropout[adapters[0]]
    if layer.training and isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
        return None
    base = layer.base_layer
    frozen = [base.weight] + ([base.bias] if base.bias is not None else [])
    plain = (torch.Tensor, torch.nn.Parameter)  # not a shard
    return adapters[0] if all(type(p) in plain and not p.requires_grad for p in frozen) else None


def _merged_or_peft(layer: torch.nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    adapter = None if args or kwargs else merged_adapter(layer, x)
    if adapter is None:
        return type(layer).forward(layer, x, *args, **kwargs)
    return _MergedLinear.apply(
        x,
        merged_bf16(layer, fresh=casting_afresh()),
        layer.base_layer.bias,
        layer.lora_A[adapter].weight,
        layer.lora_B[adapter].weight,
        layer.scaling[adapter],
    )


def forward_through_merged_weights(model: torch.nn.Module) -> int:
    """Make each plain LoRA layer of `model` run its bf16 forwards through `merged_bf16`
    (peft's own forward everywhere else: fp32, adapters off or merged, dropout). Returns the
    number of layers."""
    layers = [layer for _, layer in all_lora_layers(model) if plain_lora(layer)]
    for layer in layers:
        layer.forward = functools.partial(_merged_or_peft, layer)
    return len(layers)
