"""The training and rollout precision: fp32, or bf16 matmuls over float32 master weights.

`runtime.precision`:
    fp32  every forward, backward and sample in float32 (the model's dtype)
    bf16  the training forwards' matmuls (loss, old and reference log-probs) in bfloat16
          under autocast; weights, gradients, AdamW state and every log-softmax stay float32.
          The rollout engine samples in the model's own dtype (model.dtype).
    auto  bf16 where the device multiplies bf16 natively, fp32 elsewhere

bf16 pays only where the hardware multiplies bf16 natively: a CUDA GPU with bf16 (Ampere and
later), a CPU with AMX tiles (Intel Sapphire Rapids and later: a bf16 matmul ~6-10x a float32
one) or with AVX512-BF16 dot products (AMD Zen 4 and later, Intel Cooper Lake: ~4-7x, measured
in bench/README.md). Elsewhere (AVX2, or AVX-512 without BF16) bf16 is converted to float32 for
each matmul and runs slower than fp32, so `auto` must pick fp32 there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class Precision:
    name: str  # "fp32" or "bf16": what runs
    reason: str  # why, for the objective card

    @property
    def bf16(self) -> bool:
        return self.name == "bf16"


FP32 = Precision("fp32", "runtime.precision=fp32")


def bf16_matrix_units(device: torch.device) -> tuple[bool, str]:
    """(whether `device` multiplies bf16 matrices natively, what was found)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{torch.cuda.get_device_name(device)} has bf16 tensor cores"
        return False, f"{torch.cuda.get_device_name(device)} has no native bf16"
    if device.type == "cpu":
        if _cpu_has("_is_amx_tile_supported"):
            return True, "the CPU has AMX bf16 tiles"
        if _cpu_has("_is_avx512_bf16_supported"):
            return True, "the CPU has AVX512-BF16 dot products"
        return False, "the CPU has neither AMX nor AVX512-BF16 (bf16 would be emulated, slower)"
    return False, f"no bf16 detection for device type {device.type!r}"


def _cpu_has(probe: str) -> bool:
    found = getattr(torch.cpu, probe, None)  # private probes: absent in some torch builds
    return bool(found is not None and found())


def resolve_precision(setting: str, device: torch.device) -> Precision:
    """What runtime.precision=`setting` runs on `device`, and why."""
    if setting == "fp32":
        return FP32
    if setting == "bf16":
        return Precision("bf16", "runtime.precision=bf16")
    native, found = bf16_matrix_units(device)
    return Precision("bf16" if native else "fp32", f"auto: {found}")


def autocast(
    precision: Precision,
    device: torch.device,
    cached: bool = True,
    substitutes: WeakIdKeyDictionary | None = None,
):
    """bf16 matmuls for a forward (weights and optimizer stay in the model's dtype, each
    linear weight's bf16 copy cached: `cached_cast`), or nothing under fp32. cached=False:
    every weight cast afresh, the same values when the copies are current (the canary's
    reference). `substitutes`: weight -> the bf16 tensor a linear on it multiplies instead
    (the rollout engine's LoRA-merged copies)."""
    if not precision.bf16:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device_type=device.type, dtype=torch.bfloat16))
    stack.enter_context(_Bf16Forward(torch.bfloat16, device.type, cached, substitutes))
    return stack


# --- One bf16 copy per weight, not one per matmul ---------------------------------------------
# Autocast casts a float32 weight to bf16 inside every matmul that reads it, and keeps the
# cast only for the forward it is in, and never for a frozen weight: LoRA's frozen base was
# cast again in every micro-batch, and the tied 49k x 576 head too; on SmolLM2 those casts
# were 45 % of the update. Here each weight is cast once and reused until it changes: a
# frozen weight until something writes it (a load bumps its version counter), a trained one
# until the optimizer steps (`forget_casts_on_step`: a fused AdamW writes its parameters
# without bumping the counter). The values are the ones autocast would compute: the same
# round-to-nearest cast of the same float32 weight.

_CASTS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> ((version, ptr, dtype), copy)
_FORGOTTEN = [0]  # how many times copies were dropped: a copy made before a drop is stale


class _CastKeepingGradient(torch.autograd.Function):
    """`low` (the cached copy of `weight`) in the forward; the gradient back to `weight` in
    its own dtype, as autocast's cast would."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return low.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def cached_cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` in `dtype`, cast once and reused while `weight` is unchanged. Only plain
    leaf tensors are cached (a sharded or computed weight is cast as usual)."""
    if weight.dtype == dtype or type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return weight.to(dtype)
    if not weight.is_leaf:
        return weight.to(dtype)
    key = (weight._version, weight.data_ptr(), dtype)
    hit = _CASTS.get(weight)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = (key, weight.detach().to(dtype))
        _CASTS[weight] = hit
    if weight.requires_grad and torch.is_grad_enabled():
        return _CastKeepingGradient.apply(weight, hit[1])
    return hit[1]


