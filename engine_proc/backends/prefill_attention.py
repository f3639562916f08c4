"""Which attention path a prefill segment takes, measured on this host at start-up.

A prefill segment of ``n`` prompt tokens at positions ``[start, start + n)`` attends
causally over ``L = start + n`` keys of its row. The lean runner
(:mod:`engine_proc.backends.llama_runner`) has three ways to compute it:

``kernel``
    every prompt token as a one-query "row" of the C decode kernel, which reads the
    row's KV blocks in place (no gather); cost grows with the query-key pairs
    ``n · (start + n / 2)``.
``matmul``
    gather the row's K/V, then two matmuls around a float32 softmax with the causal mask
    materialised (``[kv_heads, group · n, L]`` scores).
``sdpa``
    gather, then ``torch.nn.functional.scaled_dot_product_attention`` (its flash kernel
    on a CPU; ``is_causal`` when ``start == 0``, a boolean mask otherwise).

Which one is fastest depends on the CPU and the dtype, by large factors. Measured one
layer of SmolLM2-135M (9 query heads on 3 KV heads, head_dim 64) on a 2-core AMD Zen 3
with AVX2 and no native bfloat16: SDPA beat the matmul path at every size from
``n · L`` = 4k (1.6–3× in float32, 13–30× in bfloat16, where the matmuls are emulated),
and a 1,024-token prefill took 2.0× less time through SDPA than through the fixed
thresholds tuned on an AVX-512 BF16 host, where the matmul path had measured 0.43× SDPA's
time for one query token. So the thresholds are not constants: :func:`measure` times
the paths on a few probe shapes, on the real KV cache and the engine's thread count, and
keeps each cheaper path up to the largest probe it still wins (probes are in increasing
size; the first loss ends the search).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

KERNEL_PROBES = ((16, 0), (32, 0), (64, 0), (128, 0), (256, 0), (256, 256))
"""``(n, start)`` shapes at which the decode kernel is timed against the better of the
other two, in increasing ``n · (start + n / 2)``."""
MATMUL_PROBES = ((32, 32), (64, 192), (128, 384), (256, 768), (256, 3840))
"""``(n, start)`` shapes at which the matmul path is timed against SDPA, in increasing
``n · L``."""


@dataclass(frozen=True)
class PrefillAttentionPlan:
    """Thresholds (inclusive) for a segment of ``n`` tokens at ``start``, ``L = start + n``:
    the decode kernel while ``n · (start + n / 2) <= kernel_pairs``, else the matmul path
    while ``n · L <= matmul_pairs``, else SDPA. ``0`` turns a path off."""

    kernel_pairs: int = 0
    matmul_pairs: int = 0
    measured_ms: float = 0.0  # how long measuring took

    def uses_kernel(self, n: int, start: int) -> bool:
        return n * (start + n / 2) <= self.kernel_pairs

    def uses_matmul(self, n: int, length: int) -> bool:
        return n * length <= self.matmul_pairs

    def describe(self) -> str:
        return (f"decode kernel up to {self.kernel_pairs:,} query-key pairs, matmul+softmax up to "
                f"{self.matmul_pairs:,}, SDPA above (measured in {self.measured_ms:.0f} ms)")


SDPA_ONLY = PrefillAttentionPlan()
"""The plan where nothing was measured (an accelerator, torch kernels): SDPA throughout."""


def _future(start: int, n: int, length: int, device: torch.device) -> torch.Tensor:
    """``[n, length]`` bool: True where key ``j`` lies after query ``i`` (position ``start + i``)."""
    return torch.arange(length, device=device)[None, :] > torch.arange(start, start + n, device=device)[:, None]


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """``q`` ``[heads, n, D]`` at positions ``[start, start + n)`` over ``k``, ``v``
    ``[kv_heads, L, D]``, causal: ``[heads, n, D]``. Grouped-query heads are folded into
    the query axis (``[kv_heads, group · n, D]``), so K/V are never repeated; scores in
    float32."""
    heads, n, d = q.shape
    kv_heads, length = k.shape[0], k.shape[1]
    group = heads // kv_heads
    scores = torch.matmul(q.reshape(kv_heads, group * n, d), k.transpose(1, 2)).float()
    scores = scores.view(kv_heads, group, n, length)
    scores.mul_(scale).masked_fill_(_future(start, n, length, q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(kv_heads, group * n, length)
    return torch.matmul(probs, v).view(heads, n, d)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """The same as :func:`matmul_attention` through torch's SDPA."""
    heads, n, _ = q.shape
    gqa = heads != k.shape[0]
    if start == 0:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                              enable_gqa=gqa)[0]
    allowed = ~_future(start, n, k.shape[1], q.device)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed, scale=scale,
                                          enable_gqa=gqa)[0]


