"""Token log-probs without the [B, T, V] wall: a chunked lm-head with an exact backward.

The plain `log_softmax(logits.float())` holds B * T * V float32 values (Qwen's V = 151,936:
16 x 512 tokens is 5 GB for the log-softmax alone), plus the logits, plus their gradient.
Here the model is split into its body (everything up to and including the final norm) and
the lm-head weight W [V, H]; only completion positions are projected, tile by tile
(tokens x vocabulary), with an online log-sum-exp in float32:

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
matmuls are most of the time. `impl="naive"` is the plain code (`core.sequence_logprobs`),
kept as the reference.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from dataclasses import dataclass

import torch

from grpolab import core
from grpolab.model.policy import eval_mode, plain_kv_cache
from grpolab.model.precision import cached_cast

log = logging.getLogger("grpolab")

IMPLS = ("fused", "naive")

# Config attributes of models whose logits are not `final_hidden @ W^T` (soft-capping,
# logit scaling, muP width scaling): these models take the naive path.
LOGIT_TRANSFORMS = (
    "final_logit_softcapping",  # Gemma 2/3
    "logit_scale",  # Cohere
    "logits_scaling",  # Granite
    "dim_model_base",  # MiniCPM (divides the hidden state before the head)
    "mup_width_multiplier",
    "output_multiplier_scale",
)

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
def _backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    top: torch.Tensor,
    total: torch.Tensor,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    inv_t: float,
    chunks: Chunks,
    need_hidden: bool,
    need_weight: bool,
    kept: list | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients w.r.t. hidden [N, H] and weight [V, H], one recomputed tile at a time (or
    read from the forward's kept logits, each chunk freed once its gradient is written).
    The maths: the comment above."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    acc = _acc_dtype(weight.dtype)
    device = hidden.device
    g = grad_logp.to(acc) if grad_logp is not None else top.new_zeros(n_tokens)
    with_entropy_grad = grad_entropy is not None and entropy is not None
    low_precision = weight.dtype != acc
    g_entropy = grad_entropy.to(acc) if with_entropy_grad else None
    target_value, offset, row_factor = _row_factors(g, g_entropy, logp, entropy, total)
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
    then skips their recompute (a quarter of the lm-head's matmuls): as many as take no
    more memory than the weight gradient [V, H] the backward returns anyway. With fewer
    tokens than hidden units that is all of them (N x 4 bytes <= H x the weight's bytes);
    there the matmuls are most of the time, and the fourth would cost more than the
    plain whole log-softmax. The backward frees each chunk as it goes, so the peak grows
    by about one chunk, not by the budget."""
    vocab, hidden_size = weight.shape
    budget = vocab * hidden_size * weight.dtype.itemsize  # bytes of the weight gradient
    chunk = max(n_tokens, 1) * chunks.vocab * _acc_dtype(weight.dtype).itemsize
    return min(math.ceil(vocab / chunks.vocab), budget // chunk)


class FusedTokenLogprobs(torch.autograd.Function):
    """logp[i] = log_softmax(hidden[i] @ weight^T / T)[targets[i]], tile by tile."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, chunks, with_entropy):
        keep = kept_chunks(hidden.shape[0], weight, chunks) if ctx.needs_input_grad[1] else 0
        logp, top, total, entropy, kept = _forward(
            hidden, weight, targets, inv_t, chunks, with_entropy, keep
        )
        ctx.save_for_backward(hidden, weight, targets, top, total, logp, entropy)
        ctx.inv_t, ctx.chunks, ctx.kept = inv_t, chunks, kept
        ctx.set_materialize_grads(False)  # an unused entropy costs nothing in backward
        return logp if entropy is None else (logp, entropy)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, targets, top, total, logp, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        grad_hidden, grad_weight = _backward(
            hidden,
            weight,
            targets,
            top,
            total,
            logp,
            entropy,
            grad_logp,
            grad_entropy,
            ctx.inv_t,
            ctx.chunks,
            need_hidden=ctx.needs_input_grad[0],
            need_weight=ctx.needs_input_grad[1],
            kept=ctx.kept,
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


# --- Splitting a model into body and lm-head ---------------------------------------------------


@dataclass
class Split:
    """A causal LM as body (up to and including the final norm) and lm-head weight [V, H].

    `reason` is None when the split reproduces the model's logits; otherwise it says why
    the model must take the naive path (and body / weight may be None)."""

    body: torch.nn.Module | None
    weight: torch.Tensor | None
    reason: str | None = None


def split_model(model: torch.nn.Module) -> Split:
    """Find the decoder body and the lm-head weight generically (Llama/Qwen2-style models),
    or say why the logits are not `body(...).last_hidden_state @ W^T` for this model."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return Split(
            None, None, "DistributedDataParallel wrapper: calling its body skips the gradient sync"
        )
    if type(model).__name__.startswith("FSDP"):  # FSDP2 fully_shard renames the class
        return Split(None, None, "FSDP2-sharded root: the lm-head weight is a shard")
    name = type(model).__name__
    config = getattr(model, "config", None)
    for attr in LOGIT_TRANSFORMS:
        value = getattr(config, attr, None)
        if value is not None and value is not False and value != 1:
            return Split(None, None, f"{name} transforms its logits (config.{attr}={value!r})")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        return Split(None, None, f"{name} has no output embeddings (get_output_embeddings())")
    if type(head) is not torch.nn.Linear:
        return Split(None, None, f"{name}'s lm-head is a {type(head).__name__}, not a plain Linear")
    if head.bias is not None:
        return Split(None, None, f"{name}'s lm-head has a bias")
    body = None
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            body = get_decoder()
        except (AttributeError, NotImplementedError, ValueError):
            body = None
    if body is None or body is model:
        prefix = getattr(model, "base_model_prefix", "")
        body = getattr(model, prefix, None) if prefix else None
    if body is None or body is model:
        return Split(None, None, f"{name}: no decoder body (get_decoder() / base_model_prefix)")
    return Split(body, head.weight)


