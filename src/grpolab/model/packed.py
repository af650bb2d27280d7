"""Rows packed into one sequence without padding: each group's prompt once, then its rows'
completions, every token attending only to its own prompt and its own completion.

A padded batch runs B x T positions, T the longest row; with long, uneven completions most of
them are padding (a 512-token row beside 40-token ones). Packed, a micro-batch runs only its
real positions:

    packed    [prompt A][completion A1][completion A2]...[prompt B][completion B1]...   [1, N]
    positions  0 .. p-1  p .. p+n1-1    p .. p+n2-1        (each row's own, as padded)
    attention  a prompt token: the earlier tokens of its prompt; a completion token: its
               group's prompt and the earlier tokens of its own completion (`attention`)

so every completion sees exactly the context it has in its padded row, at the same positions,
and the prompt runs once per group (its gradient the sum of its rows', as one forward per
prompt gives). A row's last token predicts nothing and is left out. The model takes the
pattern as an explicit [1, 1, N, N] mask (sdpa: bool, eager: additive); an attention
implementation that takes no such mask (flash attention) gets the rows packed by position ids
alone, each row with its own copy of the prompt, which transformers runs as variable-length
sequences. Verified once per model against the padded forward (`verify_packing`).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpolab.model.precision import float32_attention
from grpolab.model.prefix import body_hidden
from grpolab.model.verdict import gap_beyond_tolerance, verdict_once

# Attention implementations that read an explicit 4D mask, and those that read packed
# sequences from position ids (variable-length kernels).
MASKED = ("sdpa", "eager")
VARLEN = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn")


@dataclass(frozen=True)
class Packed:
    """One micro-batch packed: input_ids, position_ids [1, N]; attention [1, 1, N, N] (True:
    may attend) or None (the rows told apart by their position ids); predictors [n]: the
    packed position whose hidden state predicts each loss token, in the padded batch's
    row-major order of completion_mask[:, 1:]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention: torch.Tensor | None
    predictors: torch.Tensor
    spans: tuple = ()  # per group (prompt start, prompt end, ((row start, row end), ...))


def _groups(input_ids, attention_mask, P: int, share: bool) -> list[list[int]]:
    """Runs of consecutive rows with the same prompt columns [0, P) (one row each unless
    `share`)."""
    B = input_ids.shape[0]
    if not share or P == 0 or B == 0:
        return [[r] for r in range(B)]
    ids, attn = input_ids[:, :P], attention_mask[:, :P]
    same = ((ids[1:] == ids[:-1]).all(1) & (attn[1:] == attn[:-1]).all(1)).tolist()
    groups = [[0]]
    for r in range(1, B):
        (groups[-1].append(r) if same[r - 1] else groups.append([r]))
    return groups


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    share_prompts: bool = True,
    masked: bool = True,
) -> Packed | None:
    """The rows of [B, T] (prompts left-padded to column P, where the batch's first completion
    token is; completions after them) as one packed sequence, or None when a loss token's
    predecessor is padding (a layout packing cannot keep). share_prompts: a group's prompt
    once; masked: the explicit attention pattern (else position ids alone, no sharing)."""
    B, T = input_ids.shape
    loss = completion_mask[:, 1:].bool()  # [B, T-1]: column t predicts token t+1
    starts = completion_mask.any(dim=0).nonzero()
    P = int(starts[0]) if starts.numel() else T
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T], as padded
    real = attention_mask.bool()
    # Each row's last column that predicts a loss token; nothing after it is needed.
    columns = torch.arange(T - 1, device=loss.device)
    last = torch.where(loss.any(1), (loss * (columns + 1)).amax(1) - 1, -1).tolist()
    where = torch.full((B, T), -1, dtype=torch.long, device=input_ids.device)  # packed index
    tokens, pos, group_of, row_of, spans = [], [], [], [], []
    size = 0
    for g, rows in enumerate(_groups(input_ids, attention_mask, P, share_prompts and masked)):
        start = size
        prompt = real[rows[0], :P].nonzero().squeeze(1)  # the group's real prompt columns
        at = torch.arange(size, size + len(prompt), device=where.device)
        where[torch.tensor(rows, device=where.device)[:, None], prompt[None, :]] = at
        tokens.append(input_ids[rows[0], prompt])
        pos.append(positions[rows[0], prompt])
        group_of.append(torch.full((len(prompt),), g))
        row_of.append(torch.full((len(prompt),), -1))
        size += len(prompt)
        spans.append((start, size, []))
        for r in rows:
            own = real[r, P : last[r] + 1].nonzero().squeeze(1) + P  # suffix columns needed
            where[r, own] = torch.arange(size, size + len(own), device=where.device)
            tokens.append(input_ids[r, own])
            pos.append(positions[r, own])
            group_of.append(torch.full((len(own),), g))
            row_of.append(torch.full((len(own),), r))
            spans[-1][2].append((size, size + len(own)))
            size += len(own)
    predictors = where[:, :-1][loss]  # [n]
    if bool((predictors < 0).any()):
        return None
    group_of, row_of = torch.cat(group_of), torch.cat(row_of)
    spans = tuple((p0, p1, tuple(rows)) for p0, p1, rows in spans)
    attention = None
    if masked:
        dense = _attention(group_of.to(input_ids.device), row_of.to(input_ids.device))
        attention = PackedMask.of(dense, spans)
    return Packed(torch.cat(tokens)[None], torch.cat(pos)[None], attention, predictors, spans)


