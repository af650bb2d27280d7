"""One decode step of a Llama-family model on a preallocated KV cache, without its module stack.

The hf engine's decode feeds one token per row per step. Through transformers' forward that
step is some forty modules and a thousand small tensor ops around the matmuls, a KV cache
grown by concatenation (every layer's whole cache copied, every step), finished rows
leaving by a selection of every layer's cache, and attention for one query run through the
kernel made for long ones (the keys repeated per query head first). `Decoder.step` runs the
same arithmetic on the same weights with none of that:

    x = embed(token)                                        [b, H]
    per layer: h = input_norm(x); q, k, v = projections of h, rotary embedding on q and k
               k, v written into column `used` of the cache (one write, nothing copied)
               x = x + o(attention of q over the row's real positions)
               h = post_norm(x); x = x + down(act(gate(h)) * up(h))
    logits = head(norm(x))                                  [b, V]

The norms, the rotary embedding and the activation are the model's own modules; each
projection is the function the caller gives (`Projections`: the engine's bf16 copy or merged
LoRA weight, or the layer itself), so the step multiplies exactly what the model's forward
would. Attention of one query is two small batched matmuls around a softmax in float32, or,
where the model's forward runs it in bf16 (`low_precision_attention`), the same
scaled-dot-product call in bf16. Finished rows leave by moving the last rows into their
slots (`KVCache.keep`): a few rows copied, not the cache.

`decoder_for` builds one for a model it can stand in for (Llama, Qwen2, Mistral without a
sliding window: the class and every layer's children checked), verified once per model
against the model's own forward on a probe (`verify_decoder`); any other model decodes
through its forward.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from grpolab.model.policy import base_model
from grpolab.model.precision import CPU_FLOAT32_ATTENTION_MAX_KEYS, casts_forgotten
from grpolab.model.verdict import gap_beyond_tolerance, verdict_once

# transformers classes whose decoder layer is exactly the step above (checked child by child).
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# A linear layer of the model -> the function its step applies ([b, in] -> [b, out]).
Projections = Callable[[torch.nn.Module], Callable[[torch.Tensor], torch.Tensor]]


def module_call(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer itself (its own forward, adapters and all): the step in the model's own
    precision."""
    return module


# --- Packed weights ---------------------------------------------------------------------------


class PackedLinears:
    """Each weight a decode step multiplies, in oneDNN's own blocked layout on a CPU: a
    plain-layout weight is reordered inside every matmul, which for a decode step's few
    rows is a large part of it (SmolLM2's 49k-row head: 1.6x faster in float32, 1.2x in
    bf16, the same values in bf16). Made once per weight and reused while it is unchanged
    (its version, and for a trained weight `casts_forgotten`: an optimizer step moves no
    version counter); a
    weight that cannot be packed (no oneDNN, a GPU) is multiplied as it is."""

    def __init__(self, rows: int):
        self.rows = rows  # the batch the layout is chosen for
        self._packs = WeakIdKeyDictionary()  # weight -> (made of, packed)
        self.available = torch.backends.mkldnn.is_available() and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """x [b, in] -> x @ weight^T (+ bias) [b, out], through the packed weight if any."""
        packed = self._packed(weight)
        if packed is None:
            return self.unpacked(weight, bias)
        return functools.partial(_packed_linear, packed=packed, bias=bias)

    @staticmethod
    def unpacked(weight: torch.Tensor, bias: torch.Tensor | None):
        """x [b, in] -> F.linear(x, weight, bias) [b, out]."""
        return functools.partial(F.linear, weight=weight, bias=bias)

    def _packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        if not self.available or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        trained = casts_forgotten() if weight.requires_grad else None
        made_of = (weight._version, weight.data_ptr(), trained)
        hit = self._packs.get(weight)
        if hit is not None and hit[0] == made_of:
            return hit[1]
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.rows)
        except RuntimeError:  # a dtype this CPU's oneDNN does not multiply
            return None
        self._packs[weight] = (made_of, packed)
        return packed


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# --- The cache ---------------------------------------------------------------------------------


