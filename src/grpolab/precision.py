"""The training and rollout precision: fp32, or bf16 matmuls over float32 master weights.

`trainer.precision`:
    fp32  every forward, backward and sample in float32 (the model's dtype)
    bf16  the training forwards' matmuls (loss, old and reference log-probs) in bfloat16
          under autocast; weights, gradients, AdamW state and every log-softmax stay float32.
          The rollout engine samples in the model's own dtype (model.dtype).
    auto  bf16 where the device has bf16 matrix units, fp32 elsewhere

bf16 pays only where the hardware multiplies bf16 natively: a CUDA GPU with bf16 (Ampere and
later), or a CPU with AMX tiles (Intel Sapphire Rapids and later), where a bf16 matmul runs
~10x a float32 one. Elsewhere (AVX2 or AVX-512 without AMX) bf16 is converted to float32 for
each matmul and runs slower than fp32, so `auto` must pick fp32 there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class Precision:
    name: str  # "fp32" or "bf16": what runs
    reason: str  # why, for the objective card

    @property
    def bf16(self) -> bool:
        return self.name == "bf16"


FP32 = Precision("fp32", "trainer.precision=fp32")


def bf16_matrix_units(device: torch.device) -> tuple[bool, str]:
    """(whether `device` multiplies bf16 matrices natively, what was found)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{torch.cuda.get_device_name(device)} has bf16 tensor cores"
        return False, f"{torch.cuda.get_device_name(device)} has no native bf16"
    if device.type == "cpu":
        amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
        if amx is not None and amx():
            return True, "the CPU has AMX bf16 tiles"
        return False, "the CPU has no AMX tiles (bf16 would be emulated in float32, slower)"
    return False, f"no bf16 detection for device type {device.type!r}"


def resolve_precision(setting: str, device: torch.device) -> Precision:
    """What trainer.precision=`setting` runs on `device`, and why."""
    if setting == "fp32":
        return FP32
    if setting == "bf16":
        return Precision("bf16", "trainer.precision=bf16")
    native, found = bf16_matrix_units(device)
    return Precision("bf16" if native else "fp32", f"auto: {found}")


def autocast(precision: Precision, device: torch.device):
    """bf16 matmuls for a forward (weights and optimizer stay in the model's dtype), or
    nothing under fp32."""
    if not precision.bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
