"""The fused lm-head: token log-probs from final hidden states and the lm-head weight without
the [N, V] wall, chunked, with an exact recomputing backward.

The plain `log_softmax(logits.float())` holds B * T * V float32 values (Qwen's V = 151,936:
16 x 512 tokens is 5 GB for the log-softmax alone), plus the logits, plus their gradient.
Here only completion positions are projected through the lm-head weight W [V, H], tile by
tile (tokens x vocabulary), with an online log-sum-exp in float32:

    forward   z = h @ W^T / T per tile; online, top = max_j z_j and the sum of
              exp(z_j - top), the target's term apart: logp = -log1p(rest / e_target) at p >= 1/2
    backward  recompute the tile with the saved top and sum S: p = exp(z - top) / S, and
              with the upstream gradient g, grad_z = g * (onehot - p) (the target's
              column written from expm1(logp)); grad_h = grad_z @ W / T, grad_W = grad_z^T @ h / T

so no tensor larger than one tile of logits ever exists, and the work is the three lm-head
matmuls plus one recompute of the logits (the fourth matmul is the price of not storing
[N, V]: the upstream gradient g is unknown until backward). The forward keeps as many
vocabulary chunks of the logits as take no more memory than the weight gradient [V, H]
the backward returns anyway, and the backward reads those instead of recomputing them
(`kept_chunks`): all of them when there are fewer tokens than hidden units, where the
matmuls are most of the time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Logits per tile: big enough for efficient matmuls and few per-tile ops, small enough to be
# noise next to the weights. On CPU, 1M-4M elements measured fastest for H = 64..896.
CPU_TILE_ELEMENTS = 1 << 22  # 16 MB of float32
CUDA_TILE_ELEMENTS = 1 << 25  # 128 MB of float32
MIN_VOCAB_CHUNK = 512


# --- Chunk sizes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunks:
    """Tile shape: `tokens` rows of hidden states times `vocab` rows of the lm-head."""

    tokens: int
    vocab: int


def choose_chunks(
    n_tokens: int, vocab: int, device: torch.device | str = "cpu", tile_elements: int | None = None
) -> Chunks:
    """Tile shape from the problem shape: as many tokens per tile as keeps at least
    MIN_VOCAB_CHUNK vocabulary columns, then as many columns as fill the tile budget."""
    if tile_elements is None:
        is_cuda = torch.device(device).type == "cuda"
        tile_elements = CUDA_TILE_ELEMENTS if is_cuda else CPU_TILE_ELEMENTS
    if tile_elements < 1:
        raise ValueError(f"tile_elements must be >= 1, got {tile_elements}")
    n_tokens, vocab = max(n_tokens, 1), max(vocab, 1)
    tokens = min(n_tokens, max(1, tile_elements // min(vocab, MIN_VOCAB_CHUNK)))
    # Equal token chunks: 1100 tokens as 2 x 550, not 1024 + 76.
    tokens = math.ceil(n_tokens / math.ceil(n_tokens / tokens))
    cols = min(vocab, max(MIN_VOCAB_CHUNK, tile_elements // tokens))
    cols = math.ceil(vocab / math.ceil(vocab / cols))
    return Chunks(tokens=tokens, vocab=cols)


# --- The fused function ----------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Tiles:
    """Reusable tile buffers: on a CPU a fresh multi-megabyte tensor per tile costs page
    faults, so every tile of a call is written into the same memory."""

    def __init__(self, chunks: Chunks, dtype: torch.dtype, device: torch.device, n_aux: int):
        size = chunks.tokens * chunks.vocab
        self.acc_dtype = _acc_dtype(dtype)
        self.main = torch.empty(size, dtype=self.acc_dtype, device=device)
        self.aux = torch.empty(size * n_aux, dtype=self.acc_dtype, device=device)
        # Low-precision weights: the matmul writes here first, as the model's lm-head would.
        self.low = (
            None if dtype == self.acc_dtype else torch.empty(size, dtype=dtype, device=device)
        )

    def logits(
        self,
        h: torch.Tensor,
        w: torch.Tensor,
        inv_t: float,
        shift: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h @ w^T * inv_t (- shift[:, None]) as a float32 [n, v] tile (in `out` if given)."""
        n, v = h.shape[0], w.shape[0]
        out = self.tile((n, v)) if out is None else out
        if self.low is None:
            # (mm, then a pass to shift, measured faster on CPU than addmm with a broadcast
            # input, which copies it into `out` and then reads it back in the GEMM.)
            torch.mm(h, w.t(), out=out)
        else:
            low = self.low[: n * v].view(n, v)
            torch.mm(h, w.t(), out=low)  # rounded to the weight dtype, as model(...).logits is
            out.copy_(low)
        if inv_t != 1.0:
            out.mul_(inv_t)
        if shift is not None:
            out.sub_(shift[:, None])
        return out

    def shifted_logits(self, h, w, inv_t: float, top, kept=None) -> torch.Tensor:
        """z - top[:, None] as a float32 [n, v] tile: recomputed from h and w, or from the
        forward's kept logits z [n, v]."""
        if kept is None:
            return self.logits(h, w, inv_t, shift=top)
        return torch.sub(kept, top[:, None], out=self.tile(kept.shape))

    def tile(self, shape: tuple[int, int]) -> torch.Tensor:
        return self.main[: shape[0] * shape[1]].view(shape)

    def second(self, like: torch.Tensor) -> torch.Tensor:
        return self.aux[: like.numel()].view(like.shape)

    def low_precision(self, a: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """`a` (times scale[:, None]) cast to the weight dtype, in one pass."""
        low = self.low[: a.numel()].view(a.shape)
        if scale is None:
            return low.copy_(a)
        return torch.mul(a, scale[:, None], out=low)


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    inv_t: float,
    chunks: Chunks,
    with_entropy: bool,
    keep_chunks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, list | None]:
    """(logp [N], top [N], total [N], entropy [N] or None, logits), in float32 (float64 for
    float64 inputs), where top = max_j z_j and total = sum_j exp(z_j - top) over the whole
    vocabulary; logits: z itself, [N, v], for the first keep_chunks vocabulary chunks
    (None for the others), or None when keep_chunks is 0.

    Where precision goes for a confident token (1 - p small; GRPO samples many): the
    log-sum-exp as one float32 number lse = top + log(total) is rounded to the ulp of |z|
    (2e-6 at |z| ~ 20), and total = 1 + (the rest) to the ulp of 1 (1.2e-7); either
    rounding can be as large as 1 - p itself. So the log-sum-exp is kept as the pair (top,
    total), and the target's own term is summed apart from the rest: log p = -log1p(rest /
    e_t) is then as precise as float32 allows, however close p is to 1."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    tiles = _Tiles(chunks, weight.dtype, weight.device, n_aux=int(with_entropy))
    acc = tiles.acc_dtype
    top = torch.full((n_tokens,), -math.inf, dtype=acc, device=hidden.device)
    # sum over the columns seen so far, the target's own left out, of exp(z_j - top)
    # (and of exp(z_j - top) * (z_j - top), for the entropy)
    rest = torch.zeros(n_tokens, dtype=acc, device=hidden.device)
    spread = torch.zeros(n_tokens, dtype=acc, device=hidden.device) if with_entropy else None
    target_logit = torch.zeros(n_tokens, dtype=acc, device=hidden.device)
    kept = [] if keep_chunks else None
    for v0 in range(0, vocab, chunks.vocab):
        w = weight[v0 : v0 + chunks.vocab]  # [v, H]
        v = w.shape[0]
        local = targets - v0  # [N]
        here = (local >= 0) & (local < v)
        local = local.clamp(0, v - 1)
        store = None
        if v0 < keep_chunks * chunks.vocab:
            store = torch.empty(n_tokens, v, dtype=acc, device=w.device)
        for n0 in range(0, n_tokens, chunks.tokens):
            rows = slice(n0, n0 + chunks.tokens)
            column, in_tile = local[rows, None], here[rows]  # [n, 1], [n]
            raw = tiles.logits(hidden[rows], w, inv_t, out=None if store is None else store[rows])
            picked = raw.gather(1, column).squeeze(1)  # [n]
            target_logit[rows] += torch.where(in_tile, picked, torch.zeros_like(picked))
            # Max, shift, exp, sum; in place unless the logits are kept.
            tile_top = raw.amax(dim=1)  # [n]
            if store is None:
                z = raw.sub_(tile_top[:, None])
            else:
                z = torch.sub(raw, tile_top[:, None], out=tiles.tile(raw.shape))
            e = torch.exp(z, out=tiles.second(z)) if spread is not None else z.exp_()
            e_target = e.gather(1, column).squeeze(1)
            zero = torch.zeros_like(e_target)
            e.scatter_(1, column, torch.where(in_tile, zero, e_target)[:, None])
            tile_rest = e.sum(dim=1)  # [n]
            # sum e * (z - tile_top)
            tile_spread = torch.linalg.vecdot(e, z) if spread is not None else None
            if v0 == 0:  # every row's first vocabulary chunk
                top[rows], rest[rows] = tile_top, tile_rest
                if spread is not None:
                    spread[rows] = tile_spread
                continue
            _merge_sums(top, rest, spread, rows, tile_top, tile_rest, tile_spread)
        if kept is not None:
            kept.append(store)
    logp, total, entropy = _from_sums(target_logit, top, rest, spread)
    return logp, top, total, entropy, kept


def _merge_sums(top, rest, spread, rows: slice, tile_top, tile_rest, tile_spread) -> None:
    """The running (top, rest, spread) of `rows` and a tile's, merged in place: both sums
    re-expressed relative to the larger of the two maxima."""
    new_top = torch.maximum(top[rows], tile_top)
    old_shift, tile_shift = top[rows] - new_top, tile_top - new_top  # <= 0
    old_scale, tile_scale = torch.exp(old_shift), torch.exp(tile_shift)
    if spread is not None:
        spread[rows] = old_scale * (spread[rows] + old_shift * rest[rows]) + (
            tile_scale * (tile_spread + tile_shift * tile_rest)
        )
    rest[rows] = old_scale * rest[rows] + tile_scale * tile_rest
    top[rows] = new_top


def _from_sums(target_logit, top, rest, spread):
    """(logp, total, entropy or None) [N] from the whole vocabulary's running sums."""
    target_shift = target_logit - top  # <= 0
    target_term = torch.exp(target_shift)
    total = target_term + rest
    log_total = torch.log(total)
    # p >= 1/2: log p = -log1p(rest / e_t); below 1/2 the direct form has nothing to cancel.
    logp = torch.where(
        target_term >= rest, -torch.log1p(rest / target_term), target_shift - log_total
    )
    entropy = None
    if spread is not None:  # H = -sum p log p = log(total) - sum p (z - top)
        entropy = log_total - (spread + target_term * target_shift) / total
    return logp, total, entropy


