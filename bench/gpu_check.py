"""One part of bench/gpu_check.sh: a Qwen2.5-0.5B-shaped model with random weights (no
download), timed on one CUDA device. Each part writes a JSON file into OUT_DIR and prints a
markdown table; a part whose component is missing says so and writes {"skipped": reason}.

    python bench/gpu_check.py rollout-hf OUT_DIR     # grpolab's decode step and loop, generate
    python bench/gpu_check.py rollout-vllm OUT_DIR   # vLLM, prompt token ids in, ids out
    python bench/gpu_check.py train OUT_DIR          # GRPO step time split and peak memory
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), random weights.
QWEN05 = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
)
PROMPTS, PROMPT_LEN, GROUP, NEW_TOKENS = 16, 128, 8, 256  # 128 sequences per rollout
# GPU_CHECK_SMOKE=1: the same code on CPU at a tiny shape, to check the script without a GPU.
SMOKE = os.environ.get("GPU_CHECK_SMOKE") == "1"
DEVICE = "cpu" if SMOKE else "cuda"
if SMOKE:
    QWEN05.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    QWEN05.update(num_attention_heads=2, num_key_value_heads=1)
    PROMPTS, PROMPT_LEN, GROUP, NEW_TOKENS = 2, 8, 2, 8


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else float("nan")


def build_model(dtype: torch.dtype, device: str = DEVICE):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**QWEN05)
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()


def prompt_ids(device: str = DEVICE) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    high = QWEN05["vocab_size"] // 5
    return torch.randint(10, high, (PROMPTS, PROMPT_LEN), generator=g).to(device)


def write(out: Path, name: str, rows: list[dict], show: bool = True) -> None:
    """rows as OUT/name.json and OUT/name.md; show: print the table too (once, at the end:
    earlier calls only keep what is measured when a part runs out of time)."""
    (out / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
    if not rows:
        return
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |")
    table = "\n".join(lines)
    (out / f"{name}.md").write_text(table + "\n")
    if show:
        print(table, flush=True)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def rollout_hf(out: Path) -> None:
    """16 prompts x 8 samples x 256 new tokens, bf16: grpolab's decode loop (each prompt
    prefilled once for its 8 samples), transformers generate with the default dynamic cache,
    with the static cache and the compiled decode step, and continuous batching."""
    model = build_model(torch.bfloat16)
    engines = [
        ("grpolab decode step (static cache, shared prefill)", grpolab_decode_step),
        ("grpolab decode loop (model forward, shared prefill)", grpolab_decode),
        ("hf dynamic cache", hf_generate),
        ("hf static cache + torch.compile", hf_generate_compiled),
        ("hf continuous batching", continuous_batching),
    ]
    rows = []
    for label, fn in engines:
        if SMOKE and fn is hf_generate_compiled:  # compiling on a small CPU takes minutes
            continue
        rows.append(timed_rollout(label, fn, model))
        write(out, "rollout_hf", rows, show=False)  # kept if a later engine runs out of time
    write(out, "rollout_hf", rows)


def hf_generate(model, **kwargs) -> int:
    ids = prompt_ids().repeat_interleave(GROUP, dim=0)  # [128, 128]
    seqs = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,  # random weights: no early EOS, fixed work
        do_sample=True,
        temperature=1.0,
        top_k=0,
        pad_token_id=0,
        **kwargs,
    )
    return (seqs.shape[1] - PROMPT_LEN) * seqs.shape[0]


def hf_generate_compiled(model) -> int:
    """The static cache with the decode step compiled (CUDA graphs); the model's eager
    forward is put back afterwards for the engines that follow."""
    eager = model.forward
    if not hasattr(model, "_compiled_forward"):  # once: the warm-up call compiles it
        model._compiled_forward = torch.compile(eager, mode="reduce-overhead")
    model.forward = model._compiled_forward
    try:
        return hf_generate(model, cache_implementation="static")
    finally:
        model.forward = eager


def timed_rollout(label: str, fn, model) -> dict:
    """Run fn(model) -> new tokens twice (warm-up, timed); a failure becomes an error row."""
    try:
        for _attempt in ("warm-up", "timed"):
            sync()
            reset_peak()
            tic = time.perf_counter()
            new = fn(model)
            sync()
            seconds = time.perf_counter() - tic
        return {
            "engine": label,
            "sequences": PROMPTS * GROUP,
            "new_tokens": new,
            "seconds": seconds,
            "tokens_per_s": new / seconds,
            "peak_gib": peak_gib(),
        }
    except Exception as e:
        print(f"{label}: failed: {e}", flush=True)
        return {"engine": label, "error": f"{type(e).__name__}: {str(e)[:200]}"}


def grpolab_decode(model, decoder=None) -> int:
    from grpolab.rollout.base import SamplingParams
    from grpolab.rollout.hf import decode

    ids = prompt_ids()
    params = SamplingParams(temperature=1.0, max_completion_length=NEW_TOKENS, seed=0)
    # stop id -1 never occurs: random weights, fixed work (every row writes NEW_TOKENS)
    completions, _ = decode(
        model, ids, torch.ones_like(ids), GROUP, params, [-1], 0, decoder=decoder
    )
    return sum(len(c) for c in completions)


def grpolab_decode_step(model) -> int:
    """The hf engine's own decode step (grpolab.model.decoder) on the bf16 model, checked
    against the model's forward first (as the engine does once per model)."""
    import functools

    from grpolab.model.decoder import Decoder, verify_decoder
    from grpolab.rollout.hf import plain_projection

    projections = functools.partial(plain_projection, None)
    with torch.no_grad():
        reason = verify_decoder(model, prompt_ids()[0, :16], projections)
    if reason is not None:
        raise RuntimeError(f"the decode step does not reproduce the model: {reason}")
    # bf16 weights, no autocast: the model's own forward runs attention in bf16 (sdpa)
    decoder = Decoder(model, projections, torch.bfloat16, lambda keys: True)
    with torch.no_grad():
        return grpolab_decode(model, decoder)