def _attention(group_of: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """[1, 1, N, N] bool: query a may attend key b when both are of one group, b comes no
    later, and b is its prompt's or a's own completion's (row -1: the prompt)."""
    N = group_of.shape[0]
    index = torch.arange(N, device=group_of.device)
    causal = index[None, :] <= index[:, None]
    same_group = group_of[None, :] == group_of[:, None]
    visible = (row_of[None, :] == -1) | (row_of[None, :] == row_of[:, None])
    return (causal & same_group & visible)[None, None]


class PackedMask(torch.Tensor):
    """The packed attention pattern [1, 1, N, N] bool, and its structure: scaled-dot-product
    attention given it as its mask runs each group apart (`segment_attention`: the prompt
    causally, then its rows' completions against the prompt and themselves), never the
    dense N x N product, most of which the mask throws away. Any other use reads the dense
    pattern itself (what the tensor holds), so a copy that lost the structure still masks
    right."""

    spans: tuple = ()

    @classmethod
    def of(cls, dense: torch.Tensor, spans: tuple) -> PackedMask:
        mask = torch.Tensor._make_subclass(cls, dense)
        mask.spans = spans
        return mask

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        if func is torch._C._nn.scaled_dot_product_attention and getattr(mask, "spans", ()):
            return segment_attention(*args[:3], mask.spans, kwargs.get("scale"))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


# Attention calls cost about this many query-key products on top of their own (a CPU's
# per-call overhead): a group's rows attend in one call where that is cheaper than one each.
CALL_PRODUCTS = 16384


def segment_attention(q, k, v, spans: tuple, scale: float | None) -> torch.Tensor:
    """Scaled-dot-product attention of packed q, k, v [1, heads, N, d] (the key-value heads
    already repeated) group by group: each prompt causally, then its rows' completions
    against the prompt and their own earlier tokens, in one call per group or one per row,
    whichever costs fewer products -> [1, heads, N, d], in packed order. The spans cut N
    into pieces once (torch.split: the backward joins their gradients in one pass)."""
    sizes = [n for p0, p1, rows in spans for n in (p1 - p0, *(e - s for s, e in rows))]
    qs, ks, vs = (iter(torch.split(x, sizes, dim=2)) for x in (q, k, v))
    pieces = []
    for p0, p1, rows in spans:
        prompt, parts = p1 - p0, [(next(qs), next(ks), next(vs)) for _ in range(len(rows) + 1)]
        if prompt:
            pieces.append(_attend(*parts[0], None, scale))
        if not rows:
            continue
        end = rows[-1][1]
        together = (end - p1) * (end - p0) + CALL_PRODUCTS
        apart = sum((e - s) * (prompt + e - s) + CALL_PRODUCTS for s, e in rows if e > s)
        if together <= apart:
            query, keys, values = (torch.cat([x[i] for x in parts[1:]], 2) for i in range(3))
            keys, values = torch.cat([parts[0][1], keys], 2), torch.cat([parts[0][2], values], 2)
            mask = _rows_mask(prompt, rows, q.device)
            pieces.append(_attend(query, keys, values, mask, scale))
            continue
        for (s, e), (query, key, value) in zip(rows, parts[1:], strict=True):
            if e == s:  # a completion whose only token is predicted by the prompt
                continue
            keys, values = torch.cat([parts[0][1], key], 2), torch.cat([parts[0][2], value], 2)
            mask = _rows_mask(prompt, ((s, e),), q.device)
            pieces.append(_attend(query, keys, values, mask, scale))
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in pieces))
    return torch.cat([p.to(dtype) for p in pieces], dim=2)


def _rows_mask(prompt: int, rows: tuple, device) -> torch.Tensor:
    """[L, prompt + L] bool for rows' completions (L tokens in all) packed after their
    prompt: every prompt key, then each row's own earlier tokens."""
    starts = torch.tensor([s for s, e in rows for _ in range(e - s)], device=device)
    index = torch.arange(rows[0][0], rows[-1][1], device=device)  # packed positions
    own = (index[None, :] <= index[:, None]) & (index[None, :] >= starts[:, None])
    return torch.cat([own.new_ones(len(index), prompt), own], dim=1)


