"""The demo's starting point: a tiny Llama trained briefly by supervised learning on arithmetic.

GRPO from random weights learns nothing (every group is all-wrong, every advantage 0), so
the demo starts from a partly trained policy. This module produces it, deterministically
from its seed, and the package ships the result in grpolab/data/demo-warmup:

    grpolab warmup --output src/grpolab/data/demo-warmup
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from grpolab.model.policy import TinyModelSpec, build_char_tokenizer, build_tiny_model, save_policy
from grpolab.rollout.hf import HFEngine
from grpolab.tasks import TaskConfig, load_task
from grpolab.train.evaluate import accuracy_rewards, evaluate_accuracy

DEMO_CHARS = "0123456789+-*= "
DEMO_SPEC = TinyModelSpec(
    arch="llama",
    hidden_size=128,
    num_heads=4,  # head_dim 32: the smallest vLLM's CPU attention accepts
    num_layers=2,
    intermediate_size=512,
    max_position_embeddings=64,
)


@dataclass
class WarmupConfig:
    # Stops in the steep part of supervised learning, where greedy held-out accuracy is
    # about a third: low enough that GRPO has room to show, high enough that groups differ.
    steps: int = 120
    batch_size: int = 128
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    seed: int = 0
    num_threads: int = 2
    eval_examples: int = 500  # held-out problems for the accuracy it reports


def sft_batch(tokenizer, examples) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] (prompt + answer + eos, right-padded) and labels [B, T] (-100 on the
    prompt and padding: only the answer and its eos are learned)."""
    rows, starts = [], []
    for e in examples:
        prompt = tokenizer(e.prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(e.answer, add_special_tokens=False)["input_ids"]
        rows.append(prompt + answer + [tokenizer.eos_token_id])
        starts.append(len(prompt))
    T = max(map(len, rows))
    input_ids = torch.full((len(rows), T), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), T), -100, dtype=torch.long)
    for i, (row, p) in enumerate(zip(rows, starts, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, p : len(row)] = torch.tensor(row[p:])
    return input_ids, labels


def warmup(output: str | Path, cfg: WarmupConfig | None = None, console: Console | None = None):
    """Train the demo model by SFT on the arithmetic task's training split; save it to `output`
    (Hugging Face format). Returns the held-out greedy accuracy in percent."""
    cfg = cfg or WarmupConfig()
    console = console or Console()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    tokenizer = build_char_tokenizer(DEMO_CHARS)
    model = build_tiny_model(tokenizer, DEMO_SPEC, seed=cfg.seed)
    task = load_task(TaskConfig())
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.99), weight_decay=0.0
    )
    data_gen = torch.Generator().manual_seed(cfg.seed)
    tic = time.time()
    model.train()
    for step in range(1, cfg.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = cfg.learning_rate * min(1.0, step / cfg.warmup_steps)
        input_ids, labels = sft_batch(tokenizer, task.sample(cfg.batch_size, data_gen))
        attention_mask = (input_ids != tokenizer.pad_token_id).long()
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 20 == 0 or step == cfg.steps:
            console.print(f"warmup step {step}/{cfg.steps}  loss {loss.item():.4f}")
    model.eval()
    engine = HFEngine(model, tokenizer)
    held_out = task.eval[: cfg.eval_examples]
    acc = evaluate_accuracy(engine, held_out, accuracy_rewards(None, task.config), 6)
    save_policy(model, tokenizer, output)
    console.print(
        f"warm-up model saved to {output}: held-out greedy accuracy {acc:.1f}% "
        f"({len(held_out)} problems), {time.time() - tic:.0f} s"
    )
    return acc


# --- The tool example's starting point ------------------------------------------------------

# Digits, the operators, and the characters of the call and result formats.
TOOL_CHARS = "0123456789+-*=() <>/_abcdefghijklmnopqrstuvwxyz"
TOOL_SPEC = TinyModelSpec(
    arch="llama",
    hidden_size=128,
    num_heads=4,
    num_layers=2,
    intermediate_size=512,
    max_position_embeddings=128,
)
TOOL_TASK = TaskConfig(operators="*", min_operand=100, max_operand=999, num_eval=500)


@dataclass
class ToolWarmupConfig:
    # A share of the supervised rows call the calculator and copy its result; the rest
    # answer directly (a 3-digit product the tiny model cannot compute). The warm model
    # calls the tool in about that share of its samples: rarely enough that greedy decoding
    # answers directly, often enough that most groups of 8 hold a call.
    # The first `copy_steps` rows all call the tool (the call format and copying the result
    # are learned first); then `tool_share` of them.
    tool_share: float = 0.2
    copy_steps: int = 600
    steps: int = 800
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    seed: int = 0
    num_threads: int = 1


def tool_sft_rows(tokenizer, examples, tool_share: float, generator: torch.Generator):
    """(input_ids [B, T], labels [B, T]): each row the prompt, then either a tool episode
    (call, the tool turn's tokens as the engine renders them, the answer, EOS; labels -100
    on the prompt and the tool turn) or the answer directly."""
    from grpolab.rollout.episodes import ToolTurnRenderer
    from grpolab.rollout.tools import CALL_CLOSE, CALL_OPEN

    render = ToolTurnRenderer(tokenizer, chat_template=False)
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows, labels = [], []
    calls = torch.rand(len(examples), generator=generator) < tool_share
    for e, call in zip(examples, calls.tolist(), strict=True):
        prompt, answer = enc(e.prompt), [*enc(e.answer), tokenizer.eos_token_id]
        expression = e.prompt.rstrip("=")
        if call:
            said = enc(f"{CALL_OPEN}calculator({expression}){CALL_CLOSE}")
            tool = render(e.answer)
            rows.append(prompt + said + tool + answer)
            labels.append([-100] * len(prompt) + said + [-100] * len(tool) + answer)
        else:
            rows.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
    T = max(map(len, rows))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    label_ids = torch.tensor([r + [-100] * (T - len(r)) for r in labels])
    return input_ids, label_ids


def tool_warmup(output: str | Path, cfg: ToolWarmupConfig | None = None, console=None) -> None:
    """The tool example's model: a tiny Llama taught by SFT to sometimes call the calculator
    in the fallback format and copy its result; saved to `output` (Hugging Face format)."""
    cfg = cfg or ToolWarmupConfig()
    console = console or Console()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    tokenizer = build_char_tokenizer(TOOL_CHARS)
    model = build_tiny_model(tokenizer, TOOL_SPEC, seed=cfg.seed)
    task = load_task(TOOL_TASK)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.99), weight_decay=0.0
    )
    data_gen = torch.Generator().manual_seed(cfg.seed)
    tic = time.time()
    model.train()
    for step in range(1, cfg.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = cfg.learning_rate * min(1.0, step / cfg.warmup_steps)
        examples = task.sample(cfg.batch_size, data_gen)
        share = 1.0 if step <= cfg.copy_steps else cfg.tool_share
        input_ids, labels = tool_sft_rows(tokenizer, examples, share, data_gen)
        attention_mask = (input_ids != tokenizer.pad_token_id).long()
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == cfg.steps:
            console.print(f"tool warmup step {step}/{cfg.steps}  loss {loss.item():.4f}")
    model.eval()
    save_policy(model, tokenizer, output)
    console.print(f"tool warm-up model saved to {output}, {time.time() - tic:.0f} s")