# Verdict per model object: None when the split was checked against model(...).logits.
_VERIFIED: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


def _body_hidden(body, input_ids, attention_mask, position_ids) -> torch.Tensor:
    out = body(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _gap_beyond_tolerance(got: torch.Tensor, expected: torch.Tensor) -> float | None:
    """max |got - expected| when it exceeds the dtype's tolerance (1e-4 in float32, 2e-2 in
    16-bit, relative to max(1, max |expected|)); None when within it."""
    tol = 1e-4 if expected.dtype in (torch.float32, torch.float64) else 2e-2
    err = (got.float() - expected.float()).abs().max().item()
    scale = max(1.0, expected.float().abs().max().item())
    return None if err <= tol * scale else err


def _verdict_once(verdicts, model, failure: str, probe) -> str | None:
    """probe() -> None or what is wrong, run once per model in eval mode (dropout would make
    two forwards differ) without grad; an exception is a verdict too. Cached in verdicts."""
    if model in verdicts:
        return verdicts[model]
    device_type = next(model.parameters()).device.type
    try:  # in the model's own precision: autocast's rounding would blur what is checked
        with eval_mode(model), torch.no_grad(), torch.autocast(device_type, enabled=False):
            reason = probe()
    except Exception as e:  # any model that cannot be called this way takes the other path
        reason = f"{failure}: {type(e).__name__}: {e}"

    if reason is not None:
        reason = f"{type(model).__name__}: {reason}"
    verdicts[model] = reason
    return reason


def _verify_split(model, split: Split, input_ids, attention_mask) -> str | None:
    """Compare the split's logits with the model's own on a short slice of the batch, once
    per model: catches what no config attribute announces (a scaled head, a wrapper)."""

    def probe() -> str | None:
        real = input_ids[0][attention_mask[0].bool()]
        ids = (real if real.numel() else input_ids[0])[:16][None]  # [1, <=16], no padding
        attn = torch.ones_like(ids)
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        expected = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
        got = torch.nn.functional.linear(_body_hidden(split.body, ids, attn, pos), split.weight)
        if got.shape != expected.shape:
            return f"body + lm-head give logits {tuple(got.shape)}, model {tuple(expected.shape)}"
        if (err := _gap_beyond_tolerance(got, expected)) is not None:
            return f"body + lm-head differ from the model's logits by {err:.3g}"
        return None

    return _verdict_once(_VERIFIED, model, "calling the body failed", probe)


# --- One forward per distinct prompt -----------------------------------------------------------
#
# The G completions of a prompt share its tokens, so the body can run the prompt once per group
# and the completions against that prompt's keys and values, repeated G times in the batch
# (an index, so backward sums the G rows' gradients into the one prompt forward: the same
# gradient as G separate prompt forwards). Exact up to float summation order; on GRPO batches
# (prompt ~ half the tokens, G = 8-16) it removes most of the prompt's share of the work.


@dataclass(frozen=True)
class PrefixPlan:
    """Columns [0, length) are the shared prefix; rows `firsts` [U] hold the distinct prefixes
    and `owner` [B] maps each row to its prefix's position in `firsts`."""

    length: int
    firsts: torch.Tensor  # [U] long
    owner: torch.Tensor  # [B] long, values in [0, U)


def plan_shared_prefix(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor
) -> PrefixPlan | None:
    """Runs of consecutive rows with identical prompt columns, or None when sharing would not
    pay (fewer than two rows per distinct prompt on average) or does not apply.

    The prefix ends where the first completion token of the batch starts; its last column must
    be a real token in every row (a left-padded prompt layout, as every engine returns)."""
    B = input_ids.shape[0]
    starts = completion_mask.any(dim=0).nonzero()
    if B < 2 or starts.numel() == 0:
        return None
    length = int(starts[0])
    if length < 2 or not bool(attention_mask[:, length - 1].all()):
        return None
    ids, attn = input_ids[:, :length], attention_mask[:, :length]
    same = (ids[1:] == ids[:-1]).all(dim=1) & (attn[1:] == attn[:-1]).all(dim=1)  # [B-1]
    is_first = torch.cat([same.new_ones(1), ~same])  # [B]
    firsts = is_first.nonzero().squeeze(1)  # [U]
    if 2 * firsts.numel() > B:
        return None
    return PrefixPlan(length, firsts, is_first.long().cumsum(0) - 1)


MAX_SUFFIX_BUCKETS = 4
MIN_BUCKET_SAVING = 0.125  # a bucket must save this share of the unbucketed positions


def suffix_buckets(needed: torch.Tensor) -> list[torch.Tensor]:
    """Rows grouped so that each group pads only to its own longest row.

    needed [B] long: suffix columns each row needs. Rows are sorted longest first and a group
    is split at the cut that saves the most padded positions, while a cut saves at least
    MIN_BUCKET_SAVING of the one-group positions (each group costs a forward of its own),
    up to MAX_SUFFIX_BUCKETS groups. Returns row indices per group, longest group first."""
    order = torch.argsort(needed, descending=True, stable=True)
    lengths = needed[order].tolist()  # descending
    total = len(lengths) * (lengths[0] if lengths else 0)
    spans = [(0, len(lengths))]
    while len(spans) < MAX_SUFFIX_BUCKETS:
        best = (MIN_BUCKET_SAVING * total, None, None)
        for k, (a, b) in enumerate(spans):
            # A cut before i pads [a, i) to lengths[a] and [i, b) to lengths[i].
            for i in range(a + 1, b):
                if lengths[i] == lengths[i - 1]:
                    continue
                saving = (b - i) * (lengths[a] - lengths[i])
                if saving > best[0]:
                    best = (saving, k, i)
        _, k, i = best
        if k is None:
            break
        a, b = spans[k]
        spans[k : k + 1] = [(a, i), (i, b)]
    return [order[a:b] for a, b in spans]


def _prefix_hidden(
    body, input_ids, attention_mask, position_ids, plan: PrefixPlan, replay: bool = False
):
    """Final hidden states at positions [plan.length - 1, T - 1) -> [B, T - length, H]: what
    predicts the tokens in columns [length, T), zeros past each row's last real token. None
    if the body keeps no plain KV cache. `replay`: caches that checkpointed layers may run
    twice (`_replayable_cache`), for a model under gradient checkpointing."""
    from transformers.cache_utils import DynamicCache

    P = plan.length
    B, T = input_ids.shape
    rows = plan.firsts
    if replay and not plain_kv_cache(DynamicCache(config=body.config)):
        return None
    # Under checkpointing transformers turns use_cache off; a cache passed in is still used.
    given = _replayable_cache(body.config.num_hidden_layers) if replay else None
    with _cache_through_checkpoints(body, replay):
        out = body(
            input_ids=input_ids[rows, :P],
            attention_mask=attention_mask[rows, :P],
            position_ids=position_ids[rows, :P],
            past_key_values=given,
            use_cache=not replay,
        )
    prefix = given if replay else out.past_key_values  # [U, heads, P, d] per layer
    if not replay and not plain_kv_cache(prefix):
        return None
    last = out.last_hidden_state[:, -1]  # [U, H], predicts column P
    window = last.new_zeros(B, T - P, last.shape[-1])
    # index_select, not last[plan.owner]: with repeated indices the backward of advanced
    # indexing accumulates in a thread-dependent order on CPU; index_select's does not.
    window[:, 0] = last.index_select(0, plan.owner)
    # Row r's hidden states are needed up to its last real token but one (that token's
    # prediction lies past the row), i.e. suffix columns [P, P + needed[r]).
    real = attention_mask[:, P:].bool()  # [B, T-P]
    columns = torch.arange(1, T - P + 1, device=real.device)
    needed = ((real * columns).amax(dim=1) - 1).clamp(min=0)  # [B]
    for bucket in suffix_buckets(needed):
        width = int(needed[bucket].max())
        if width == 0:
            continue
        owners = plan.owner[bucket]  # this bucket's rows' prompts, by index
        selected = [
            (layer.keys.index_select(0, owners), layer.values.index_select(0, owners))
            for layer in prefix.layers
        ]
        if replay:
            cache = _replayable_cache(len(selected), selected)
        else:
            cache = DynamicCache()
            for i, (keys, values) in enumerate(selected):
                cache.update(keys, values, i)
        with _cache_through_checkpoints(body, replay):
            out = body(
                input_ids=input_ids[bucket, P : P + width],
                attention_mask=attention_mask[bucket, : P + width],
                position_ids=position_ids[bucket, P : P + width],
                past_key_values=cache,
                use_cache=not replay,
            )
        window[bucket, 1 : 1 + width] = out.last_hidden_state  # [b, width, H]
    return window


def _replayable_cache(num_layers: int, bases: list | None = None):
    """A plain KV cache whose layers may be replayed: each layer's update returns its base
    (the prompt's keys and values, or nothing) followed by the new ones, the same on every
    call. A checkpointed decoder layer runs its forward a second time in backward; a
    DynamicLayer would append the keys again there and hand attention a longer cache."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class ReplayableLayer(DynamicLayer):
        def __init__(self, base):
            super().__init__()
            self.base = base
            if base is not None:
                self.lazy_initialization(*base)
                self.keys, self.values = base

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self.base is None:
                self.keys, self.values = key_states, value_states
            else:
                self.keys = torch.cat([self.base[0], key_states], dim=-2)
                self.values = torch.cat([self.base[1], value_states], dim=-2)
            return self.keys, self.values

    cache = DynamicCache()
    cache.layers = [ReplayableLayer(None if bases is None else bases[i]) for i in range(num_layers)]
    return cache


@contextlib.contextmanager
def _cache_through_checkpoints(body, replay: bool):
    """transformers' checkpointed layers drop a KV cache unless told that they only read
    it; a replayable cache is read-only in that sense, so they keep it inside the block."""
    wanted = "_can_checkpoint_with_cache"
    layers = [m for m in body.modules() if hasattr(m, wanted)] if replay else []
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache  # back to the class's own value


# Verdict per model: None when one-forward-per-prompt was checked against the plain forward.
_PREFIX_VERIFIED: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = (
    weakref.WeakKeyDictionary()
)


def _verify_shared_prefix(model, body, input_ids, attention_mask, position_ids, plan) -> str | None:
    """Compare with the plain forward on one shared prefix and two suffixes, once per model."""

    def probe() -> str | None:
        first = int((plan.owner[1:] == plan.owner[:-1]).nonzero()[0])  # a run of >= 2 rows
        rows = torch.tensor([first, first + 1], device=input_ids.device)
        zeros = torch.zeros(2, dtype=torch.long, device=rows.device)
        small = PrefixPlan(plan.length, rows[:1], zeros)
        ids, attn, pos = input_ids[rows], attention_mask[rows], position_ids[rows]
        expected = _body_hidden(body, ids, attn, pos)[:, plan.length - 1 : -1]
        keep = attn[:, plan.length :].bool()  # positions that predict a real token
        for replay in (False, True):  # the caches of a plain and of a checkpointed model
            got = _prefix_hidden(body, ids, attn, pos, small, replay)
            if got is None:
                return "shared-prefix forward: its KV cache is not a plain per-layer concatenation"
            err = _gap_beyond_tolerance(got[keep], expected[keep])
            if err is not None:
                return f"shared-prefix forward differs from one by {err:.3g}"
        return None

    return _verdict_once(_PREFIX_VERIFIED, model, "the shared-prefix forward failed", probe)


def _checkpointing(model) -> bool:
    return model.training and getattr(model, "is_gradient_checkpointing", False)


def shared_prefix_status(model, input_ids, attention_mask, completion_mask) -> str | None:
    """None when `token_logprobs` (fused) runs this batch one forward per prompt, else why not.
    Call after a `token_logprobs` call on the same model (the first one verifies the model)."""
    if plan_shared_prefix(input_ids, attention_mask, completion_mask) is None:
        return "fewer than two rows per distinct prompt"
    return _PREFIX_VERIFIED.get(model, "not yet verified on this model")


# --- The API the trainer calls -----------------------------------------------------------------


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    impl: str = "fused",
    return_entropy: bool = False,
    prompt_length: int | None = None,
    shared_prefix: bool = True,
):
    """Log-prob of each sampled token at the sampling temperature: the contract of
    `core.sequence_logprobs`, with zeros where the mask is 0.

    input_ids, attention_mask, completion_mask: [B, T]. Returns (logp [B, T-1] float32,
    mask [B, T-1] float32), plus entropy [B, T-1] float32 when return_entropy; logp[:, t]
    is the log-prob of input_ids[:, t+1], mask[:, t] = completion_mask[:, t+1].
    impl="fused" projects only completion positions through the lm-head in tiles;
    impl="naive" is the plain full-logits path (`core.sequence_logprobs`).
    prompt_length: the column where completions start (all rows), if known.
    shared_prefix: on the fused path, run the body once per distinct prompt of consecutive
    rows (a GRPO group) and the completions against its cached keys and values.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {list(IMPLS)}")
    core._check_same_shape(
        input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask
    )
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, T] with T >= 2, got {tuple(input_ids.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    T = input_ids.shape[1]
    if prompt_length is not None:
        if isinstance(prompt_length, bool) or not isinstance(prompt_length, int):
            raise ValueError(f"prompt_length must be an int or None, got {prompt_length!r}")
        if not 1 <= prompt_length <= T - 1:
            raise ValueError(
                f"prompt_length must be in [1, {T - 1}] for T={T}, got {prompt_length}"
            )
        if completion_mask[:, :prompt_length].any():
            raise ValueError(
                f"prompt_length={prompt_length}, but completion_mask has tokens before that column"
            )

    if impl == "fused":
        split = split_model(model)
        reason = split.reason
        device_type = input_ids.device.type
        # Under autocast the model's own head computes its logits in autocast's dtype; the
        # tiles do the same (hidden states and weight cast to it, float32 from there on).
        head_dtype = None
        if torch.is_autocast_enabled(device_type):
            head_dtype = torch.get_autocast_dtype(device_type)
        if reason is None:
            reason = _verify_split(model, split, input_ids, attention_mask)
        if reason is None:
            return _fused(
                model,
                split,
                input_ids,
                attention_mask,
                completion_mask,
                temperature,
                return_entropy,
                prompt_length,
                shared_prefix,
                head_dtype,
            )
        _warn_once(model, reason)
    return _naive(model, input_ids, attention_mask, completion_mask, temperature, return_entropy)


_WARNED: weakref.WeakKeyDictionary[torch.nn.Module, set[str]] = weakref.WeakKeyDictionary()


def _warn_once(
    model: torch.nn.Module, reason: str, what: str = "fused path unavailable, using naive"
) -> None:
    """Each reason once per model: the trainer calls this every step."""
    seen = _WARNED.setdefault(model, set())
    if reason not in seen:
        seen.add(reason)
        log.warning("logprobs: %s: %s", what, reason)


def _naive(model, input_ids, attention_mask, completion_mask, temperature, return_entropy):
    if not return_entropy:
        logp, mask = core.sequence_logprobs(
            model, input_ids, attention_mask, completion_mask, temperature
        )
        return torch.where(mask.bool(), logp, torch.zeros_like(logp)), mask
    # Entropy needs the whole distribution: the plain computation, kept whole.
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=core.position_ids(attention_mask),
    ).logits
    logits = logits[:, :-1, :].float() / temperature  # [B, T-1, V]
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, T-1, V]
    logp = logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    entropy = -(logprobs.exp() * logprobs).sum(-1)  # [B, T-1]
    mask = completion_mask[:, 1:].float()
    zeros = torch.zeros_like(logp)
    return torch.where(mask.bool(), logp, zeros), mask, torch.where(mask.bool(), entropy, zeros)


