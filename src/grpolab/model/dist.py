"""Data parallel across processes started by torchrun: init, rank helpers, reductions, and
the two ways of holding the model (`ddp`: a full replica per rank under torch's
DistributedDataParallel, gradients summed in buckets during the last micro-batch's backward;
`fsdp`: FSDP2 `fully_shard` on each decoder layer and the root). Gradients are SUMMED across
ranks: the loss normaliser is global (see `step.optimizer_step`, `core.micro_batch_scale`), so
the sum is the single-process gradient of the same global batch.
Every helper is total: on one process it does the one-process thing, so callers need no
"if distributed" branch."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    mode: str = "none"  # none | ddp | fsdp

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def on(self) -> bool:
        return self.world > 1


def launched() -> bool:
    """Started by torchrun (or any launcher that sets WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(mode: str, device: torch.device) -> Dist:
    """Join the process group torchrun describes (gloo on CPU, nccl on CUDA); a single
    process without torchrun is Dist() and touches nothing."""
    if not launched():
        return Dist()
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return Dist(dist.get_rank(), dist.get_world_size(), mode)


def local_device(device: torch.device) -> torch.device:
    """cuda -> this rank's GPU (LOCAL_RANK); anything else unchanged."""
    if device.type == "cuda" and launched() and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_slice(n: int, d: Dist) -> slice:
    """This rank's contiguous share of n items (n divisible by the world size)."""
    per = n // d.world
    return slice(d.rank * per, (d.rank + 1) * per)


def all_sum(x: float | torch.Tensor, d: Dist) -> float:
    """Sum of a scalar over ranks (the scalar itself on one process)."""
    t = torch.as_tensor(x, dtype=torch.float64).detach().clone().cpu().reshape(())
    if d.on:
        t = _on_comm_device(t)
        dist.all_reduce(t)
    return float(t)


def any_rank(flag: bool, d: Dist) -> bool:
    return all_sum(float(flag), d) > 0


def all_gather_cat(x: torch.Tensor, d: Dist) -> torch.Tensor:
    """Concatenation along dim 0 of every rank's tensor (equal shapes), in rank order."""
    if not d.on:
        return x
    y = _on_comm_device(x.contiguous())
    parts = [torch.empty_like(y) for _ in range(d.world)]
    dist.all_gather(parts, y)
    return torch.cat(parts).to(x.device)


def all_gather_varying(x: torch.Tensor, d: Dist) -> torch.Tensor:
    """Concatenation of every rank's 1-D tensor (lengths may differ), in rank order."""
    if not d.on:
        return x
    parts = all_gather_objects(x.detach().cpu(), d)
    return torch.cat(parts).to(x.device)


def all_gather_objects(obj, d: Dist) -> list:
    if not d.on:
        return [obj]
    out = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


def mean_metrics(metrics: dict[str, float], d: Dist) -> dict[str, float]:
    """Each numeric metric averaged over ranks (equal local batches: exact for means)."""
    if not d.on:
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
    t = _on_comm_device(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64))
    dist.all_reduce(t)
    out = dict(metrics)
    for k, v in zip(keys, (t / d.world).tolist(), strict=True):
        out[k] = v
    return out


def max_metrics(metrics: dict[str, float], d: Dist) -> dict[str, float]:
    """Each metric's maximum over ranks (for worst-case quantities such as |ratio - 1|)."""
    if not d.on or not metrics:
        return metrics
    keys = sorted(metrics)
    t = _on_comm_device(torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist(), strict=True))


