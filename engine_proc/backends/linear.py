"""The runner's linear layers: a dense weight (oneDNN's blocked layout on a CPU), a
packed low-bit one (:mod:`engine_proc.quant`, ``qmatmul.c``), or both, and which of the
two a pass of ``T`` rows takes.

A low-bit matmul reads a quarter (4-bit) or a half (8-bit) of bfloat16's bytes and does
its arithmetic in int8, so it wins where a pass is bound by reading the weights (a few
decode rows) and, on CPUs with fast int8 dot products, further; on CPUs whose bfloat16
matrix units are much faster than their int8 vector units (AMX), large passes may do
better on the de-quantized weight. :func:`measure_crossover` times both on this host at
start-up and :class:`MatmulPlan` keeps the answer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_proc import quant

log = logging.getLogger(__name__)


@dataclass
class MatmulPlan:
    """Passes of fewer than ``quantized_below`` rows use the packed weights (where a
    layer has both); 0: never, a huge number: always."""

    quantized_below: int = 1 << 30

    def quantized(self, rows: int) -> bool:
        return rows < self.quantized_below


class Linear:
    """``y = x Wᵀ + b`` for ``x`` ``[T, in]``.

    Dense: on a CPU with oneDNN the weight is also kept reordered into oneDNN's blocked
    layout once (what inductor's freezing pass does): the plain ``F.linear`` reorders it
    on every call, which at decode batch sizes costs as much as the product (measured:
    2× faster at batch 1, 1.5× at batch 64, bfloat16). Falls back to ``F.linear`` where
    the packed path is missing or disagrees.

    Low-bit: ``parts`` are packed weights stacked along the output dimension (a fused
    projection: Q, K, V), each run by ``qmatmul`` into its slice of one output.
    """

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, pack: bool = True,
                 parts: list[quant.PackedWeight] | None = None, qmatmul=None, plan: MatmulPlan | None = None,
                 logits: bool = False):
        self.weight, self.bias = weight, bias
        self.packed = _packed(weight, bias) if pack and weight is not None else None
        self.parts = _fused(parts) if parts else None
        self.qmatmul = qmatmul if self.parts else None
        self.plan = plan or MatmulPlan()
        self.logits = logits  # float32 output (the LM head)
        self.qbias = bias.float().contiguous() if bias is not None and self.parts else None
        if self.parts is None and weight is None:
            raise ValueError("a linear layer needs a dense or a packed weight")

    @property
    def out_features(self) -> int:
        return self.weight.shape[0] if self.weight is not None else sum(p.out_features for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.qmatmul is not None and (self.weight is None or self.plan.quantized(x.shape[0])):
            return self._low_bit(x)
        y = self._dense(x)
        return y.float() if self.logits else y

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _low_bit(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if len(self.parts) == 1:
            return self.qmatmul(self.parts[0], x, self.qbias, out_f32=self.logits)
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32 if self.logits else x.dtype)
        start = 0
        for part in self.parts:
            end = start + part.out_features
            bias = self.qbias[start:end] if self.qbias is not None else None
            y[:, start:end] = self.qmatmul(part, x, bias, out_f32=self.logits)
            start = end
        return y

    def dense_weight(self) -> torch.Tensor:
        """The weight as a float tensor: the dense one, else the packed parts de-quantized."""
        if self.weight is not None:
            return self.weight
        return torch.cat([quant.dequantize(p) for p in self.parts])


def _fused(parts: list[quant.PackedWeight]) -> list[quant.PackedWeight]:
    """Parts of one format become one packed weight: tiles are stacked along the output
    dimension, so their bytes simply follow each other."""
    if len(parts) > 1 and len({(p.fmt, p.in_features) for p in parts}) == 1:
        return [quant.PackedWeight(parts[0].fmt, sum(p.out_features for p in parts), parts[0].in_features,
                                   torch.cat([p.data for p in parts]), parts[0].source)]
    return list(parts)


def _packed(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``weight`` in oneDNN's layout, or ``None`` when that path is unavailable or wrong here."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        x = torch.randn(3, weight.shape[1], dtype=weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    except (RuntimeError, AttributeError):
        return None
    want = F.linear(x, weight, bias)
    tol = 1e-4 if weight.dtype == torch.float32 else 5e-2
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
        return None
    return packed


PROBE_ROWS = (1, 4, 8, 12, 16, 24, 32, 64, 128, 256)


def measure_crossover(layers, dtype: torch.dtype, repeats: int = 3) -> int:
    """``MatmulPlan.quantized_below`` for this host: the smallest probed row count from
    which the dense matmul is faster than the low-bit one, for every larger probe too;
    ``1 << 30`` when the low-bit one wins throughout. ``layers``: one :class:`Linear` (with
    both weights) or several, timed one after another as a model's pass runs them, so the
    weights stream from memory as they do in a pass rather than sit in cache (one
    SmolLM2 gate/up projection is 3.5 MB of bfloat16: hot, the dense path looked faster
    from 32 rows on a 2-core AMX host; over all 30 layers it is from 24, where the whole
    model's step agrees). Takes up to a few seconds, once per host (crossover_cache)."""
    layers = [layers] if isinstance(layers, Linear) else list(layers)
    if not layers or any(layer.weight is None or layer.qmatmul is None for layer in layers):
        return 1 << 30
    wins = []
    for rows in PROBE_ROWS:
        x = torch.randn(rows, layers[0].weight.shape[1]).to(dtype)
        times = {}
        for name, fn in (("dense", lambda: [layer._dense(x) for layer in layers]),
                         ("low_bit", lambda: [layer._low_bit(x) for layer in layers])):
            fn()
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            times[name] = best
        wins.append(times["low_bit"] <= times["dense"])
    for i, rows in enumerate(PROBE_ROWS):
        if not any(wins[i:]):
            return rows
    return 1 << 30