def _fused(
    model,
    split,
    input_ids,
    attention_mask,
    completion_mask,
    temperature,
    return_entropy,
    prompt_length,
    shared_prefix=True,
    head_dtype=None,
):
    position_ids = core.position_ids(attention_mask)
    mask = completion_mask[:, 1:].float()  # [B, T-1]
    window = None  # final hidden states at positions [start, T-1), [B, T-1-start, H]
    plan = None
    if shared_prefix:
        plan = plan_shared_prefix(input_ids, attention_mask, completion_mask)
    if plan is not None:
        args = (split.body, input_ids, attention_mask, position_ids)
        reason = _verify_shared_prefix(model, *args, plan)
        if reason is None:
            window = _prefix_hidden(*args, plan, replay=_checkpointing(model))
        else:
            _warn_once(model, reason, "one forward per prompt unavailable, one per row")
    if window is not None:
        start = plan.length - 1
    else:
        hidden = _body_hidden(split.body, input_ids, attention_mask, position_ids)  # [B, T, H]
        start = 0 if prompt_length is None else prompt_length - 1
        window = hidden[:, start:-1]
    # Positions t predict token t+1; prompt positions are dropped before the lm-head.
    keep = mask[:, start:].bool()  # [B, T-1-start]
    h = window[keep]  # [N, H]
    targets = input_ids[:, 1:][:, start:][keep]  # [N]
    weight = split.weight
    if head_dtype is not None:  # autocast: the head's matmul in its dtype, as the model's own
        h, weight = h.to(head_dtype), cached_cast(weight, head_dtype)
    out = fused_token_logprobs(h, weight, targets, temperature, return_entropy=return_entropy)
    logp_n, entropy_n = out if return_entropy else (out, None)
    # Columns before `start` hold no completion token, so the full mask lists the same
    # positions in the same (row-major) order as `keep`.
    valid = mask.bool()
    logp = logp_n.new_zeros(mask.shape).masked_scatter(valid, logp_n)  # [B, T-1]
    if not return_entropy:
        return logp, mask
    return logp, mask, entropy_n.new_zeros(mask.shape).masked_scatter(valid, entropy_n)
