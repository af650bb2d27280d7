"""Run under `torchrun --nproc_per_node 2`: one GRPO step per aggregation mode on a global
batch split over the ranks, then (ddp) the gradients of each rank's own batch without and with
DDP's sync, then a short demo run with checkpoints. Rank 0 writes the parameters it ends with
to argv[2] for tests/test_distributed.py to compare.

Modes "vllm-fsdp" and "vllm-lora": one vLLM engine per rank, synced from FSDP2 shards and
from a LoRA model under DDP (see vllm_main)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from grpolab.config import load_config, replaced
from grpolab.model import dist as dist_module
from grpolab.train.loop import train
from grpolab.train.setup import build_run, load_start_model
from grpolab.train.step import collect, grpo_step

MODES = ("sequence", "token", "constant")


def split_config(mode: str, loss_type: str, out: Path, accumulation: int):
    return load_config(
        None,
        [
            f"output_dir={out}",
            "batch.prompts_per_step=4",
            "batch.num_generations=4",
            "logging.progress=false",
            f"objective.loss_type={loss_type}",
            f"batch.gradient_accumulation_steps={accumulation}",
            f"parallel.strategy={mode}",
            "parallel.rollout_split=replicated",
            "objective.beta=0.05",
            "optim.learning_rate=1e-3",
            # ddp: DDP's buckets of at most ~50 KB, many of them (fsdp has no buckets)
            *(["parallel.ddp_bucket_mb=0.05"] if mode == "ddp" else []),
        ],
    )


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (a collective for FSDP2 shards)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def sync_probe(run, step: int) -> dict[str, object]:
    """ddp: one forward and backward of this rank's own batch (rollout_split=local: the ranks'
    batches differ) through `run.train_forward`, the loss the sum of its masked log-probs:
    under DDP's no_sync (`local`), then once more synced (`accumulated`: both passes'
    gradients summed over ranks), then synced from zero (`synced`). Each rank's gradients and
    DDP's own record of its buckets and of its last synced backward."""
    batch = collect(run, step)
    inputs = (batch.input_ids, batch.attention_mask, batch.completion_mask, 1.0)
    out: dict[str, object] = {}
    for name, sync, zero in (("local", False, True), ("accumulated", True, False),
                             ("synced", True, True)):  # fmt: skip
        if zero:
            run.optimizer.zero_grad(set_to_none=True)
        with run.gradient_sync(sync):
            logp, mask = run.train_forward(*inputs)
            (logp * mask).sum().backward()
        out[name] = dist_module.all_gather_objects(grads(run.model), run.dist)
    # DDP logs a synced backward's timings at the next synced forward.
    logp, mask = run.train_forward(*inputs)
    (logp * mask).sum().backward()
    run.optimizer.zero_grad(set_to_none=True)
    out["logging"] = run.ddp._get_ddp_logging_data()
    out["param_bytes"] = [
        p.numel() * p.element_size() for p in run.model.parameters() if p.requires_grad
    ]
    return out


def compiled_step(d, out: Path) -> dict[str, object]:
    """ddp: the "token" step of main() with runtime.torch_compile, whose layer parts compile
    inside DDP's forward (its small buckets are where Dynamo's DDP graph splitting failed):
    its gradients, and what made the fused log-prob path fall back to the naive one."""
    from grpolab.model import logprobs

    cfg = split_config("ddp", "token", out / "unused", accumulation=2)
    cfg = replaced(cfg, {"runtime.torch_compile": True})
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    run = build_run(cfg, model, tokenizer, dist=d)
    grpo_step(run, 1)
    return {"grads": full_grads(run.model), "fell_back": sorted(logprobs._WARNED.get(model, ()))}


def demo_overrides(out: Path, mode: str) -> list[str]:
    return [
        f"output_dir={out}",
        "max_steps=2",
        "checkpoints.save_steps=1",
        "checkpoints.save_total_limit=null",
        "batch.prompts_per_step=4",
        "batch.num_generations=4",
        "eval.eval_examples=0",
        "logging.progress=false",
        f"parallel.strategy={mode}",
        "parallel.rollout_split=replicated",
    ]


