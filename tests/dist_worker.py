"""Run under `torchrun --nproc_per_node 2`: one GRPO step per aggregation mode on a global
batch split over the ranks, then a short demo run with checkpoints. Rank 0 writes the
parameters it ends with to argv[2] for tests/test_distributed.py to compare."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from grpolab import dist as dist_module
from grpolab.config import load_config
from grpolab.trainer import grpo_step, load_start_model, make_run, train

MODES = ("sequence", "token", "constant")


def split_config(mode: str, loss_type: str, out: Path, accumulation: int):
    return load_config(
        None,
        [
            f"output_dir={out}",
            "trainer.prompts_per_step=4",
            "trainer.num_generations=4",
            "trainer.progress=false",
            f"trainer.loss_type={loss_type}",
            f"trainer.gradient_accumulation_steps={accumulation}",
            f"trainer.distributed={mode}",
            "trainer.rollout_split=replicated",
            "trainer.beta=0.05",
            "trainer.learning_rate=1e-3",
        ],
    )


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (a collective for FSDP2 shards)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def demo_overrides(out: Path, mode: str) -> list[str]:
    return [
        f"output_dir={out}",
        "max_steps=2",
        "trainer.save_steps=1",
        "trainer.save_total_limit=null",
        "trainer.prompts_per_step=4",
        "trainer.num_generations=4",
        "trainer.eval_examples=0",
        "trainer.progress=false",
        f"trainer.distributed={mode}",
        "trainer.rollout_split=replicated",
    ]


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    d = dist_module.init(mode, torch.device("cpu"))
    assert d.world == 2, d
    results: dict[str, object] = {}
    for loss_type in MODES:
        cfg = split_config(mode, loss_type, out / "unused", accumulation=2)
        model, tokenizer = load_start_model(cfg, torch.device("cpu"))
        run = make_run(cfg, model, tokenizer, dist=d)
        metrics, batch = grpo_step(run, 1)
        results[loss_type] = {
            "params": dist_module.full_state_dict(run.model),
            "grads": full_grads(run.model),
            "grad_norm": metrics["grad_norm"],
            "loss": metrics["loss"],
            "rows": batch["input_ids"].shape[0],
        }
    # rollout_split=local: each rank samples its own groups; the replicas stay equal.
    cfg = split_config(mode, "token", out / "unused", accumulation=1)
    cfg.trainer.rollout_split = "local"
    model, tokenizer = load_start_model(cfg, torch.device("cpu"))
    run = make_run(cfg, model, tokenizer, dist=d)
    _, batch = grpo_step(run, 1)
    local = {k: v.float().sum().item() for k, v in run.model.state_dict().items()}
    if mode == "ddp":  # fsdp holds shards; its sums differ by design
        results["local_params_per_rank"] = dist_module.all_gather_objects(local, d)
    results["local_prompts_per_rank"] = dist_module.all_gather_objects(batch["prompts"], d)

    cfg = load_config(None, demo_overrides(out / "demo", mode))
    train(cfg, skip_preflight=True)
    if d.main:
        torch.save(results, out / "split.pt")


if __name__ == "__main__":
    main()
