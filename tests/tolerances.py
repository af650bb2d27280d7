"""What a float comparison in the tests can promise, derived in one place.

Exact equality (torch.equal, ==) holds only where the same kernels run on the same inputs in
the same order: a run repeated in one process, a resumed run against a straight one.

Two float32 computations of one exact value by different paths (gradient checkpointing's
recompute, micro-batches, ranks, the chunked lm-head, a KV-cache decode, another thread split,
another CPU's kernels) round differently. Each rounding is off by at most eps32 (1.19e-7)
relative to the terms it combines, and over a reduction of n terms the errors add like a
random walk, to ~sqrt(n) * eps32 * (size of the terms). A model stacks such reductions, so n
counts its widest dot product once per layer. A tolerance is therefore relative to the size of
the terms (for log-probs the logits, for a gradient its tensor's largest entry), never an
absolute 1e-7 on values of order 1, and it grows with the model.

Checked against float64 references of the same computations on the tiny test models and the
demo model, with AVX-512, AVX2 and SSE kernels and 1 and 2 threads: each float32 path (the
trainer's log-probs, the HF and vLLM engines', a GRPO gradient in one pass or in micro-batches)
stays within a third of sqrt(n) * eps32 * scale of float64.

Past an AdamW step the promise changes: Adam turns a gradient's rounding near 0 into a whole
step of either sign (adam_first_step_tolerance, assert_same_trajectory).
"""

from __future__ import annotations

import math

import torch

from grpolab.model.policy import base_model

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7
EPS64 = torch.finfo(torch.float64).eps  # 2.22e-16
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which the trainer keeps


def reduction_terms(model: torch.nn.Module, tokens: int = 0) -> int:
    """n for `model`: its widest dot product (hidden or MLP width, or the tokens a weight's
    gradient sums over) once per layer."""
    c = base_model(model).config
    return max(c.hidden_size, c.intermediate_size, tokens) * c.num_hidden_layers


def float32_tolerance(scale: float, terms: int) -> float:
    """The most two float32 paths to one exact value may honestly differ by: each is within
    sqrt(terms) * eps32 * scale of it, the pair twice that, and a factor 2 to spare."""
    return 4 * math.sqrt(terms) * EPS32 * scale


def logit_bound(model: torch.nn.Module) -> float:
    """max |logit| over every input: the final RMSNorm's output has norm at most
    sqrt(hidden) * max |norm weight|, and a logit is its dot product with one lm-head row."""
    m = base_model(model)
    norm = m.model.norm.weight.detach().float()
    head = m.get_output_embeddings().weight.detach().float()  # [V, hidden]
    hidden = m.config.hidden_size
    return math.sqrt(hidden) * float(norm.abs().max()) * float(head.norm(dim=1).max())


def logprob_tolerance(
    model: torch.nn.Module, temperature: float = 1.0, logit_shift: float = 0.0
) -> float:
    """Two float32 paths to `model`'s log-probs at `temperature`: a log-prob is a logit minus a
    log-sum-exp of logits, so its rounding scales with the logits. logit_shift: a constant a
    hook adds to some logits."""
    scale = (logit_bound(model) + abs(logit_shift)) / temperature
    return float32_tolerance(scale, reduction_terms(model))


def assert_float32_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    terms: int,
    scale: float | None = None,
    rtol: float = 0.0,
    name: str = "",
) -> None:
    """actual and expected: one exact value computed in float32 by two paths. scale: the size of
    the terms behind it; by default max |expected|, the tensor's, not each entry's own (an
    entry near 0 after cancellation carries the rounding of the large terms that cancelled).
    rtol: a factor common to all entries that is itself known only to a relative tolerance."""
    scale = float(expected.abs().max()) if scale is None else scale
    tol = float32_tolerance(scale, terms)
    torch.testing.assert_close(
        actual,
        expected,
        rtol=rtol,
        atol=tol,
        msg=lambda m: (
            f"{name}: {m}\n(float32 tolerance {tol:.2e} = 4 sqrt({terms}) eps32 "
            f"x scale {scale:.2e}, rtol {rtol:.2e})"
        ),
    )


def assert_gradients_close(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    terms: int,
    rtol: float = 0.0,
) -> None:
    """Parameter gradients by two float32 paths, each tensor at its own scale. rtol: for
    gradients clipped by their global norm, that norm's relative tolerance."""
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        assert_float32_close(actual[name], grad, terms, rtol=rtol, name=name)


def gradient_norm_tolerance(grads: dict[str, torch.Tensor], terms: int) -> float:
    """Relative tolerance of the global norm of `grads` by two float32 paths: the norms differ by
    at most the norm of the difference, whose entries are within their tensors' tolerances."""
    tols = [float32_tolerance(float(g.abs().max()), terms) for g in grads.values()]
    tol2 = sum(g.numel() * t**2 for g, t in zip(grads.values(), tols, strict=True))
    norm2 = sum(float(g.double().square().sum()) for g in grads.values())
    return math.sqrt(tol2 / norm2)


def adam_first_step_tolerance(
    grad: torch.Tensor, grad_tol: float | torch.Tensor, lr: float, param: torch.Tensor
) -> torch.Tensor:
    """Elementwise: how differently one AdamW step from a fresh state can move a parameter whose
    gradient is known to within grad_tol. That step is lr * g / (|g| + eps) whatever the betas,
    steep at g = 0: a gradient within grad_tol of 0 may step anywhere in [-lr, lr], one far from
    0 steps by lr * sign(g) to rounding. Plus the rounding of p - step on both paths."""

    def step(g: torch.Tensor) -> torch.Tensor:
        return g / (g.abs() + ADAM_EPS)

    g = grad.abs()
    return lr * (step(g + grad_tol) - step(g - grad_tol)) + 4 * EPS32 * (param.abs() + lr)


# The share of a tensor's entries whose Adam steps rounding may turn around, step after step:
# those with a gradient below Adam's eps or within its own rounding of 0 (on the demo model,
# 0.04% of the gradient entries are below 1e-8 and 0.4% below 1e-7).
REDIRECTED_SHARE = 1e-3


def assert_same_trajectory(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
) -> None:
    """Parameters after a few AdamW steps from `start` along two float32 paths.

    No elementwise bound holds: Adam steps each parameter by ~lr * sign(g), so one whose
    gradient was within rounding of 0 may have stepped either way (a difference of up to ~2 lr
    per step, whatever the gradients' tolerance), and the next gradients are taken where the
    runs now differ. What holds is that such parameters are few: k of a tensor's n entries
    stepping the other way make its difference ~2 sqrt(k / n) of how far it moved; this allows
    4 sqrt(k / n) with k = max(1, n * REDIRECTED_SHARE). A real divergence (another batch, a
    rank's own update, lost optimizer state) moves most entries differently: ~1 or more. A
    tensor that did not move must match exactly."""
    assert actual.keys() == expected.keys() == start.keys()
    for name, want in expected.items():
        n = want.numel()
        allowed = 4 * math.sqrt(max(1.0, n * REDIRECTED_SHARE) / n)
        moved = float((want.double() - start[name].double()).norm())
        diff = float((actual[name].double() - want.double()).norm())
        assert diff <= allowed * moved, (
            f"{name}: the runs differ by {diff:.2e}, more than {allowed:.3f} of the "
            f"{moved:.2e} the parameters moved"
        )
