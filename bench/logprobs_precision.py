"""How far each log-prob path is from float64, on the preflight's own batch of a real model.

The configured model and task (grpolab config + overrides, as `grpolab preflight` takes them)
give the preflight's batch: a few real groups sampled by the configured engine. For each
path, the log-probs of the completion tokens and the gradient of sum(logp * mask) with
respect to every parameter are compared with a float64 copy of the same model on the same
batch (log-softmax in float64 too):

  naive           core.sequence_logprobs: the full [B, T, V] logits, log_softmax in float32
  fused           grpolab.model.logprobs.token_logprobs, one forward per prompt (the trainer's path)
  fused_per_row   the same without sharing the prompt's forward

Printed per path: the max |logp - logp64| over completion tokens, the max |grad - grad64|
over all parameters relative to max |grad64|, and the parameter where that is worst.
`--targets random` replaces the sampled completion tokens by uniform random ones (the same
masks): the model is then far from confident, so 1 - p is never small.

    python bench/logprobs_precision.py model.name_or_path=DIR task.chat_template=true
    python bench/logprobs_precision.py --targets random --json out.json model.name_or_path=DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="YAML config file (default: the built-in demo)")
    p.add_argument("--targets", choices=["sampled", "random"], default="sampled")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from grpolab import core
    from grpolab.checks.gradients import float64_copy, logprob_distances
    from grpolab.checks.reference import float64_logprobs
    from grpolab.config import load_config
    from grpolab.model.logprobs import token_logprobs
    from grpolab.train.preflight import sample_batch
    from grpolab.train.setup import build_run, load_start_model, resolve_device

    cfg = load_config(args.config, args.overrides)
    model, tokenizer = load_start_model(cfg, resolve_device(cfg.model.device))
    run = build_run(cfg, model, tokenizer)
    batch, _ = sample_batch(run)
    temperature = cfg.rollout.temperature
    model.eval()
    input_ids = batch.input_ids.clone()
    valid = batch.completion_mask[:, 1:].bool()
    if args.targets == "random":
        vocab = model.get_output_embeddings().weight.shape[0]
        gen = torch.Generator().manual_seed(cfg.seed)
        noise = torch.randint(0, vocab, input_ids.shape, generator=gen).to(input_ids.device)
        input_ids = torch.where(batch.completion_mask.bool(), noise, input_ids)
    batch_args = (input_ids, batch.attention_mask, batch.completion_mask, temperature)

    paths = {
        "naive": core.sequence_logprobs,
        "fused": lambda m, *a: token_logprobs(m, *a, shared_prefix=True),
        "fused_per_row": lambda m, *a: token_logprobs(m, *a, shared_prefix=False),
    }
    # The float64 reference, and core.sequence_logprobs on the same float64 copy: that one
    # casts the logits to float32 before its log-softmax, so it shares the float32
    # log-softmax's rounding with the naive path and is no reference for it.
    references = {
        "float64": float64_logprobs,
        "float64 model, float32 log-softmax": core.sequence_logprobs,
    }
    tic = time.perf_counter()
    model64 = float64_copy(model)
    tables = {
        name: logprob_distances(model, model64, batch_args, paths, reference)
        for name, reference in references.items()
    }
    del model64

    B, T = input_ids.shape
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"\nlog-probs against a float64 copy | {cfg.model.name_or_path or 'demo model'}, "
        f"{model.dtype}, {B} rows x {T} tokens, {int(valid.sum())} completion tokens "
        f"({args.targets}), T = {temperature:g} | {torch.get_num_threads()} thread(s), "
        f"load {load}, {time.perf_counter() - tic:.0f} s"
    )
    for ref_name, rows in tables.items():
        print(f"against: {ref_name}")
        header = (
            f"{'path':<14} {'logp err':>9} {'grad err':>9} {'x naive':>8}  worst parameter "
            "(abs err / max |grad| of all)"
        )
        print(header + "\n" + "-" * len(header))
        for name, d in rows.items():
            ratio = d.grad / rows["naive"].grad if rows["naive"].grad else 0.0
            print(
                f"{name:<14} {d.logp:9.2e} {d.grad:9.2e} {ratio:8.2f}  "
                f"{d.worst} ({d.worst_abs:.2g} / {d.worst_abs / d.grad if d.grad else 0:.3g})"
            )
        print()
    if args.json:
        with open(args.json, "w") as f:
            out = {r: {n: dataclasses.asdict(d) for n, d in t.items()} for r, t in tables.items()}
            json.dump({"targets": args.targets, "tokens": int(valid.sum()), "tables": out}, f)


if __name__ == "__main__":
    main()
