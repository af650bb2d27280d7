"""Trainer options that trade compute for memory must not change the gradient."""

from __future__ import annotations

import torch

from grpolab.config import load_config
from grpolab.trainer import grpo_step, load_start_model, make_run


def test_gradient_checkpointing_gives_the_same_gradient(tmp_path):
    grads, checkpointed = [], []
    for on in (False, True):
        cfg = load_config(
            None,
            [
                f"output_dir={tmp_path / str(on)}",
                "trainer.prompts_per_step=4",
                "trainer.num_generations=4",
                "trainer.max_grad_norm=0",
                "trainer.logprob_source=trainer",
                "trainer.num_iterations=2",  # logp_old from a separate no-grad pass too
                f"trainer.gradient_checkpointing={str(on).lower()}",
            ],
        )
        model, tokenizer = load_start_model(cfg, torch.device("cpu"))
        run = make_run(cfg, model, tokenizer)
        _, batch = grpo_step(run, 1)
        assert batch["advantages"].abs().sum() > 0
        grads.append([p.grad.clone() for p in model.parameters()])
        checkpointed.append(model.is_gradient_checkpointing)
    assert checkpointed == [False, True]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