def _best_ms(fn, reps: int = 3) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


@torch.inference_mode()
def measure(kernels, cache, heads: int, head_dim: int, threads=None) -> PrefillAttentionPlan:
    """Time the three paths on :data:`KERNEL_PROBES` and :data:`MATMUL_PROBES` over
    layer 0 of ``cache`` (a :class:`~engine_proc.kv_cache.PagedKVCache`; its contents
    do not matter, nothing is written) and return the thresholds. ``kernels``: the C
    kernels (anything else → :data:`SDPA_ONLY`); ``threads``: the engine's
    :class:`~engine_proc.threads.ThreadPlan`, applied per probe as a pass of ``n``
    tokens would. Probes that need more blocks than the pool has are skipped. Takes tens
    of milliseconds on a CPU."""
    if getattr(kernels, "name", None) != "c" or cache.keys[0].device.type != "cpu":
        return SDPA_ONLY
    t_start = time.perf_counter()
    k_cache, v_cache = cache.keys[0], cache.values[0]
    dtype, bs = k_cache.dtype, cache.block_size
    usable_blocks = cache.null_block  # ids [0, null_block) are real blocks
    scale = head_dim ** -0.5
    gen = torch.Generator().manual_seed(0)

    def fits(n: int, start: int) -> bool:
        return -(-(start + n) // bs) <= usable_blocks

    def probe(n: int, start: int, paths: tuple[str, ...]) -> dict[str, float]:
        length = start + n
        if threads is not None:
            threads.apply(n)
        blocks = torch.arange(-(-length // bs), dtype=torch.int64)
        q = torch.randn(n, heads * head_dim, generator=gen).to(dtype)
        tables = blocks.to(torch.int32).expand(n, -1).contiguous()
        lens = torch.arange(start + 1, length + 1, dtype=torch.int32)
        qh = q.view(n, heads, head_dim).transpose(0, 1)

        def gathered(path):
            def run():
                k, v = cache.gather_row(0, blocks, length)
                return path(qh, k, v, start, scale)
            return run

        runs = {"kernel": lambda: kernels.decode_attention(q, k_cache, v_cache, tables, lens, scale),
                "matmul": gathered(matmul_attention), "sdpa": gathered(sdpa_attention)}
        return {path: _best_ms(runs[path]) for path in paths}

    kernel_pairs = 0
    for n, start in KERNEL_PROBES:
        if not fits(n, start):
            break
        t = probe(n, start, ("kernel", "matmul", "sdpa"))
        if t["kernel"] > min(t["matmul"], t["sdpa"]):
            break
        kernel_pairs = int(n * (start + n / 2))
    matmul_pairs = 0
    for n, start in MATMUL_PROBES:
        if not fits(n, start):
            break
        t = probe(n, start, ("matmul", "sdpa"))
        if t["matmul"] > t["sdpa"]:
            break
        matmul_pairs = n * (start + n)
    plan = PrefillAttentionPlan(kernel_pairs, matmul_pairs, (time.perf_counter() - t_start) * 1e3)
    log.info("prefill attention: %s", plan.describe())
    return plan