def _attend(q, k, v, mask, scale) -> torch.Tensor:
    """One scaled-dot-product attention call (causal when no mask), where the training
    precision runs it: in float32 for short attention on a CPU under bf16 autocast
    (`precision.float32_attention`), as the padded forward's would."""
    if float32_attention(k.shape[-2], q.device):
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = q.float(), k.float(), v.float()
            return F.scaled_dot_product_attention(
                q, k, v, mask, scale=scale, is_causal=mask is None
            )
    return F.scaled_dot_product_attention(q, k, v, mask, scale=scale, is_causal=mask is None)


def packed_sizes(input_ids, attention_mask, completion_mask):
    """(prompt [B], completion [B], first [B] bool): each row's real prompt tokens, the tokens
    of its completion a packed forward runs (up to its last loss token's predictor), and
    whether it starts a group (its prompt differs from the row before it)."""
    B, T = input_ids.shape
    loss = completion_mask[:, 1:].bool()
    starts = completion_mask.any(dim=0).nonzero()
    P = int(starts[0]) if starts.numel() else T
    columns = torch.arange(T - 1, device=loss.device)
    last = torch.where(loss.any(1), (loss * (columns + 1)).amax(1) - 1, P - 1)  # [B]
    needed = torch.arange(P, T, device=loss.device) <= last[:, None]  # [B, T-P]
    completion = (attention_mask[:, P:].bool() & needed).sum(1)
    first = torch.zeros(B, dtype=torch.bool, device=loss.device)
    for rows in _groups(input_ids, attention_mask, P, share=True):
        first[rows[0]] = True
    return attention_mask[:, :P].sum(1), completion, first


def token_budget_parts(input_ids, attention_mask, completion_mask, budget: int) -> list[list[int]]:
    """The rows of [B, T], in order, cut into consecutive runs that each pack into at most
    `budget` positions (a group's prompt once, again in a run that starts inside the group);
    a row that alone exceeds the budget is a run of its own."""
    prompt, completion, first = (
        t.tolist() for t in packed_sizes(input_ids, attention_mask, completion_mask)
    )
    parts: list[list[int]] = []
    used = 0
    for r in range(len(prompt)):
        cost = completion[r] + (prompt[r] if first[r] or not parts or not parts[-1] else 0)
        if parts and parts[-1] and used + cost > budget:
            parts.append([])
            used, cost = 0, completion[r] + prompt[r]  # a new run pays for its prompt
        if not parts:
            parts.append([])
        parts[-1].append(r)
        used += cost
    return parts


def attention_kind(body: torch.nn.Module) -> str | None:
    """How this body's attention takes a packed batch: "masked" (an explicit mask), "varlen"
    (position ids), or None (neither: the padded forward)."""
    implementation = getattr(getattr(body, "config", None), "_attn_implementation", None)
    if implementation in MASKED:
        return "masked"
    if implementation in VARLEN:
        return "varlen"
    return None


def packed_hidden(body, packed: Packed) -> torch.Tensor:
    """The body's final hidden states at the packed predictors: [n, H]."""
    attention = packed.attention
    if attention is not None and getattr(body.config, "_attn_implementation", None) == "eager":
        dtype = next(body.parameters()).dtype
        attention = torch.zeros(attention.shape, dtype=dtype, device=attention.device).masked_fill_(
            ~attention, torch.finfo(dtype).min
        )
    out = body(
        input_ids=packed.input_ids,
        attention_mask=attention,
        position_ids=packed.position_ids,
        use_cache=False,
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0].index_select(0, packed.predictors)


# Verdict per model: None when the packed forward was checked against the padded one.
_VERIFIED: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


def verify_packing(model, body, input_ids, attention_mask, completion_mask) -> str | None:
    """Compare the packed forward's hidden states with the padded forward's on the batch's
    first rows (up to two groups' worth, at most 4 rows), once per model."""
    kind = attention_kind(body)
    if kind is None:
        impl = getattr(body.config, "_attn_implementation", None)
        return f"its attention ({impl}) takes neither a packed mask nor packed position ids"

    def probe() -> str | None:
        rows = slice(0, min(4, input_ids.shape[0]))
        ids, attn, comp = input_ids[rows], attention_mask[rows], completion_mask[rows]
        packed = pack_rows(ids, attn, comp, masked=kind == "masked")
        if packed is None:
            return "a loss token follows padding"
        positions = (attn.long().cumsum(-1) - 1).clamp(min=0)
        expected = body_hidden(body, ids, attn, positions)[:, :-1][comp[:, 1:].bool()]
        err = gap_beyond_tolerance(packed_hidden(body, packed), expected)
        return None if err is None else f"the packed forward differs from the padded by {err:.3g}"

    return verdict_once(_VERIFIED, model, "the packed forward failed", probe)
