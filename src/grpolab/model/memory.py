"""Memory of a training run: what it holds, what it peaks at, and how to read the process's.

A step holds, on top of the runtime (Python, torch, the tokenizer, the task):

    weights      4 bytes per parameter in float32 (2 in bf16)
    gradients    the same again for every trained parameter (LoRA: the adapters only)
    AdamW        two moments per trained parameter, in its dtype: 8 bytes per fp32 parameter
    reference    a frozen copy of the weights when beta > 0 (not under LoRA)

so fp32 full fine-tuning costs 16 bytes per parameter before any activation, and then the
largest transient: the activations of one micro-batch's forward and backward (the
trainer's fused log-probs never hold [B, T, V] logits), or the rollout's KV cache.
`MemoryBreakdown` adds these up; the preflight's `memory.worst_case` measures the
activations on the worst-case micro-batch and prints the sum.

On CPU the process's resident set (RSS) is what counts. glibc keeps freed memory for reuse
instead of returning it, so a process that once held a large temporary (a preflight copy, an
evaluation batch) stays large; `release_freed_memory` hands it back.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

MB = 2**20


def rss_mb() -> float | None:
    """The resident set of this process in MB (Linux), None where /proc is unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB
    except (OSError, ValueError, IndexError):
        return None


def total_memory_mb() -> float | None:
    """Physical memory of the machine in MB (Linux), None where unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / MB
    except (OSError, ValueError):
        return None


_LIBC = None
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
# Blocks at least this large get their own mapping, returned to the system when freed: glibc's
# largest threshold on 64-bit systems (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLD_BYTES = 32 << 20
# Free space at the top of the heap kept for the next allocations before it is returned.
TRIM_THRESHOLD_BYTES = 128 << 20


def _glibc_function(name: str):
    global _LIBC
    if _LIBC is None:
        found = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(found) if found else False
        except OSError:
            _LIBC = False
    return getattr(_LIBC, name, None) if _LIBC else None


def fix_malloc_thresholds() -> None:
    """Blocks under 32 MB from the heap, and up to 128 MB of freed space kept there for reuse.

    A step allocates and frees the same large buffers thousands of times (a [rows, vocabulary]
    distribution per decode step, each layer's activations and their gradients). A block with
    a mapping of its own goes back to the system when freed and is faulted in again page by
    page when next allocated: with every block of 1 MB or more mapped (this function's former
    setting), the real-model example's step with every row run took 9 s instead of 4.5 s.
    glibc's own default moves the threshold up as mapped blocks are freed, so where a run's
    tensors are served from depends on its history; fixed, it does not. The
    peak RSS of the example's steps: 4.26 GB here, 3.93 GB with 1 MB, 4.36 GB with glibc's
    default (docs/MEMORY.md); between steps the RSS stays near the peak, the freed space kept
    for the next step. A no-op on other C libraries."""
    mallopt = _glibc_function("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)


def release_freed_memory() -> None:
    """Return the memory glibc's malloc holds free to the system (malloc_trim), so the RSS
    reflects what is alive. A no-op on other C libraries."""
    trim = _glibc_function("malloc_trim")
    if trim is not None:
        trim(0)


class PeakRSS:
    """The highest RSS seen while inside (sampled every `interval` seconds by a thread)."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.start = self.peak = rss_mb() or 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb() or 0.0)
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb() or 0.0)

    @property
    def growth(self) -> float:
        return self.peak - self.start


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, float]]:
    """{"growth": MB} above the memory in use on entry, at the peak inside: allocated memory
    on CUDA, the process's RSS (after giving freed memory back) elsewhere."""
    out: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        out["growth"] = (torch.cuda.max_memory_allocated(device) - before) / MB
        return
    release_freed_memory()
    with PeakRSS() as peak:
        yield out
    out["growth"] = peak.growth


def tensor_mb(tensors) -> float:
    """Bytes of distinct storages among `tensors`, in MB (tied weights count once)."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total / MB


def kv_cache_mb(config, rows: int, tokens: int, dtype: torch.dtype) -> float:
    """Keys and values of `rows` sequences of `tokens` positions through every layer."""
    layers = getattr(config, "num_hidden_layers", 0)
    heads = getattr(config, "num_key_value_heads", None) or getattr(
        config, "num_attention_heads", 0
    )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * rows * tokens * heads * head_dim * itemsize / MB


@dataclass
class MemoryBreakdown:
    """What a training step holds at its peak, in MB."""

    runtime: float  # everything alive before training that is not the weights
    weights: float
    gradients: float
    optimizer: float  # AdamW's two moments
    reference: float  # the frozen reference copy (beta > 0, full fine-tuning)
    activations: float  # measured: one worst-case micro-batch's forward + backward
    rollout: float  # the rollout's KV cache at full length

    @property
    def peak(self) -> float:
        """Weights, gradients and optimizer state live across the step (gradients stay
        allocated until the next step's zero_grad); the largest transient comes on top."""
        held = self.runtime + self.weights + self.gradients + self.optimizer + self.reference
        return held + max(self.activations, self.rollout)

    def describe(self) -> str:
        parts = [
            ("runtime", self.runtime),
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("AdamW", self.optimizer),
            ("reference", self.reference),
            ("activations", self.activations),
            ("rollout KV", self.rollout),
        ]
        shown = " + ".join(f"{name} {mb:.0f}" for name, mb in parts if mb >= 0.5)
        return f"{shown} (the larger of activations and rollout KV counts)"


def adamw_state_mb(trained: list[torch.Tensor]) -> float:
    """AdamW's exp_avg and exp_avg_sq, each shaped and typed like its parameter."""
    return 2 * tensor_mb(trained)
