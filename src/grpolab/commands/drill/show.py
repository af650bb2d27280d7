"""`show N`: goal N's intermediate quantity computed by the learner's code on the real batch,
printed the way the course prints it."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

import torch

from grpolab import core
from grpolab.checks.context import PreflightBatch, PreflightSettings
from grpolab.checks.normalisation import UNEQUAL_LENGTHS, unequal_lengths_batch
from grpolab.commands.drill.texts import show_text
from grpolab.core import CoreFunctions
from grpolab.model.policy import eval_mode


def _fmt(x: float) -> str:
    return f"{x:+.4f}"


def _width(text: str) -> int:
    """Columns `text` takes on a terminal (a Chinese character takes two)."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _right(text: str, width: int) -> str:
    return " " * max(width - _width(text), 0) + text


def _left(text: str, width: int) -> str:
    return text + " " * max(width - _width(text), 0)


def _row(values, width: int = 8) -> str:
    return " ".join(f"{float(v):>{width}.4f}" for v in values)


def show_logprobs(
    impl: CoreFunctions, model, tokenizer, batch: PreflightBatch, s, lang
) -> list[str]:
    row = int(batch.completion_mask.sum(1).argmax())  # the longest completion
    ids, am, cm = (
        t[row : row + 1] for t in (batch.input_ids, batch.attention_mask, batch.completion_mask)
    )
    with torch.no_grad():
        logp, mask = impl.sequence_logprobs(model, ids, am, cm, s.objective.temperature)
    shapes = f"logp {list(logp.shape)}, input_ids {list(ids.shape)}"
    logp, mask = logp[0], mask[0]
    lines = [
        show_text("1_head", lang, row=row, shapes=shapes),
        f"{'t':>3}  {_left(show_text('1_token', lang), 10)} {'logp':>9}  mask",
    ]
    for t in range(logp.shape[0]):
        if not am[0, t + 1]:
            continue
        token = tokenizer.decode([int(ids[0, t + 1])])
        lines.append(f"{t:>3}  {token!r:<10} {float(logp[t]):>9.4f}  {float(mask[t]):g}")
    total = float((logp * mask).sum())
    lines.append(show_text("1_sum", lang, total=total))
    return lines


def show_advantages(impl: CoreFunctions, batch: PreflightBatch, lang: str) -> list[str]:
    G = batch.group_size
    adv = impl.group_advantages(batch.rewards, G)
    r, a = batch.rewards.view(-1, G), adv.detach().view(-1, G)
    lines = [
        show_text("2_head", lang, groups=r.shape[0], G=G),
        f"adv = group_advantages(rewards, group_size={G}); adv.view(-1, {G}):",
    ]
    row_sum = show_text("2_row_sum", lang)
    for i in range(r.shape[0]):
        group = show_text("2_group", lang, i=i)
        lines.append(f"{group} rewards {_row(r[i], 7)}")
        pad = " " * _width(group)
        lines.append(f"{pad} adv     {_row(a[i], 7)}   {row_sum} {float(a[i].sum()):+.2e}")
    lines.append(
        f"print(adv.view(-1, {G}).sum(dim=1)) -> {[round(float(x), 6) for x in a.sum(1)]}"
        f"   {show_text('2_note', lang)}"
    )
    return lines


def show_ratio(impl: CoreFunctions, model, batch: PreflightBatch, s, lang: str) -> list[str]:
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask, s.objective.temperature)
    model.train()
    try:
        with torch.no_grad():
            logp_old, _ = impl.sequence_logprobs(model, *args)  # an extra forward
            logp_new, mask = impl.sequence_logprobs(model, *args)
    finally:
        model.eval()
    valid = mask.bool()
    ratio = torch.exp(logp_new - logp_old)[valid]
    adv = core.group_advantages(batch.rewards, batch.group_size)
    _, metrics = impl.grpo_loss(
        logp_new, logp_old, None, adv, mask, **s.objective.loss_kwargs() | {"beta": 0.0},
    )  # fmt: skip
    return [
        show_text("3_head", lang),
        show_text("3_over", lang, n=int(valid.sum())),
        f"  min {float(ratio.min()):.6f}  max {float(ratio.max()):.6f}  "
        f"mean {float(ratio.mean()):.6f}",
        f"  max |ratio - 1| = {float((ratio - 1).abs().max()):.2e}   {show_text('3_bound', lang)}",
        f"  grpo_loss metrics['ratio_mean'] = {float(metrics['ratio_mean']):.6f}",
    ]