# _backward's maths. With z = logits / T, e = exp(z - top), S = total: p = e / S and
# log p = z - top - log S. d logp / dz = onehot - p and d entropy / dz = -p * (log p +
# entropy), so grad_z = -B / S with B = e * (g + gE * (log p + entropy)) - S * g * onehot, and
# grad_h = -(B @ W) / (S T),  grad_W = -B^T @ (h / S) / T.
# 1 / S (times g, when there is no entropy gradient) is a per-row factor: in full precision it
# goes on the small [n, H] side of the matmuls instead of a pass over the tile.
# The target's column of B is S * (g * (p_t - 1) + ...): formed on the tile as e_t - S it
# would be the difference of two numbers near S whose roundings are all that is left of
# 1 - p_t for a confident token. It is written instead from the forward's log-prob as
# S * (g * expm1(logp_t) + p_t * gE * (logp_t + entropy)), to float32's relative precision.
@dataclass
class Saved:
    """What the forward keeps for the backward: its inputs, the per-token sums (top, total
    [N]), the log-probs and entropy [N] it returned, and the kept logit chunks (`_forward`'s
    `logits`: [N, v] or None per vocabulary chunk; None: all recomputed)."""

    hidden: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V, H]
    targets: torch.Tensor  # [N] long
    top: torch.Tensor  # [N]
    total: torch.Tensor  # [N]
    logp: torch.Tensor  # [N]
    entropy: torch.Tensor | None  # [N]
    inv_t: float
    chunks: Chunks
    kept: list | None = None