def continuous_batching(model) -> int:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0,
        top_k=0, num_return_sequences=GROUP, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    outputs = model.generate_batch(inputs=prompt_ids().tolist(), generation_config=config)
    return sum(len(o.generated_tokens) for o in outputs.values())


def rollout_vllm(out: Path) -> None:
    try:
        from vllm import LLM, SamplingParams
    except Exception as e:
        (out / "rollout_vllm.json").write_text(json.dumps({"skipped": f"no vllm: {e}"}) + "\n")
        print(f"vLLM not available ({type(e).__name__}: {e}): skipped", flush=True)
        return
    model = build_model(torch.bfloat16, device="cpu")
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        del model
        llm = LLM(
            model=d,
            skip_tokenizer_init=True,  # random weights, no tokenizer: token ids in and out
            dtype="bfloat16",
            max_model_len=PROMPT_LEN + NEW_TOKENS + 8,
            gpu_memory_utilization=0.5,
            seed=0,
        )
        params = SamplingParams(
            n=GROUP,
            max_tokens=NEW_TOKENS,
            min_tokens=NEW_TOKENS,
            temperature=1.0,
            logprobs=0,
            seed=0,
            detokenize=False,
        )
        prompts = [{"prompt_token_ids": p.tolist()} for p in prompt_ids("cpu")]
        llm.generate(prompts[:2], params)  # warm-up
        tic = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - tic
    new = sum(len(c.token_ids) for o in outs for c in o.outputs)
    rows = [
        {
            "engine": "vllm",
            "sequences": sum(len(o.outputs) for o in outs),
            "new_tokens": new,
            "seconds": seconds,
            "tokens_per_s": new / seconds,
        }
    ]
    write(out, "rollout_vllm", rows)