def show_clip(impl: CoreFunctions, s: PreflightSettings, lang: str) -> list[str]:
    lo, hi = 1 - s.objective.epsilon, 1 + s.objective.epsilon_high
    ratios = torch.tensor([[0.5, 0.9, 1.0, 1.1, 1.25, 1.5]] * 2)
    advantages = torch.tensor([1.0, -1.0])
    logp_old = torch.full_like(ratios, -1.0)
    logp_new = logp_old + torch.log(ratios)
    mask = torch.ones_like(ratios)
    per_token, clip_frac = impl.policy_loss(
        logp_new, logp_old, advantages, mask, s.objective.epsilon, s.objective.epsilon_high
    )
    clipped = ratios.clamp(lo, hi)
    lines = [
        show_text("4_head", lang, lo=s.objective.epsilon, hi=s.objective.epsilon_high, a=lo, b=hi),
        f"{'A':>5} {'ratio':>7} {_right(show_text('4_clipped', lang), 8)} {'ratio*A':>8} "
        f"{'clip*A':>8} {'per_token':>10} {_right(show_text('expected_col', lang), 9)}",
    ]
    for i in range(2):
        A = float(advantages[i])
        for t in range(ratios.shape[1]):
            r, c = float(ratios[i, t]), float(clipped[i, t])
            expected = -min(r * A, c * A)
            lines.append(
                f"{A:>+5.1f} {r:>7.3f} {c:>8.3f} {r * A:>8.3f} {c * A:>8.3f} "
                f"{float(per_token[i, t]):>10.4f} {expected:>9.4f}"
            )
    lines.append(f"clip_frac = {float(clip_frac):.4f}")
    return lines


def show_kl(impl: CoreFunctions, model, batch: PreflightBatch, s, lang: str) -> list[str]:
    g = torch.Generator().manual_seed(s.seed)
    rows = slice(0, min(8, batch.input_ids.shape[0]))
    with torch.no_grad():
        positions = core.position_ids(batch.attention_mask[rows])
        logits = model(
            input_ids=batch.input_ids[rows],
            attention_mask=batch.attention_mask[rows],
            position_ids=positions,
        ).logits[:, :-1]
        candidates = logits[batch.completion_mask[rows, 1:].bool()].double()  # [n, V]
        logp_all = torch.log_softmax(candidates, -1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    logp_new = logp_all[int(entropy.argmax())]  # the least certain real position, [V]
    noise = torch.randn(logp_new.shape, generator=g, dtype=logp_new.dtype)
    logp_ref = torch.log_softmax(logp_new + noise, -1)
    idx = torch.multinomial(logp_new.exp(), 4096, replacement=True, generator=g)
    k3 = impl.kl_k3(logp_new[idx], logp_ref[idx]).double()
    naive = (logp_new[idx] - logp_ref[idx]).double()
    exact = float((logp_new.exp() * (logp_new - logp_ref)).sum())
    return [
        show_text("5_head", lang),
        f"  {show_text('5_first', lang)} {_row(k3[:8], 7)}",
        f"  kl_k3:  min {float(k3.min()):+.4f}   mean {float(k3.mean()):.4f}   "
        f"std {float(k3.std()):.4f}",
        f"  {show_text('5_naive', lang)}  min {float(naive.min()):+.4f}   mean "
        f"{float(naive.mean()):.4f}   std {float(naive.std()):.4f}",
        f"  {show_text('5_exact', lang)} = {exact:.4f}   {show_text('5_note', lang)}",
    ]


def show_aggregation(impl: CoreFunctions, s: PreflightSettings, lang: str) -> list[str]:
    per_token, mask = unequal_lengths_batch(torch.Generator().manual_seed(s.seed))
    lengths = list(UNEQUAL_LENGTHS)
    L = 6
    lines = [
        show_text("6_head", lang, lengths=lengths, L=L),
        f"{'mode':<10} {_right(show_text('6_cols', lang), 9)} "
        f"{_right(show_text('expected_col', lang), 9)}",
    ]
    for mode in core.AGGREGATIONS:
        yours = float(impl.aggregate(per_token, mask, mode, L))
        expected = float(core.aggregate(per_token, mask, mode, L))
        lines.append(f"{mode:<10} {yours:>9.4f} {expected:>9.4f}")
    lines.append(show_text("6_note", lang, agg=s.objective.loss_type))
    return lines


def show_loss(impl: CoreFunctions, model, batch: PreflightBatch, s, lang: str) -> list[str]:
    args = (batch.input_ids, batch.attention_mask, batch.completion_mask, s.objective.temperature)
    g = torch.Generator().manual_seed(s.seed)
    with torch.no_grad():
        logp, mask = impl.sequence_logprobs(model, *args)
        adv = core.group_advantages(batch.rewards, batch.group_size)
        logp_old = logp + 0.2 * torch.randn(logp.shape, generator=g)  # a policy that moved
        logp_ref = logp + 0.1 * torch.randn(logp.shape, generator=g)
        loss, metrics = impl.grpo_loss(
            logp, logp_old, logp_ref, adv, mask, **s.objective.loss_kwargs() | {"beta": 0.04},
        )  # fmt: skip
    lines = [
        show_text("7_head", lang),
        f"  loss = {float(loss):.6f}",
    ]
    lines += [f"  {k:<15} {float(v):.6f}" for k, v in metrics.items()]
    return lines


def show_goal(goal: int, impl: CoreFunctions, model, tokenizer, batch, s, lang: str) -> list[str]:
    shows: dict[int, Callable[[], list[str]]] = {
        1: lambda: show_logprobs(impl, model, tokenizer, batch, s, lang),
        2: lambda: show_advantages(impl, batch, lang),
        3: lambda: show_ratio(impl, model, batch, s, lang),
        4: lambda: show_clip(impl, s, lang),
        5: lambda: show_kl(impl, model, batch, s, lang),
        6: lambda: show_aggregation(impl, s, lang),
        7: lambda: show_loss(impl, model, batch, s, lang),
    }
    with eval_mode(model, zero_grad=True):
        return shows[goal]()
