"""The paged KV cache's tensors and their layout (the block pool names the blocks).

One K and one V tensor per decoder layer, in the model dtype. float32::

    keys[layer]     [num_blocks + 1, kv_heads, head_dim, block_size]     a block's keys transposed
    values[layer]   [num_blocks + 1, kv_heads, block_size, head_dim]

bfloat16, in pairs (two bfloat16 values side by side in 32 bits, the operand layout of
AVX-512 BF16's ``vdpbf16ps``, which multiplies and sums such pairs)::

    keys[layer]     [num_blocks + 1, kv_heads, head_dim / 2, block_size, 2]   dims 2i, 2i+1 of a key
    values[layer]   [num_blocks + 1, kv_heads, block_size / 2, head_dim, 2]   tokens 2t, 2t+1 of a dim

Block ids ``0 .. num_blocks-1`` come from the block pool's tables; block ``num_blocks``
is the null block: zeros, pads gathers, never written. Keys are stored transposed
within a block (the ``block_size`` keys of one dimension side by side) so that the CPU
decode kernel computes ``q · k`` for a whole block as vector multiply-adds with no
horizontal sums; values stay rows, as ``p · v`` accumulates along ``head_dim``.
Everything outside this module and the C kernel reads the cache through
:func:`write_slots` and :func:`gather_blocks`, which take and give the usual
``[…, kv_heads, tokens, head_dim]``.

A token at position ``p`` of a row with block table ``table`` lives in slot
``table[p // block_size] · block_size + p % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def paired(k_cache: torch.Tensor) -> bool:
    """Whether a cache tensor uses the bfloat16 pair layout."""
    return k_cache.dim() == 5


def write_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[n, kv_heads, head_dim]`` at flat ``slots`` ``[n]``."""
    n, kvh, dim = key.shape
    bs = k_cache.shape[-2] if paired(k_cache) else k_cache.shape[-1]
    block, offset = slots // bs, slots % bs
    if paired(k_cache):
        k_cache[block, :, :, offset, :] = key.to(k_cache.dtype).view(n, kvh, dim // 2, 2)
        v_cache[block, :, offset // 2, :, offset % 2] = value.to(v_cache.dtype)
    else:
        k_cache[block, :, :, offset] = key.to(k_cache.dtype)
        v_cache[block, :, offset, :] = value.to(v_cache.dtype)


def gather_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks ``block_ids`` ``[..., n]`` as ``[..., kv_heads, n · block_size,
    head_dim]`` (new tensors; token ``t`` of the blocks at index ``t`` of the token axis)."""
    lead, n = block_ids.shape[:-1], block_ids.shape[-1]
    flat = block_ids.reshape(-1)
    k, v = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
    if paired(k_cache):  # [N, kvh, D/2, bs, 2] → [N, kvh, bs, D];  [N, kvh, bs/2, D, 2] → [N, kvh, bs, D]
        kvh, half, bs = k.shape[1], k.shape[2], k.shape[3]
        k = k.permute(0, 1, 3, 2, 4).reshape(-1, kvh, bs, 2 * half)
        v = v.permute(0, 1, 2, 4, 3).reshape(-1, kvh, bs, 2 * half)
    else:  # [N, kvh, D, bs] → [N, kvh, bs, D]
        k = k.transpose(-1, -2)
    kvh, bs, dim = v.shape[1], v.shape[2], v.shape[3]
    k = k.reshape(*lead, n, kvh, bs, dim).movedim(-4, -3)
    v = v.reshape(*lead, n, kvh, bs, dim).movedim(-4, -3)
    return k.reshape(*lead, kvh, n * bs, dim), v.reshape(*lead, kvh, n * bs, dim)


class PagedKVCache:
    """The K/V tensors of every layer, addressed by block id (see the module docstring).

    ``null_block`` (the last block) is all zeros: gathers pad short rows with it.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.null_block = num_blocks
        nb = num_blocks + 1
        if dtype == torch.bfloat16 and head_dim % 2 == 0 and block_size % 2 == 0:
            k_shape = (nb, num_kv_heads, head_dim // 2, block_size, 2)
            v_shape = (nb, num_kv_heads, block_size // 2, head_dim, 2)
        else:
            k_shape, v_shape = (nb, num_kv_heads, head_dim, block_size), (nb, num_kv_heads, block_size, head_dim)
        self.keys = [torch.empty(k_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.zero_blocks([self.null_block])

    def start_prefault(self):
        """Start mapping this CPU cache's pages ahead of use (:mod:`engine_proc.kv_prefault`);
        returns the running :class:`~engine_proc.kv_prefault.KVPrefaulter`, or None on
        another device or where the host cannot (Linux before 5.14)."""
        from engine_proc import kv_prefault

        if self.keys[0].device.type != "cpu" or not kv_prefault.supported():
            return None
        return kv_prefault.KVPrefaulter(self.keys + self.values).start()

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero these blocks in every layer (a new row's blocks: their unwritten tail is
        then finite where a kernel reads but masks it)."""
        if not block_ids:
            return
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.keys[0].device)
        for cache in self.keys + self.values:
            cache.index_fill_(0, idx, 0)

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[B, kv_heads, q, head_dim]`` at flat ``slots`` ``[B * q]``
        (row-major: row 0's q tokens first)."""
        kvh, dim = key.shape[1], key.shape[3]
        write_slots(self.keys[layer], self.values[layer], slots, key.transpose(1, 2).reshape(-1, kvh, dim),
                    value.transpose(1, 2).reshape(-1, kvh, dim))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks ``block_tables`` ``[B, n]``, as ``[B, kv_heads, n * block_size,
        head_dim]``."""
        return gather_blocks(self.keys[layer], self.values[layer], block_tables)

    # ------------------------------------------------------------------ handover (disaggregated)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's K and V over every layer (the handover payload's unit)."""
        k, v = self.keys[0], self.values[0]
        return len(self.keys) * (k[0].numel() * k.element_size() + v[0].numel() * v.element_size())

    def _payload_views(self, payload: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``payload`` (``[n · block_nbytes]`` uint8) as per layer ``(K [n, …], V [n, …])``
        in this cache's dtype and block layout: layer 0's K blocks, its V blocks, layer 1's…"""
        views, at = [], 0
        for k, v in zip(self.keys, self.values):
            parts = []
            for t in (k, v):
                size = n * t[0].numel() * t.element_size()
                parts.append(payload[at: at + size].view(t.dtype).view(n, *t.shape[1:]))
                at += size
            views.append((parts[0], parts[1]))
        return views

    def copy_blocks_out(self, block_ids: Sequence[int], payload: torch.Tensor) -> None:
        """Write the K and V of ``block_ids`` (every layer) into ``payload``, a uint8 tensor
        of exactly ``len(block_ids) · block_nbytes`` bytes (e.g. over a memfd's mapping)."""
        n = len(block_ids)
        if payload.dtype != torch.uint8 or payload.numel() != n * self.block_nbytes:
            raise ValueError(f"payload of {payload.numel()} bytes for {n} blocks of {self.block_nbytes}")
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.keys[0].device)
        for (k_out, v_out), k, v in zip(self._payload_views(payload, n), self.keys, self.values):
            torch.index_select(k, 0, idx, out=k_out)
            torch.index_select(v, 0, idx, out=v_out)

    def copy_blocks_in(self, block_ids: Sequence[int], payload: torch.Tensor) -> None:
        """Store a payload made by :meth:`copy_blocks_out` (same layout) into ``block_ids``.
        Raises ``ValueError`` when its size does not match."""
        n = len(block_ids)
        if payload.dtype != torch.uint8 or payload.numel() != n * self.block_nbytes:
            raise ValueError(f"payload of {payload.numel()} bytes for {n} blocks of {self.block_nbytes}")
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.keys[0].device)
        for (k_in, v_in), k, v in zip(self._payload_views(payload, n), self.keys, self.values):
            k.index_copy_(0, idx, k_in.to(k.device))
            v.index_copy_(0, idx, v_in.to(v.device))

    def gather_row(self, layer: int, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one row's first ``length`` tokens (``block_ids`` ``[n]`` covers them),
        as ``[kv_heads, length, head_dim]``."""
        k, v = gather_blocks(self.keys[layer], self.values[layer], block_ids)
        return k[:, :length], v[:, :length]