class KVCache:
    """Every layer's keys and values for up to `rows` sequences of `length` positions,
    allocated once: keys, values [layers, rows, kv_heads, length, head_dim]. Rows [0, active)
    are in use, columns [0, used) written; `valid` [rows, length] marks real positions (a
    left-padded prompt's padding is not). All rows write the same column each step: prompts
    are left-padded to one length."""

    def __init__(self, layers, rows, kv_heads, length, head_dim, dtype, device):
        shape = (layers, rows, kv_heads, length, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(rows, length, dtype=torch.bool, device=device)
        self.active, self.used = rows, 0

    @classmethod
    def from_prefill(cls, prefill, mask: torch.Tensor, repeat: int, length: int) -> KVCache:
        """The cache of a prefill (a DynamicCache of n rows, [n, kv_heads, P, d] per layer),
        each row repeated `repeat` times (rows i * repeat + j), room for `length` positions.
        mask [n * repeat, P]: the prompts' attention mask."""
        first = prefill.layers[0]
        n, kv_heads, P, head_dim = first.keys.shape
        dtype = torch.promote_types(first.keys.dtype, first.values.dtype)
        cache = cls(len(prefill.layers), n * repeat, kv_heads, length, head_dim, dtype, mask.device)
        for i, layer in enumerate(prefill.layers):
            for ours, theirs in ((cache.keys[i], layer.keys), (cache.values[i], layer.values)):
                spread = ours[:, :, :P].unflatten(0, (n, repeat))  # [n, repeat, kv, P, d]
                spread.copy_(theirs[:, None].expand(-1, repeat, -1, -1, -1))
        cache.valid[:, :P] = mask.bool()
        cache.used = P
        return cache

    def keep(self, stay: torch.Tensor) -> torch.Tensor | None:
        """Keep the active rows where stay [active] is true, as rows [0, n): each row that
        leaves from below n takes the place of a staying row from n up, the rest stay where
        they are. Returns order [n] (new row i was row order[i]), None when every row stays."""
        n = int(stay.sum())
        if n == self.active:
            return None
        holes = (~stay[:n]).nonzero().squeeze(1)  # slots below n that leave
        movers = stay[n:].nonzero().squeeze(1) + n  # rows from n up that stay
        if holes.numel():
            used = slice(0, self.used)
            self.keys[:, holes, :, used] = self.keys[:, movers, :, used]
            self.values[:, holes, :, used] = self.values[:, movers, :, used]
            self.valid[holes] = self.valid[movers]
        order = torch.arange(n, device=stay.device)
        order[holes] = movers
        self.active = n
        return order


# --- The step ----------------------------------------------------------------------------------


@dataclass
class Layer:
    """One decoder layer's parts: the model's own norms and activation, the projections."""

    input_norm: torch.nn.Module
    post_norm: torch.nn.Module
    act: torch.nn.Module
    q: Callable
    k: Callable
    v: Callable
    o: Callable
    gate: Callable
    up: Callable
    down: Callable


class Decoder:
    """`step`: logits of the next token for each active row of a KVCache; see the module's
    docstring. dtype: what the projections take (bf16 under autocast: the hidden states are
    cast once per projection group, as autocast casts them per linear);
    low_precision_attention(keys): whether the model's forward would run attention over that
    many keys in `dtype` (autocast's), not in the cache's dtype."""

    def __init__(
        self,
        model: torch.nn.Module,
        projections: Projections,
        dtype: torch.dtype,
        low_precision_attention: Callable[[int], bool] = lambda keys: False,
    ):
        inner = base_model(model).model
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.head = projections(base_model(model).get_output_embeddings())
        self.layers = [_layer(layer, projections) for layer in inner.layers]
        attn = inner.layers[0].self_attn
        config = base_model(model).config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.dtype, self.low_precision_attention = dtype, low_precision_attention

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Feed tokens [b] (b = cache.active) at positions [b] -> logits [b, V] in `dtype`."""
        b, col = tokens.shape[0], cache.used
        cache.valid[:b, col] = True
        keys = col + 1
        attend = self._attention(cache.valid[:b, :keys], cache.keys.dtype)
        x = self.embed(tokens)  # [b, H]
        cos, sin = self.rotary(x[:, None], positions[:, None])  # [b, 1, d]
        for i, layer in enumerate(self.layers):
            h = layer.input_norm(x).to(self.dtype)
            q = _rotated(layer.q(h).view(b, self.heads, self.head_dim), cos, sin)
            cache.keys[i, :b, :, col] = _rotated(layer.k(h).view(b, self.kv_heads, -1), cos, sin)
            cache.values[i, :b, :, col] = layer.v(h).view(b, self.kv_heads, -1)
            a = attend(q, cache.keys[i, :b, :, :keys], cache.values[i, :b, :, :keys])
            x = x + layer.o(a.reshape(b, -1).to(self.dtype))
            h = layer.post_norm(x).to(self.dtype)
            x = x + layer.down(layer.act(layer.gate(h)) * layer.up(h))
        cache.used = keys
        return self.head(self.norm(x).to(self.dtype))

    def _attention(self, valid: torch.Tensor, dtype: torch.dtype):
        """This step's attention over the keys where valid [b, keys] is true: (q [b, heads, d],
        k / v [b, kv, keys, d]) -> [b, heads, d] or [b, kv, heads / kv, d], in the cache's
        dtype (its additive mask made once for every layer), or through sdpa in `dtype`."""
        if self.low_precision_attention(valid.shape[1]):
            return functools.partial(self._sdpa, valid=valid)
        bias = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
        bias = bias.masked_fill_(~valid, float("-inf"))[:, None, None, :]  # [b, 1, 1, keys]
        return functools.partial(self._attend, bias=bias)

    def _attend(self, q, k, v, bias: torch.Tensor) -> torch.Tensor:
        """q [b, heads, d], k / v [b, kv, keys, d], bias [b, 1, 1, keys] -> [b, heads, d]: each
        query head against its key-value head (heads in groups of heads / kv, as repeat_kv
        maps them), in the cache's dtype (float32 at least)."""
        b = q.shape[0]
        acc = torch.promote_types(k.dtype, torch.float32)  # a 16-bit cache: float32 sums
        k, v = k.to(acc), v.to(acc)
        grouped = q.view(b, self.kv_heads, -1, self.head_dim).to(acc)  # [b, kv, g, d]
        scores = torch.matmul(grouped, k.transpose(-1, -2))  # [b, kv, g, keys]
        weights = torch.softmax(scores.mul_(self.scaling).add_(bias), dim=-1)
        return torch.matmul(weights, v)  # [b, kv, g, d]

    def _sdpa(self, q, k, v, valid: torch.Tensor) -> torch.Tensor:
        """Attention in `dtype` through scaled-dot-product attention, as autocast runs the
        model's: q [b, heads, d], k / v [b, kv, keys, d], valid [b, keys] -> [b, heads, d]."""
        low = self.dtype
        out = F.scaled_dot_product_attention(
            q[:, :, None].to(low),
            k.to(low),
            v.to(low),
            attn_mask=valid[:, None, None, :],
            scale=self.scaling,
            enable_gqa=self.heads != self.kv_heads,
        )
        return out[:, :, 0]


