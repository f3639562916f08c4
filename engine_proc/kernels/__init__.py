"""The non-matmul work of a forward pass over the paged KV cache, behind one interface.

Two implementations with the same contract (and the same numbers, to rounding):

* :class:`CKernels` — ``cpu_kernels.c`` compiled for this CPU (see :mod:`.build`):
  decode attention that reads KV blocks in place, RoPE fused with the KV-cache write,
  residual add fused with RMSNorm, SiLU fused with the gate product. One call each
  per layer instead of a dozen tensor ops, which is what a decode step on a CPU spends
  its time on outside the matmuls.
* :class:`TorchKernels` — the same in PyTorch ops (any device; the reference the tests
  compare the C kernels with, and the fallback where no C compiler is found).

:func:`select_kernels` picks: C on a CPU where they build, else torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine_proc.kernels.build import KernelShape, KernelsUnavailable, load
from engine_proc.kv_cache import gather_blocks, write_slots

log = logging.getLogger(__name__)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


@dataclass(frozen=True)
class NewKV:
    """Decode rows' own new tokens for ``decode_attention`` to write before it reads:
    ``k`` (rotated) and ``v`` ``[B, kv_heads · D]`` (views into the fused QKV rows; one
    row stride), ``slots`` ``[B]`` int64, each row's cache slot."""

    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor


class TorchKernels:
    """The kernels in PyTorch ops (see the C source for each contract)."""

    name = "torch"

    def __init__(self, head_dim: int, group: int, block_size: int):
        self.head_dim, self.group, self.block_size = head_dim, group, block_size

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         new_kv: NewKV | None = None) -> torch.Tensor:
        """``q`` ``[B, heads · D]`` → ``[B, heads · D]``: each row attends over its first
        ``seq_lens[b]`` cached tokens. The blocks are gathered and padded to the longest
        row (null-block padding is masked), then two batched matmuls with a float32
        softmax between them — on a CPU several times faster than SDPA for one query.
        ``new_kv``: each row's own new key (rotated) and value, written to its slot first
        (see :class:`NewKV`)."""
        if new_kv is not None:
            kvh = k_cache.shape[1]
            write_slots(k_cache, v_cache, new_kv.slots, new_kv.k.reshape(-1, kvh, self.head_dim),
                        new_kv.v.reshape(-1, kvh, self.head_dim))
        b, width = block_tables.shape
        d, g = self.head_dim, self.group
        kvh = k_cache.shape[1]
        k, v = gather_blocks(k_cache, v_cache, block_tables)  # [B, kvh, W·bs, D]
        qg = q.reshape(b, kvh, g, d)
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, kvh, G, W·bs]
        keys = torch.arange(width * self.block_size, device=q.device)
        scores.masked_fill_((keys[None, :] >= seq_lens[:, None].long())[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).reshape(b, kvh * g * d)

    def rope_write_kv(self, qkv: torch.Tensor, heads: int, kv_heads: int, positions: torch.Tensor,
                      cos_sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, first_write: int = 0) -> None:
        """Rotate the query heads of ``qkv`` ``[T, (heads + 2·kv_heads) · D]`` in place and
        write rotated keys and values to ``slots`` ``[T]`` of the caches; the tokens
        before ``first_write`` get their keys rotated in place instead and nothing
        written (their attention writes them: ``decode_attention``'s ``new_kv``)."""
        t, d = qkv.shape[0], self.head_dim
        half = d // 2
        cs = cos_sin.index_select(0, positions)
        cos, sin = cs[:, None, :half], cs[:, None, half:]
        qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
        x1, x2 = qk[..., :half].float(), qk[..., half:].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(qkv.dtype)
        qk[:, :heads] = rotated[:, :heads]
        qk[:first_write, heads:] = rotated[:first_write, heads:]
        w = slice(first_write, None)
        write_slots(k_cache, v_cache, slots[w], rotated[w, heads:],
                    qkv[w, (heads + kv_heads) * d:].reshape(-1, kv_heads, d))

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``residual += x`` (when given), then RMSNorm of it (of ``x`` otherwise)."""
        if residual is not None:
            residual.add_(x)
            x = residual
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return weight * normed

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[T, 2·I]`` (gate | up) → ``silu(gate) · up``, ``[T, I]``."""
        inter = gate_up.shape[-1] // 2
        return torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        """``[B, vocab]`` float32 → ``[B]`` int64, the first index of each row's maximum."""
        return logits.argmax(dim=-1)


class CKernels(TorchKernels):
    """The kernels of ``cpu_kernels.c``, compiled for this CPU and these shapes.

    Inputs must be contiguous CPU tensors of the compiled dtype (``q`` may have a row
    stride); block tables and lengths int32, positions and slots int64. Raises
    :class:`KernelsUnavailable` from the constructor when the library cannot be built.
    """

    name = "c"

    def __init__(self, dtype: torch.dtype, head_dim: int, group: int, block_size: int, num_threads: int):
        super().__init__(head_dim, group, block_size)
        self.lib = load(KernelShape(dtype, head_dim, group, block_size))
        self.dtype = dtype
        self.num_threads = num_threads
        #: the instructions of decode attention's usual rows ("amx-bf16", "avx512-bf16", "vector")
        self.attention_isa = self.lib.decode_attention_isa().decode()

    @property
    def description(self) -> str:
        """What the runtime record names: ``c (attention amx-bf16)``."""
        return f"c (attention {self.attention_isa})"

    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, scale, new_kv=None):
        b = q.shape[0]
        out = torch.empty(b, q.shape[1], dtype=q.dtype)
        new = (None, None, 0, None)
        if new_kv is not None:
            if new_kv.k.stride() != new_kv.v.stride() or new_kv.k.stride(-1) != 1 or new_kv.slots.dtype != torch.int64:
                raise ValueError("new_kv wants k and v rows of one stride and int64 slots")
            new = (_ptr(new_kv.k), _ptr(new_kv.v), new_kv.k.stride(0), _ptr(new_kv.slots))
        self.lib.decode_attention(_ptr(q), q.stride(0), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables),
                                  block_tables.stride(0), _ptr(seq_lens), _ptr(out), out.stride(0), b,
                                  k_cache.shape[1], scale, self.num_threads, *new)
        return out

    def rope_write_kv(self, qkv, heads, kv_heads, positions, cos_sin, slots, k_cache, v_cache, first_write=0):
        self.lib.rope_write_kv(_ptr(qkv), qkv.stride(0), qkv.shape[0], heads, kv_heads, _ptr(positions),
                               _ptr(cos_sin), _ptr(slots), _ptr(k_cache), _ptr(v_cache), self.num_threads,
                               first_write)

    def add_rms_norm(self, x, residual, weight, eps):
        out = torch.empty_like(x)
        self.lib.add_rms_norm(_ptr(x), _ptr(residual) if residual is not None else None, _ptr(weight), _ptr(out),
                              x.shape[0], x.shape[1], eps, self.num_threads)
        return out

    def argmax(self, logits):
        if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(-1) != 1:
            return logits.argmax(dim=-1)
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self.lib.argmax_rows(_ptr(logits), logits.stride(0), logits.shape[0], logits.shape[1], _ptr(out),
                             self.num_threads)
        return out

    def silu_and_mul(self, gate_up):
        t, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(t, inter, dtype=gate_up.dtype)
        self.lib.silu_and_mul(_ptr(gate_up), _ptr(out), t, inter, self.num_threads)
        return out