def train(out: Path) -> None:
    """A few GRPO optimizer steps on 64 sequences of 128 prompt + 256 completion tokens:
    fp32 master weights under bf16 autocast, and bf16 weights; gradient checkpointing off/on;
    then 8 prompts x G = 8 (rows of a group share the prompt) with one forward per row, one per
    prompt (runtime.shared_prefix), and one per prompt with the layers' parts compiled
    (runtime.torch_compile); last long, uneven completions padded and packed into one
    sequence (batch.max_tokens_per_microbatch's path). Time split: log-prob forward,
    backward, optimizer step."""
    from grpolab import core
    from grpolab.model.logprobs import token_logprobs
    from grpolab.train.setup import compile_decoder_layers

    B, T, P = (4 if SMOKE else 64), PROMPT_LEN + NEW_TOKENS, PROMPT_LEN
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(10, QWEN05["vocab_size"] // 5, (B, T), generator=g).to(DEVICE)
    attention_mask = torch.ones_like(input_ids)
    completion_mask = torch.zeros_like(input_ids)
    completion_mask[:, P:] = 1
    advantages = torch.randn(B, generator=g).to(DEVICE)
    grouped = input_ids.clone()
    grouped[:, :P] = input_ids[::GROUP, :P].repeat_interleave(GROUP, dim=0)[:B]
    # Long, uneven completions (log-normal, 16 to 256 tokens): what packing is for.
    lengths = (torch.randn(B, generator=g) * 0.8).exp().mul(NEW_TOKENS / 4).round()
    lengths = lengths.clamp(min=min(16, NEW_TOKENS), max=NEW_TOKENS).long()
    uneven = (torch.arange(T - P)[None] < lengths[:, None]).long().to(DEVICE)  # [B, T-P]
    uneven_attention = torch.cat([torch.ones_like(uneven[:, :1]).expand(-1, P), uneven], 1)
    uneven_completion = torch.cat([torch.zeros_like(uneven[:, :1]).expand(-1, P), uneven], 1)
    rows = []
    for weights, autocast, ckpt, groups, shared, compiled, packing in (
        (torch.float32, True, False, False, True, False, None),
        (torch.float32, True, True, False, True, False, None),
        (torch.bfloat16, False, False, False, True, False, None),
        (torch.bfloat16, False, False, True, False, False, None),
        (torch.bfloat16, False, False, True, True, False, None),
        (torch.bfloat16, False, False, True, True, True, None),
        (torch.bfloat16, False, False, True, True, False, "padded"),
        (torch.bfloat16, False, False, True, True, False, "packed"),
    ):
        label = f"{'fp32 master + bf16 autocast' if autocast else 'bf16 weights'}" + (
            ", grad checkpointing" if ckpt else ""
        )
        if groups:
            label += f", G={GROUP} groups, one forward per {'prompt' if shared else 'row'}"
            label += ", torch_compile" if compiled else ""
        if packing is not None:
            label += f", uneven lengths {int(lengths.min())}-{int(lengths.max())}, {packing}"
        ids = grouped if groups else input_ids
        attn, comp = attention_mask, completion_mask
        if packing is not None:
            attn, comp = uneven_attention, uneven_completion
        try:
            model = build_model(weights).train()
            if compiled:
                compile_decoder_layers(model)
            if ckpt:
                model.gradient_checkpointing_enable()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            sync()
            reset_peak()
            times = {"forward_s": [], "backward_s": [], "optimizer_s": []}
            for step in range(4):  # the first is warm-up
                tic = time.perf_counter()
                with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
                    logp, mask = token_logprobs(
                        model, ids, attn, comp, shared_prefix=shared, packed=packing == "packed"
                    )
                    loss, _ = core.grpo_loss(logp, logp.detach(), None, advantages, mask)
                sync()
                t1 = time.perf_counter()
                loss.backward()
                sync()
                t2 = time.perf_counter()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync()
                t3 = time.perf_counter()
                if step:
                    times["forward_s"].append(t1 - tic)
                    times["backward_s"].append(t2 - t1)
                    times["optimizer_s"].append(t3 - t2)
            row = {"setup": label, "sequences": B, "tokens": int(attn.sum())}
            row.update({k: sum(v) / len(v) for k, v in times.items()})
            row["step_s"] = row["forward_s"] + row["backward_s"] + row["optimizer_s"]
            row["peak_gib"] = peak_gib()
            rows.append(row)
            write(out, "train", rows, show=False)
            del model, opt
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:
            rows.append({"setup": label, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(f"{label}: failed: {e}", flush=True)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    write(out, "train", rows)


PARTS = {"rollout-hf": rollout_hf, "rollout-vllm": rollout_vllm, "train": train}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in PARTS:
        sys.exit(f"usage: gpu_check.py {{{','.join(PARTS)}}} OUT_DIR")
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("gpu_check.py: no CUDA device visible")
    out_dir = Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    PARTS[sys.argv[1]](out_dir)