def _layer(layer: torch.nn.Module, projections: Projections) -> Layer:
    attn, mlp = layer.self_attn, layer.mlp
    return Layer(
        input_norm=layer.input_layernorm,
        post_norm=layer.post_attention_layernorm,
        act=mlp.act_fn,
        **{name[:-5]: projections(getattr(attn, name)) for name in PROJECTIONS[:4]},
        **{name[:-5]: projections(getattr(mlp, name)) for name in PROJECTIONS[4:]},
    )


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x [b, heads, d] with cos, sin [b, 1, d]: transformers'
    apply_rotary_pos_emb, the same operations in the same order."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def cpu_float32_attention(device: torch.device) -> Callable[[int], bool]:
    """low_precision_attention under bf16 autocast: everywhere but short attention on the
    CPU, which the training precision runs in float32 (`precision._Bf16Forward`)."""
    if torch.device(device).type != "cpu":
        return lambda keys: True
    return lambda keys: keys > CPU_FLOAT32_ATTENTION_MAX_KEYS


# --- Which models, verified once ---------------------------------------------------------------


def unsupported(model: torch.nn.Module) -> str | None:
    """Why the step above is not this model's forward, or None when its structure matches."""
    base = base_model(model)
    name = type(base).__name__
    if name not in SUPPORTED:
        return f"{name} is not one of {', '.join(SUPPORTED)}"
    config, inner = base.config, getattr(base, "model", None)
    if getattr(config, "sliding_window", None) is not None and getattr(
        config, "use_sliding_window", True
    ):
        return f"{name} attends through a sliding window"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return f"{name} has layers other than full attention"
    for part in ("embed_tokens", "norm", "rotary_emb", "layers"):
        if not hasattr(inner, part):
            return f"{name}'s body has no {part}"
    for layer in inner.layers:
        children = (
            (layer, LAYER_CHILDREN),
            (layer.self_attn, ATTENTION_CHILDREN),
            (layer.mlp, MLP_CHILDREN),
        )
        for module, expected in children:
            found = {n for n, _ in module.named_children()}
            if found != expected:
                return f"{type(module).__name__} holds {sorted(found)}, not {sorted(expected)}"
    return None


_VERIFIED: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


def verify_decoder(
    model: torch.nn.Module, ids: torch.Tensor, projections: Projections = module_call
) -> str | None:
    """Compare two decode steps with the model's own forward, once per model, in the model's
    own precision: two rows of the real tokens `ids` [n >= 4] (the second shorter, left-
    padded), each step's logits against a full forward of the row so far. `projections`: how
    the step applies the linear layers, as it will decode (a weight applied directly does
    not run the layer's hooks: the probe sees whether that changes anything)."""

    def probe() -> str | None:
        n = ids.shape[0]
        rows = [ids, ids[2:]]  # the second two tokens shorter: left-padded by two
        input_ids = torch.stack([ids[: n - 2], torch.cat([ids[:2], ids[2 : n - 2]])])
        mask = torch.ones_like(input_ids)
        mask[1, :2] = 0
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True
        )
        cache = KVCache.from_prefill(out.past_key_values, mask, 1, n)
        decoder = Decoder(model, projections, next(model.parameters()).dtype)
        next_position = positions[:, -1] + 1
        for t in (n - 2, n - 1):  # feed each row's token at column t (of the longer row)
            tokens = torch.stack([rows[0][t], rows[1][t - 2]])
            got = decoder.step(tokens, next_position, cache)
            next_position = next_position + 1
            for r, row in enumerate(rows):
                seen = row[: t + 1 - 2 * r][None]
                expected = model(input_ids=seen, attention_mask=torch.ones_like(seen)).logits
                err = gap_beyond_tolerance(got[r], expected[0, -1])
                if err is not None:
                    return f"its decode step differs from its forward by {err:.3g}"
        return None

    reason = unsupported(model)
    if reason is not None:
        return reason
    if ids.shape[0] < 4:
        return "a probe needs at least 4 tokens"
    return verdict_once(_VERIFIED, model, "the decode step failed", probe)