class QMatmul:
    """``qmatmul.c`` compiled for this CPU and one activation dtype: ``y = x · Wᵀ (+ b)`` on
    a :class:`~engine_proc.quant.PackedWeight` (Q4 / Q8 tiles), never de-quantized.

    ``num_threads`` is set per pass by :class:`~engine_proc.threads.ThreadPlan` (as for
    :class:`CKernels`). Raises :class:`KernelsUnavailable` from the constructor when the
    library cannot be built; ``isa`` names the code path compiled (``avx512vnni``,
    ``avx2`` or ``generic``). On a CPU with AMX, bfloat16 passes of ``tile_rows`` rows or
    more de-quantize each tile-block in registers and multiply on the tile unit instead
    (``qmatmul.c``)."""

    def __init__(self, dtype: torch.dtype, num_threads: int = 1):
        from engine_proc.kernels.build import load_qmatmul

        self.lib = load_qmatmul(dtype)
        self.dtype = dtype
        self.num_threads = num_threads
        self.isa = self.lib.qmatmul_isa().decode()
        #: passes of this many rows or more run on AMX tiles (bfloat16); 0: never here
        self.tile_rows = self.lib.qmatmul_tile_rows()
        #: what the runtime record names: ``avx512vnni``, ``avx512vnni, amx-bf16 from 16 rows``
        self.description = self.isa + (f", amx-bf16 from {self.tile_rows} rows" if self.tile_rows else "")
        self.source_digest = source_digest()  # the crossover cache's key: a changed kernel is timed again

    def __call__(self, w, x: torch.Tensor, bias: torch.Tensor | None = None, out_f32: bool = False) -> torch.Tensor:
        """``x`` ``[T, in]`` (the compiled dtype, rows contiguous) → ``[T, out]`` in that
        dtype, or float32 with ``out_f32``; ``bias`` ``[out]`` float32 or ``None``."""
        if x.dtype != self.dtype or x.stride(-1) != 1 or x.shape[-1] != w.in_features:
            raise ValueError(f"qmatmul wants [T, {w.in_features}] {self.dtype} rows, got {tuple(x.shape)} {x.dtype}")
        t = x.shape[0]
        y = torch.empty(t, w.out_features, dtype=torch.float32 if out_f32 else self.dtype)
        if t and self.lib.qmatmul(int(w.fmt), _ptr(w.data), w.out_features, w.in_features, _ptr(x), x.stride(0), t,
                                  _ptr(bias) if bias is not None else None, _ptr(y), y.stride(0), int(out_f32),
                                  self.num_threads):
            raise MemoryError("qmatmul: no scratch memory")
        return y


def source_digest() -> str:
    """The first 16 hex digits of ``qmatmul.c``'s SHA-256."""
    import hashlib

    from engine_proc.kernels.build import QMATMUL_SOURCE

    return hashlib.sha256(QMATMUL_SOURCE.read_bytes()).hexdigest()[:16]


def select_kernels(device: torch.device, dtype: torch.dtype, head_dim: int, group: int, block_size: int,
                   prefer: str = "auto") -> TorchKernels:
    """C kernels on a CPU where they build (``prefer`` ``auto`` or ``c``), else torch ops.

    ``prefer="c"`` raises :class:`KernelsUnavailable` instead of falling back."""
    if prefer == "torch" or device.type != "cpu":
        if prefer == "c":
            raise KernelsUnavailable(f"the C kernels run on the CPU, not {device.type}")
        return TorchKernels(head_dim, group, block_size)
    try:
        return CKernels(dtype, head_dim, group, block_size, torch.get_num_threads())
    except KernelsUnavailable as exc:
        if prefer == "c":
            raise
        log.warning("C kernels unavailable (%s); using torch ops", exc)
        return TorchKernels(head_dim, group, block_size)