def _backward(
    saved: Saved,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients w.r.t. hidden [N, H] and weight [V, H], one recomputed tile at a time (or
    read from the forward's kept logits, each chunk freed once its gradient is written).
    The maths: the comment above."""
    hidden, weight, targets, kept = saved.hidden, saved.weight, saved.targets, saved.kept
    top, inv_t, chunks = saved.top, saved.inv_t, saved.chunks
    entropy = saved.entropy
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = _acc_dtype(weight.dtype)
    device = hidden.device
    g = grad_logp.to(acc) if grad_logp is not None else top.new_zeros(n_tokens)
    with_entropy_grad = grad_entropy is not None and entropy is not None
    low_precision = weight.dtype != acc
    g_entropy = grad_entropy.to(acc) if with_entropy_grad else None
    target_value, offset, row_factor = _row_factors(g, g_entropy, saved.logp, entropy, saved.total)
    tiles = _Tiles(chunks, weight.dtype, weight.device, n_aux=int(with_entropy_grad))
    # Right-hand side of the weight-gradient matmul: h scaled by the row factor, unless the
    # factor is on the tile (low precision: the tile is rounded once, already scaled).
    rhs = hidden if low_precision else (row_factor[:, None] * hidden)  # [N, H]

    b_w = torch.zeros(n_tokens, weight.shape[1], dtype=acc, device=device) if need_hidden else None
    # Full precision: each chunk's rows are overwritten by its first token chunk (beta = 0),
    # so the [V, H] gradient needs no zeroing pass (unless there is no token at all).
    grad_weight = None
    if need_weight:
        grad_weight = torch.empty_like(weight) if n_tokens else torch.zeros_like(weight)

    for k, v0 in enumerate(range(0, vocab, chunks.vocab)):
        w = weight[v0 : v0 + chunks.vocab]  # [v, H]
        v = w.shape[0]
        local = targets - v0  # [N]
        here = (local >= 0) & (local < v)
        local = local.clamp(0, v - 1)
        stored = None if kept is None else kept[k]  # [N, v] or None
        gw = None  # this chunk's rows of the weight gradient
        if need_weight:
            # Low precision: this chunk's weight-gradient rows summed in float32, rounded once.
            gw = (
                torch.zeros(v, w.shape[1], dtype=acc, device=device)
                if low_precision
                else grad_weight[v0 : v0 + v]
            )
        for n0 in range(0, n_tokens, chunks.tokens):
            rows = slice(n0, n0 + chunks.tokens)
            shifted = None if stored is None else stored[rows]
            b = tiles.shifted_logits(hidden[rows], w, inv_t, top[rows], shifted)  # z - top
            if with_entropy_grad:
                e = torch.exp(b, out=tiles.second(b))
                b.mul_(g_entropy[rows, None]).add_(offset[rows, None]).mul_(e)
            else:
                b.exp_()  # e
            _write_target_column(b, local[rows, None], here[rows], target_value[rows])
            if low_precision:
                b = tiles.low_precision(b, row_factor[rows])
            _add_tile_grads(b, w, rows, b_w, gw, rhs, inv_t, n0 == 0, low_precision)
        if need_weight and low_precision:
            grad_weight[v0 : v0 + v] = gw
        if kept is not None:
            kept[k] = None  # a second backward (retain_graph) recomputes it

    grad_hidden = None
    if need_hidden:
        scale = -inv_t if low_precision else -inv_t * row_factor[:, None]
        grad_hidden = (b_w * scale).to(hidden.dtype)
    return grad_hidden, grad_weight


def _add_tile_grads(
    b, w, rows: slice, b_w, gw, rhs, inv_t: float, first: bool, low_precision: bool
) -> None:
    """One tile's share of B @ W into b_w[rows] [n, H] and of -B^T @ rhs / T into gw [v, H]
    (either None: not wanted). In full precision the first token tile overwrites gw; in low
    precision b is in the weight dtype and gw sums in float32."""
    if b_w is not None:
        if low_precision:
            b_w[rows] += torch.mm(b, w)
        else:
            b_w[rows].addmm_(b, w)  # [n, H]
    if gw is not None:
        if low_precision:
            gw.sub_(torch.mm(b.t(), rhs[rows]), alpha=inv_t)
        else:
            gw.addmm_(b.t(), rhs[rows], beta=0.0 if first else 1.0, alpha=-inv_t)  # [v, H]


def _row_factors(g, g_entropy, logp, entropy, total):
    """(target_value, offset or None, row_factor) [N] of _backward's B: the target's column
    from the forward's log-prob, the per-row part of B's exponent weight (entropy only), and
    the per-row factor 1 / S (g / S without an entropy gradient)."""
    if g_entropy is not None:
        target_value = total * (
            g * torch.expm1(logp) + torch.exp(logp) * g_entropy * (logp + entropy)
        )
        # B = e * (offset + gE * (z - top)): the per-row part of g + gE * (log p + entropy).
        offset = g + g_entropy * (entropy - torch.log(total))
        return target_value, offset, 1.0 / total
    # B = e - S * onehot, and g joins the row factor
    return total * torch.expm1(logp), None, g / total


def _write_target_column(b, column, here, target_value) -> None:
    """Each row's target column of the tile b [n, v] set to target_value, where the target
    lies in this chunk (`here`); other rows keep their value."""
    other = b.gather(1, column).squeeze(1)  # rows whose target lies in another chunk
    b.scatter_(1, column, torch.where(here, target_value, other)[:, None])


def kept_chunks(n_tokens: int, weight: torch.Tensor, chunks: Chunks) -> int:
    """How many vocabulary chunks of the logits the forward keeps for the backward, which
    then skips their recompute (a quarter of the lm-head's matmuls, a third for a frozen
    head): as many as take no more memory than the weight [V, H] (its gradient, which the
    backward returns for a trained head). With fewer tokens than hidden units that is all
    of them (N x 4 bytes <= H x the weight's bytes); there the matmuls are most of the time,
    and the recompute would cost more than the plain whole log-softmax. The backward frees
    each chunk as it goes: for a trained head the peak grows by about one chunk, not by the
    budget; for a frozen one by the budget, between the head's forward and its backward."""
    vocab, hidden_size = weight.shape
    budget = vocab * hidden_size * weight.dtype.itemsize  # bytes of the weight (gradient)
    chunk = max(n_tokens, 1) * chunks.vocab * _acc_dtype(weight.dtype).itemsize
    return min(math.ceil(vocab / chunks.vocab), budget // chunk)


class FusedTokenLogprobs(torch.autograd.Function):
    """logp[i] = log_softmax(hidden[i] @ weight^T / T)[targets[i]], tile by tile."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, chunks, with_entropy):
        wanted = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]  # a backward will run
        keep = kept_chunks(hidden.shape[0], weight, chunks) if wanted else 0
        logp, top, total, entropy, kept = _forward(
            hidden, weight, targets, inv_t, chunks, with_entropy, keep
        )
        ctx.save_for_backward(hidden, weight, targets, top, total, logp, entropy)
        ctx.inv_t, ctx.chunks, ctx.kept = inv_t, chunks, kept
        ctx.set_materialize_grads(False)  # an unused entropy costs nothing in backward
        return logp if entropy is None else (logp, entropy)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        # (The tensors go through save_for_backward, which checks that none was modified.)
        saved = Saved(*ctx.saved_tensors, inv_t=ctx.inv_t, chunks=ctx.chunks, kept=ctx.kept)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden, grad_weight = _backward(
            saved, grad_logp, grad_entropy, need_hidden, need_weight
        )
        return grad_hidden, grad_weight, None, None, None, None


def fused_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of targets[i] under softmax(hidden[i] @ weight^T / temperature).

    hidden [N, H], weight [V, H] (same dtype), targets [N] int. Returns logp [N] float32
    (float64 for float64 inputs), and entropy [N] of the same distribution when
    return_entropy. Differentiable w.r.t. hidden and weight; the [N, V] logits never exist.
    Chunk sizes default to `choose_chunks` of the shape.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H] with the same H, got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) dtypes differ")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be > 0, got {temperature}")
    targets = targets.long()
    vocab = weight.shape[0]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        bad = targets[(targets < 0) | (targets >= vocab)][:5].tolist()
        raise ValueError(f"targets must be in [0, {vocab}), got {bad}")
    for name, value in (("token_chunk", token_chunk), ("vocab_chunk", vocab_chunk)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    auto = choose_chunks(hidden.shape[0], vocab, hidden.device)
    chunks = Chunks(tokens=token_chunk or auto.tokens, vocab=vocab_chunk or auto.vocab)
    hidden, weight = hidden.contiguous(), weight.contiguous()
    inv_t = 1.0 / float(temperature)

    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if not needs_grad:  # logp_old / reference log-probs: nothing is kept for a backward
        logp, _, _, entropy, _ = _forward(hidden, weight, targets, inv_t, chunks, return_entropy)
        return (logp, entropy) if return_entropy else logp
    return FusedTokenLogprobs.apply(hidden, weight, targets, inv_t, chunks, return_entropy)