class TrainForward(torch.nn.Module):
    """The forward whose log-probs get gradients, as a module DDP can wrap: `forward(fn,
    ...)` is `fn(model, ...)` (the run's sequence_logprobs, which may call the inner decoder
    and the head's weight itself rather than the model's own forward). The model is its one
    submodule, so DDP's parameters are the model's own, and every call goes through DDP's
    forward, which prepares its reducer for the backward that follows."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        # Layer parts compiled by runtime.torch_compile compile here, inside DDP's forward,
        # where Dynamo would cut each of them at DDP's bucket boundaries (its DDPOptimizer,
        # made for a whole compiled DDP module, fails on buckets smaller than a part). They
        # are small leaf modules, and DDP's reducer still starts a bucket as soon as the
        # backward of the parts holding it is done: compile them whole, as on one process.
        with torch._dynamo.config.patch(optimize_ddp=False):
            return fn(self.model, *args, **kwargs)


def replicate(model: torch.nn.Module, bucket_mb: float):
    """`ddp`: torch's DistributedDataParallel around `TrainForward(model)`, its gradients
    SUMMED over ranks (`sum_hook`). Construction broadcasts rank 0's parameters and buffers.
    Buckets of `bucket_mb` MiB in reverse parameter order; during a synced backward each
    bucket's all-reduce starts as soon as its gradients are final.

    find_unused_parameters: a trainable parameter that this rank's forward did not reach (a
    mixture-of-experts expert no token of this rank's batch was routed to, a part of the
    model the log-probs never run) gets the other ranks' sum, and one that no rank reached
    keeps no gradient, as on one process. Without it DDP waits for that parameter's gradient
    and fails at the next forward. Its cost: one walk of the autograd graph per optimizer
    step, and for a dense model a warning, once per rank, that it found nothing unused.
    forward_sync_buffers=False: the buffers (rotary frequencies) are computed from the config
    and never trained, equal on every rank after the construction's broadcast.
    gradient_as_bucket_view: after the sum each .grad is a view of DDP's bucket rather than a
    second copy beside it (the same values), so DDP adds no gradient-sized memory at the
    optimizer step."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(
        TrainForward(model),
        bucket_cap_mb=bucket_mb,
        find_unused_parameters=True,
        forward_sync_buffers=False,
        gradient_as_bucket_view=True,
    )
    ddp.register_comm_hook(None, sum_hook)
    return ddp


def sum_hook(group, bucket):
    """DDP's communication hook: the bucket all-reduced with SUM, not divided by the world
    size (DDP's default divides): the loss normaliser is already global (`step.optimizer_step`),
    so the sum is the one-process gradient of the global batch. Returns a Future of the
    bucket; unannotated, since DDP compares a hook's annotations with its own objects and
    this module's are strings (`from __future__ import annotations`)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: each decoder layer, then the root (embeddings, final norm, lm-head).
    FSDP2 averages gradients over ranks (a divide factor of 1 needs PREMUL_SUM, which gloo
    lacks): `loss_multiplier` undoes the average, so the shards hold the sum, as in `ddp`."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ValueError(
            f"parallel.strategy=fsdp: {type(model).__name__} has no .model.layers to shard"
        )
    for layer in layers:
        fully_shard(layer)
    # The root too reshards after forward: left unsharded after the no-grad rollout forwards
    # (the root's default), its parameters' gradients were missing at the optimizer step
    # (seen with torch 2.13, gloo).
    fully_shard(model, reshard_after_forward=True)
    return model


def loss_multiplier(d: Dist) -> float:
    """What the loss is multiplied by so that the synced gradient is the SUM over ranks."""
    return float(d.world) if d.on and d.mode == "fsdp" else 1.0


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: torch.nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's state dict on CPU (a collective for a sharded model): on rank 0 only
    (the others get {}; enough to save a checkpoint), or on every rank (each rank's engine)."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload gathers straight to rank 0's host memory; without it every rank gets the
    # whole tensors on its device, copied to the host one by one.
    opts = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
    state = get_model_state_dict(model, options=opts)
    return {k: v.detach().cpu() for k, v in state.items()} if every_rank else state


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Optimizer state keyed by parameter name, whole tensors: loads at any world size."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=opts)


def load_full_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=opts)


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def is_named_optimizer_state(state: dict) -> bool:
    """A state dict from `full_optimizer_state` (parameter names) vs torch's (indices)."""
    return any(isinstance(k, str) for k in state.get("state", {}))


def barrier(d: Dist) -> None:
    if d.on:
        dist.barrier()


def _on_comm_device(t: torch.Tensor) -> torch.Tensor:
    if dist.get_backend() == "nccl":
        return t.to(torch.device("cuda", torch.cuda.current_device()))
    return t


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def grad_norm(params: list[torch.nn.Parameter], d: Dist) -> torch.Tensor:
    """The global gradient L2 norm: on one process the norm of the per-tensor norms; `ddp`
    grads are whole (and equal) on every rank; `fsdp` grads are disjoint shards whose squared
    norms add up over ranks."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not d.on:
        if not grads:
            return torch.tensor(0.0)
        return torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
        )
    sq = sum((torch.linalg.vector_norm(g.float()) ** 2 for g in grads), torch.tensor(0.0))
    if d.mode == "fsdp":
        return torch.tensor(all_sum(sq, d)).sqrt().float()
    return sq.sqrt()


def clip_gradients(
    params: list[torch.nn.Parameter], norm: torch.Tensor, max_norm: float, d: Dist
) -> None:
    """Scale the gradients so that their global norm is at most max_norm: on one process
    torch.nn.utils.clip_grad_norm_ itself; over ranks its rule with the given global norm."""
    if not d.on:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            g = _local(p.grad)
            g.mul_(coef.to(g.device, g.dtype))