def forget_casts(params) -> None:
    """Drop the cached copies of `params` (after an update wrote them)."""
    _FORGOTTEN[0] += 1
    for p in params:
        _CASTS.pop(p, None)


def casts_forgotten() -> int:
    """A counter that moves whenever `forget_casts` runs: a copy derived from weights (the
    engine's merged ones) is current while the counter is where it was when it was made."""
    return _FORGOTTEN[0]


def forget_casts_on_step(optimizer: torch.optim.Optimizer) -> None:
    """After every `optimizer.step()`, drop the copies of the parameters it updated."""

    def hook(opt, args, kwargs):
        for group in opt.param_groups:
            forget_casts(group["params"])

    optimizer.register_step_post_hook(hook)


# The CPU's bf16 attention kernel (forward and backward) is slower than its float32 one
# below a few hundred keys (bench/precision.py measures it: 3.6x slower at 61 keys, 1.4x
# slower at 128, 1.5x faster at 512), while its FLOPs there are a few % of the layer's: short
# attention on the CPU runs in float32.
CPU_FLOAT32_ATTENTION_MAX_KEYS = 256


def float32_attention(keys: int, device: torch.device) -> bool:
    """Whether attention over `keys` keys runs in float32 under the bf16 autocast on
    `device`: short attention on a CPU (CPU_FLOAT32_ATTENTION_MAX_KEYS)."""
    return (
        device.type == "cpu"
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and keys <= CPU_FLOAT32_ATTENTION_MAX_KEYS
    )


_OPEN: list[_Bf16Forward] = []  # the bf16 regions open now, innermost last


def casting_afresh() -> bool:
    """Whether a bf16 region that casts every weight afresh (cached=False) is open: a copy
    derived from weights (a LoRA-merged one) must be made anew there too."""
    return any(not mode.cached for mode in _OPEN)


def checkpoint_contexts():
    """torch.utils.checkpoint's context_fn: the recompute of a checkpointed layer runs under
    the bf16 region its forward ran under. Checkpointing restores autocast but not a
    TorchFunctionMode: without this, short attention on the CPU recomputes in bf16 where its
    forward ran in float32, and the checkpoint refuses the mismatch."""
    if not _OPEN:
        return contextlib.nullcontext(), contextlib.nullcontext()
    mode = _OPEN[-1]
    again = _Bf16Forward(mode.dtype, mode.device_type, mode.cached, mode.substitutes)
    return contextlib.nullcontext(), again


class _Bf16Forward(TorchFunctionMode):
    """Inside a bf16 autocast region: every `F.linear` on a float32 weight reads its cached
    `dtype` copy (autocast then casts only the activations), and short attention on the CPU
    runs in float32."""

    def __init__(self, dtype, device_type: str, cached: bool = True, substitutes=None):
        super().__init__()
        self.dtype, self.device_type, self.cached = dtype, device_type, cached
        self.substitutes = substitutes

    def __enter__(self):
        _OPEN.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _OPEN.remove(self)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_autocast_enabled(self.device_type):  # a region that turned it off
            return func(*args, **kwargs)
        if func is torch._C._nn.linear:
            args, kwargs = _linear_args(args, kwargs, self.dtype, self.cached, self.substitutes)
        elif func is torch._C._nn.scaled_dot_product_attention and self._short_on_cpu(args):
            with torch.autocast(self.device_type, enabled=False):  # masks too, if additive
                return func(*map(_float32, args), **{n: _float32(a) for n, a in kwargs.items()})
        return func(*args, **kwargs)

    def _short_on_cpu(self, args: tuple) -> bool:
        return (
            self.device_type == "cpu"
            and len(args) >= 3
            and args[1].dim() >= 2
            and args[1].shape[-2] <= CPU_FLOAT32_ATTENTION_MAX_KEYS
        )


def _float32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value


def _linear_args(args: tuple, kwargs: dict, dtype: torch.dtype, cached: bool, substitutes):
    # A strided input (the last position's hidden states, [n, 1, H] of [n, P, H]) would make
    # matmul expand the weight to [n, H, V] and copy it (1 s for a 49k-token head); autocast
    # copies the input anyway, so contiguous first costs nothing.
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 3:
        args = (args[0].contiguous(), *args[1:])
    positional = len(args) >= 2
    weight = args[1] if positional else kwargs.get("weight")
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32:
        return args, kwargs
    if substitutes is not None and weight in substitutes:
        low = substitutes[weight]
    elif cached:
        low = cached_cast(weight, dtype)
    else:
        return args, kwargs
    if positional:
        return (args[0], low, *args[2:]), kwargs
    return args, {**kwargs, "weight": low}
