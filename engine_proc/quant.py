"""Low-bit weights: GGUF's Q4_0 / Q4_1 / Q8_0 blocks repacked for ``qmatmul.c``.

A GGUF weight ``[N, K]`` (N outputs, K inputs) is stored row by row in blocks of 32
inputs (ggml's ``block_q4_0`` / ``block_q4_1`` / ``block_q8_0``)::

    Q4_0  18 bytes: d (f16), 16 bytes of nibbles     w = d · (q − 8), q ∈ [0, 15]
    Q4_1  20 bytes: d, m (f16), 16 bytes of nibbles  w = d · q + m
    Q8_0  34 bytes: d (f16), 32 × int8               w = d · q, q ∈ [−127, 127]

(nibble ``j`` of a 4-bit block is the low half of byte ``j`` for ``j < 16`` and the high
half of byte ``j − 16`` otherwise). :func:`pack` moves the same numbers, unchanged, into
the tile layout the kernel reads (16 output rows side by side, described at the top of
``engine_proc/kernels/qmatmul.c``); :func:`unpack` inverts it, and :func:`dequantize`
gives the float32 weight a packed tensor stands for — what the tests and the accuracy
benchmark compare the kernel with. A bf16 or float32 checkpoint is quantized with the
``gguf`` package's own reference quantizer (the same numbers ``llama-quantize`` makes
for these types) and then packed the same way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

TILE = 16  # output rows per tile (one vector lane each)
BLOCK = 32  # inputs per quantization block


class QuantFormat(enum.IntEnum):
    """The kernel's two packed formats (their numbers are ``qmatmul``'s ``fmt``)."""

    Q4 = 0  # 4-bit unsigned codes with a float16 scale and minimum per block (Q4_0, Q4_1)
    Q8 = 1  # 8-bit signed codes with a float16 scale per block (Q8_0)

    @property
    def tile_block_bytes(self) -> int:
        return 320 if self is QuantFormat.Q4 else 544

    @property
    def bits(self) -> int:
        return 4 if self is QuantFormat.Q4 else 8


GGUF_FORMATS = {"Q4_0": QuantFormat.Q4, "Q4_1": QuantFormat.Q4, "Q8_0": QuantFormat.Q8}
"""GGUF tensor types that run in their own precision (others are de-quantized)."""


@dataclass
class PackedWeight:
    """A ``[out_features, in_features]`` weight in :class:`QuantFormat` tiles.

    ``data``: uint8 ``[out/16 · in/32 · tile_block_bytes]`` (see the kernel's layout);
    ``source``: the GGUF type it came from (``"Q4_1"``, …), for the runtime record.
    """

    fmt: QuantFormat
    out_features: int
    in_features: int
    data: torch.Tensor
    source: str

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def check_shape(out_features: int, in_features: int) -> str | None:
    """Why a weight of this shape cannot be packed, or ``None``."""
    if out_features % TILE or in_features % BLOCK:
        return f"a [{out_features}, {in_features}] weight needs out % {TILE} == 0 and in % {BLOCK} == 0"
    return None


def blocks_of(raw: np.ndarray, gguf_type: str, out_features: int, in_features: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Codes ``[N, K]``, scales ``[N, K/32]`` float16 and minimums (Q4 only, else ``None``)
    of a GGUF tensor's raw bytes ``raw`` (any shape, ``N · K/32 · block bytes`` in all).
    Q4_0 becomes Q4 with ``m = −8 · d`` (exact: a power-of-two multiple). Raises
    ``ValueError`` for a size that does not match."""
    n, k = out_features, in_features
    nb = k // BLOCK
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[gguf_type]
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if flat.size != n * nb * size:
        raise ValueError(f"{gguf_type} tensor of {flat.size} bytes is not [{n}, {k}]")
    blocks = flat.reshape(n, nb, size)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    if gguf_type == "Q8_0":
        return blocks[:, :, 2:].copy().view(np.int8).reshape(n, k), d, None
    qs = blocks[:, :, 4:] if gguf_type == "Q4_1" else blocks[:, :, 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)  # nibble j < 16 low, else high
    if gguf_type == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
    else:
        m = (d.astype(np.float32) * -8.0).astype(np.float16)
    return codes.astype(np.uint8), d, m


def pack(codes: np.ndarray, d: np.ndarray, m: np.ndarray | None, source: str) -> PackedWeight:
    """Tiles from codes ``[N, K]`` (uint8 in [0, 15] with ``m``; int8 without), scales and
    minimums ``[N, K/32]`` float16 (see :func:`blocks_of`). Raises ``ValueError`` for a
    shape the kernel cannot take."""
    n, k = codes.shape
    problem = check_shape(n, k)
    if problem:
        raise ValueError(problem)
    nt, nb = n // TILE, k // BLOCK
    q = codes.reshape(nt, TILE, nb, BLOCK).transpose(0, 2, 1, 3)  # [tile, block, row, input]
    ds = d.reshape(nt, TILE, nb).transpose(0, 2, 1)
    if m is not None:  # Q4: byte 64v + 4n + j = q[n][4v + j] | q[n][16 + 4v + j] << 4
        lo = q[..., :16].reshape(nt, nb, TILE, 4, 4).astype(np.uint8)
        hi = q[..., 16:].reshape(nt, nb, TILE, 4, 4).astype(np.uint8)
        nibbles = (lo | (hi << 4)).transpose(0, 1, 3, 2, 4).reshape(nt, nb, 256)
        ms = m.reshape(nt, TILE, nb).transpose(0, 2, 1)
        parts = [nibbles, _bytes(ds), _bytes(ms)]
        fmt = QuantFormat.Q4
    else:  # Q8: byte 64v + 4n + j = q[n][4v + j]
        codes8 = q.reshape(nt, nb, TILE, 8, 4).transpose(0, 1, 3, 2, 4).reshape(nt, nb, 512)
        parts = [codes8.view(np.uint8), _bytes(ds)]
        fmt = QuantFormat.Q8
    data = np.concatenate(parts, axis=-1)
    return PackedWeight(fmt, n, k, torch.from_numpy(np.ascontiguousarray(data).reshape(-1)), source)


def _bytes(halfs: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(halfs.astype(np.float16)).view(np.uint8).reshape(*halfs.shape[:2], -1)


def unpack(w: PackedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The inverse of :func:`pack`: ``(codes, d, m)`` as :func:`blocks_of` gives them."""
    n, k = w.out_features, w.in_features
    nt, nb = n // TILE, k // BLOCK
    tiles = w.data.numpy().reshape(nt, nb, w.fmt.tile_block_bytes)
    if w.fmt is QuantFormat.Q4:
        nib = tiles[..., :256].reshape(nt, nb, 4, TILE, 4).transpose(0, 1, 3, 2, 4)  # [t, b, row, v, j]
        lo, hi = (nib & 0x0F).reshape(nt, nb, TILE, 16), (nib >> 4).reshape(nt, nb, TILE, 16)
        q = np.concatenate([lo, hi], axis=-1)
        d = tiles[..., 256:288].copy().view(np.float16)
        m = tiles[..., 288:320].copy().view(np.float16)
    else:
        q = tiles[..., :512].copy().view(np.int8).reshape(nt, nb, 8, TILE, 4).transpose(0, 1, 3, 2, 4)
        q = q.reshape(nt, nb, TILE, BLOCK)
        d = tiles[..., 512:544].copy().view(np.float16)
        m = None
    codes = q.transpose(0, 2, 1, 3).reshape(n, k)
    d = d.reshape(nt, nb, TILE).transpose(0, 2, 1).reshape(n, nb)
    if m is not None:
        m = m.reshape(nt, nb, TILE).transpose(0, 2, 1).reshape(n, nb)
    return codes, d, m


def dequantize(w: PackedWeight) -> torch.Tensor:
    """The float32 ``[out, in]`` weight that ``w`` stands for (``d · q + m`` per block)."""
    codes, d, m = unpack(w)
    n, k = codes.shape
    q = codes.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    out = q * d.astype(np.float32)[..., None]
    if m is not None:
        out += m.astype(np.float32)[..., None]
    return torch.from_numpy(out.reshape(n, k))


def from_gguf(raw: np.ndarray, gguf_type: str, out_features: int, in_features: int) -> PackedWeight:
    """Pack a GGUF tensor of type ``gguf_type`` (one of :data:`GGUF_FORMATS`) as it is."""
    codes, d, m = blocks_of(raw, gguf_type, out_features, in_features)
    return pack(codes, d, m, gguf_type)


def quantize(weight: torch.Tensor, gguf_type: str) -> PackedWeight:
    """Quantize a float weight ``[out, in]`` to ``gguf_type`` with the ``gguf`` package's
    reference quantizer (as ``llama-quantize`` would), then pack it."""
    from gguf import GGMLQuantizationType, quants

    n, k = weight.shape
    raw = quants.quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType[gguf_type])
    return from_gguf(raw, gguf_type, n, k)