def vllm_overrides(out: Path, mode: str, *extra: str) -> list[str]:
    return [
        *demo_overrides(out, mode),
        "rollout.engine=vllm",
        "rollout.vllm.max_model_len=64",
        *extra,
    ]


CORRUPTED = "model.layers.1.mlp.down_proj.weight"


def vllm_steps(cfg, d=None) -> dict[str, object]:
    """Two GRPO steps sampled by vLLM (a weight sync, checked, after each); then rank 1's engine
    (the only one, on one process) gets a corrupted copy of one tensor and checks it."""
    from grpolab.rollout.vllm import WeightSyncError, engine_state_dict

    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    run = build_run(cfg, model, tokenizer, dist=d)
    try:
        gaps = [grpo_step(run, step)[0]["engine/sync_gap"] for step in (1, 2)]
        params = dist_module.full_state_dict(run.model)  # on rank 0
        state = engine_state_dict(run.model)  # whole tensors on every rank (a collective)
        rank = d.rank if d is not None else 1
        if rank == 1:
            state[CORRUPTED] = state[CORRUPTED] * 1.5
        run.engine.load_weights(state)
        try:
            run.engine.check_sync(run.model)
            caught = False
        except WeightSyncError:
            caught = True
        if d is not None:  # per rank, gathered while the process group still exists
            gaps = dist_module.all_gather_objects(gaps, d)
            caught = dist_module.all_gather_objects(caught, d)
    finally:
        run.engine.close()  # vLLM's teardown destroys the default process group too
    return {"params": params, "gaps": gaps, "caught": caught}


def vllm_main(mode: str, out: Path) -> None:
    """vllm-fsdp: two steps on FSDP2 shards (vllm_steps). vllm-lora: a LoRA run under DDP with
    its checkpoints. One launch each: vLLM's teardown destroys the default process group, and
    a second group in the same torchrun processes could meet the first one's store keys."""
    cpu = torch.device("cpu")
    if mode == "vllm-fsdp":
        d = dist_module.init("fsdp", cpu)
        results = vllm_steps(load_config(None, vllm_overrides(out / "unused", "fsdp")), d)
        if d.main:
            torch.save(results, out / "split.pt")
    else:
        cfg = load_config(None, vllm_overrides(out / "lora", "ddp", "lora.r=4"))
        train(cfg, skip_preflight=True)  # the engines' sync is the point here


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    if mode.startswith("vllm-"):
        return vllm_main(mode, out)
    d = dist_module.init(mode, torch.device("cpu"))
    assert d.world == 2, d
    results: dict[str, object] = {}
    for loss_type in MODES:
        cfg = split_config(mode, loss_type, out / "unused", accumulation=2)
        model, tokenizer = load_start_model(cfg, torch.device("cpu"))
        run = build_run(cfg, model, tokenizer, dist=d)
        metrics, batch = grpo_step(run, 1)
        results[loss_type] = {
            "params": dist_module.full_state_dict(run.model),
            "grads": full_grads(run.model),
            "grad_norm": metrics["grad_norm"],
            "loss": metrics["loss"],
            "rows": batch.input_ids.shape[0],
        }
    # rollout_split=local: each rank samples its own groups; the replicas stay equal.
    cfg = split_config(mode, "token", out / "unused", accumulation=1)
    cfg = replaced(cfg, {"parallel.rollout_split": "local"})
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    run = build_run(cfg, model, tokenizer, dist=d)
    _, batch = grpo_step(run, 1)
    local = {k: v.float().sum().item() for k, v in run.model.state_dict().items()}
    if mode == "ddp":  # fsdp holds shards; its sums differ by design
        results["local_params_per_rank"] = dist_module.all_gather_objects(local, d)
        results["sync"] = sync_probe(run, 2)
        results["compiled"] = compiled_step(d, out)
    results["local_prompts_per_rank"] = dist_module.all_gather_objects(batch.rollout.prompts, d)

    cfg = load_config(None, demo_overrides(out / "demo", mode))
    train(cfg, skip_preflight=True)
    if d.main:
        torch.save(results, out / "split.pt")


if __name__ == "__main__":
    main()
