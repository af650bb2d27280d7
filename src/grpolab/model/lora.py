"""LoRA in one place: the adapters a run trains (peft's LoraConfig from trainer.lora_*),
wrapping a model in them, restoring them from a checkpoint, and the merged weights
(W + scaling * B @ A) every engine samples from. peft is an optional dependency: nothing
here imports it before it is needed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from grpolab.model.policy import base_model


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


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name under the base model, layer) of each peft LoRA layer whose adapters act on its
    base layer's output (not merged into it, not switched off)."""
    for name, module in base_model(model).named_modules():
        if not (hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")):
            continue
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
