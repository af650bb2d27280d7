"""A quick check of the core on a tiny real model: the seed's printable quantities, measured."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from grpolab import core
from grpolab.models import TinyModelSpec, build_char_tokenizer, build_tiny_model


def _labels_logprob(model, input_ids, attention_mask, completion_mask) -> torch.Tensor:
    """Sum of completion-token log-probs from the model's own labels loss: [B]."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = []
    for i in range(input_ids.shape[0]):
        labels = input_ids[i : i + 1].masked_fill(completion_mask[i : i + 1] == 0, -100)
        loss = model(
            input_ids=input_ids[i : i + 1],
            attention_mask=attention_mask[i : i + 1],
            position_ids=position_ids[i : i + 1],
            labels=labels,
        ).loss
        out.append(-loss * completion_mask[i, 1:].sum())
    return torch.stack(out)


def run_core_selfcheck(seed: int = 0) -> int:
    """Measure the core's quantities on a random batch; print a table; 0 if all pass."""
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelSpec(), seed=seed)
    groups, G, P, C = 4, 4, 6, 8
    B = groups * G
    input_ids = torch.randint(3, len(tokenizer), (B, P + C))
    attention_mask = torch.ones_like(input_ids)
    lengths = torch.randint(1, C + 1, (B,))
    completion_mask = torch.zeros_like(input_ids)
    for i, n in enumerate(lengths.tolist()):
        completion_mask[i, P : P + n] = 1
        attention_mask[i, P + n :] = 0

    rows = []
    with torch.no_grad():
        logp, mask = core.sequence_logprobs(model, input_ids, attention_mask, completion_mask)
        ref = _labels_logprob(model, input_ids, attention_mask, completion_mask)
        gap = ((logp * mask).sum(1) - ref).abs().max().item()
        rows.append(("1 logprobs", "shift: |sum logp + labels CE|", gap, "<= 1e-4", gap <= 1e-4))
        rows.append(("1 logprobs", "dtype", str(logp.dtype), "float32", logp.dtype == torch.float32))

        rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0.5, 0, 1, 0.25])
        adv = core.group_advantages(rewards, G)
        sums = adv.view(-1, G).sum(1).abs().max().item()
        rows.append(("2 advantages", "max |group sum|", sums, "<= 1e-5", sums <= 1e-5))
        zero = adv.view(-1, G)[1:3].abs().max().item()
        rows.append(("2 advantages", "equal-reward groups", zero, "== 0", zero == 0.0))

        logp_old, _ = core.sequence_logprobs(model, input_ids, attention_mask, completion_mask)
        ratio = torch.exp(logp - logp_old)[mask.bool()]
        dev = (ratio - 1).abs().max().item()
        rows.append(("3 ratio", "max |ratio - 1| (scheme A)", dev, "<= 1e-3", dev <= 1e-3))

        kl = core.kl_k3(logp, logp_old + 0.3 * torch.randn_like(logp))
        rows.append(("5 KL", "min k3", kl.min().item(), ">= 0", kl.min().item() >= 0))

    logp_new = logp.clone().requires_grad_(True)
    loss, metrics = core.grpo_loss(logp_new, logp_old, None, adv, mask)
    loss.backward()
    leak = logp_new.grad[~mask.bool()].abs().max().item()
    rows.append(("6 normalisation", "grad on prompt/padding", leak, "== 0", leak == 0.0))
    finite = torch.isfinite(loss).item()
    rows.append(("7 loss", "loss", metrics["loss"], "finite", finite))

    table = Table(title="grpolab core self-check (tiny Llama, random batch)")
    for col in ("check", "measured", "value", "expected", "result"):
        table.add_column(col)
    for check, what, value, expected, ok in rows:
        shown = f"{value:.3g}" if isinstance(value, float) else str(value)
        table.add_row(check, what, shown, expected, "[green]pass" if ok else "[red]FAIL")
    console = Console()
    console.print(core.objective_card(core.Objective(max_completion_length=C)))
    console.print(table)
    return 0 if all(r[-1] for r in rows) else 1
