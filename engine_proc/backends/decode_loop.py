"""A decode-only pass's decoder layers in one C call.

:class:`~engine_proc.backends.llama_runner.LlamaRunner` runs a layer as ten kernel calls
from Python (two RMSNorms, four low-bit matmuls, RoPE, attention, SiLU, and the tensors
between them). At one decode row a layer's arithmetic takes tens of microseconds and
each of those calls costs several more in Python and ctypes, so at one stream about a
quarter of a step was spent between kernels. ``cpu_kernels.c``'s ``decode_layers`` makes the
same calls, in the same order, on the same buffers, from C: one call a step for all
layers, with the same numbers bit for bit (``tests/test_decode_loop.py``).

It runs a pass when the pass has decode rows only, every projection of every layer is one
packed low-bit weight that the matmul plan gives this pass (``MatmulPlan``), and the
kernels are the C ones; any other pass takes the Python loop.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["DecodeLoop"]


class _PackedLinear(ctypes.Structure):
    """``struct packed_linear`` of ``cpu_kernels.c`` (every field 8 bytes)."""

    _fields_ = [("fmt", ctypes.c_int64), ("out_features", ctypes.c_int64), ("in_features", ctypes.c_int64),
                ("data", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _DecodeLayer(ctypes.Structure):
    """``struct decode_layer`` of ``cpu_kernels.c``."""

    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("eps1", ctypes.c_double),
                ("eps2", ctypes.c_double), ("qkv", _PackedLinear), ("o", _PackedLinear),
                ("gate_up", _PackedLinear), ("down", _PackedLinear), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p)]


def _packed(linear) -> _PackedLinear | None:
    if linear.qmatmul is None or linear.parts is None or len(linear.parts) != 1:
        return None
    w = linear.parts[0]
    bias = linear.qbias.data_ptr() if linear.qbias is not None else None
    return _PackedLinear(int(w.fmt), w.out_features, w.in_features, w.data.data_ptr(), bias)


class DecodeLoop:
    """The runner's layers as ``struct decode_layer`` records, built once; :meth:`run`
    takes one decode-only pass through them. :meth:`build` gives ``None`` where the
    runner's layers or kernels do not fit (see the module docstring)."""

    def __init__(self, runner, records: list[_DecodeLayer]):
        self.runner = runner  # keeps the tensors the records point into alive
        self.records = (_DecodeLayer * len(records))(*records)
        self.lib = runner.kernels.lib
        first = runner.layers[0]
        self.qmatmul_fn = ctypes.cast(first.qkv.qmatmul.lib.qmatmul, ctypes.c_void_p).value
        self.hidden = first.o.out_features
        self.inter = first.down.parts[0].in_features
        self.width = first.qkv.out_features
        self.hd = runner.heads * runner.head_dim
        #: every projection packed only: the plan's crossover does not apply
        self.low_bit_only = all(lin.weight is None for layer in runner.layers
                                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))

    @classmethod
    def build(cls, runner) -> DecodeLoop | None:
        lib = getattr(runner.kernels, "lib", None)
        if lib is None or not hasattr(lib, "decode_layers") or not runner.layers:
            return None
        records = []
        for i, layer in enumerate(runner.layers):
            linears = [_packed(lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(lin is None for lin in linears) or layer.qkv.qmatmul.dtype != runner.kernels.dtype:
                return None
            k, v = runner.cache.keys[i], runner.cache.values[i]
            if not (k.is_contiguous() and v.is_contiguous() and layer.ln1.is_contiguous()
                    and layer.ln2.is_contiguous()):
                return None
            records.append(_DecodeLayer(layer.ln1.data_ptr(), layer.ln2.data_ptr(), layer.eps1, layer.eps2,
                                        *linears, k.data_ptr(), v.data_ptr()))
        return cls(runner, records)

    def applies(self, rows: int) -> bool:
        """Whether a decode-only pass of ``rows`` rows takes the low-bit matmuls throughout."""
        return self.low_bit_only or self.runner.plan.quantized(rows)

    def run(self, residual: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, decode) -> torch.Tensor:
        """Every layer for ``B`` decode rows: ``residual`` ``[B, hidden]`` (contiguous, the
        embeddings) becomes the residual stream after the last attention block, in place;
        returns the last layer's MLP output ``[B, hidden]``. ``positions``, ``slots``
        ``[B]`` int64; ``decode``: the pass's ``PagedForward`` (int32 ``block_tables``
        ``[B, W]`` and ``kernel_lens`` ``[B]``). Raises MemoryError when the matmul finds no
        scratch memory."""
        runner = self.runner
        b, dtype = residual.shape[0], residual.dtype
        x, h = torch.empty_like(residual), torch.empty_like(residual)
        qkv = torch.empty(b, self.width, dtype=dtype)
        attn = torch.empty(b, self.hd, dtype=dtype)
        gate_up = torch.empty(b, 2 * self.inter, dtype=dtype)
        act = torch.empty(b, self.inter, dtype=dtype)
        tables = decode.block_tables
        rc = self.lib.decode_layers(
            self.qmatmul_fn, ctypes.addressof(self.records), len(self.records), b, self.hidden, runner.heads,
            runner.kv_heads, self.inter, residual.data_ptr(), x.data_ptr(), h.data_ptr(), qkv.data_ptr(),
            attn.data_ptr(), gate_up.data_ptr(), act.data_ptr(), positions.data_ptr(), runner.cos_sin.data_ptr(),
            slots.data_ptr(), tables.data_ptr(), tables.stride(0), decode.kernel_lens.data_ptr(), runner.scale,
            runner.kernels.num_threads)
        if rc:
            raise MemoryError("decode_layers: qmatmul found no scratch memory")
        return x
