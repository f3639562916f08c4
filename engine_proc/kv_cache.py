"""The paged KV cache's tensors and their layout (the block pool names the blocks).

One K and one V tensor per decoder layer, in the model dtype::

    keys[layer]     [num_blocks + 1, kv_heads, head_dim, block_size]   a block's keys transposed
    values[layer]   [num_blocks + 1, kv_heads, block_size, head_dim]

Block ids ``0 .. num_blocks-1`` come from the block pool's tables; block ``num_blocks``
is the null block: zeros, pads gathers, never written. Keys are stored transposed
within a block (the ``block_size`` keys of one dimension side by side) so that the CPU
decode kernel computes ``q · k`` for a whole block as ``head_dim`` vector
multiply-adds with no horizontal sums; values stay rows, as ``p · v`` accumulates along
``head_dim``. Everything outside this module and the C kernel reads the cache through
:func:`write_slots` and :func:`gather_blocks`, which take and give the usual
``[…, kv_heads, tokens, head_dim]``.

A token at position ``p`` of a row with block table ``table`` lives in slot
``table[p // block_size] · block_size + p % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def write_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[n, kv_heads, head_dim]`` at flat ``slots`` ``[n]``."""
    bs = k_cache.shape[-1]
    block, offset = slots // bs, slots % bs
    k_cache[block, :, :, offset] = key.to(k_cache.dtype)
    v_cache[block, :, offset, :] = value.to(v_cache.dtype)


def gather_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks ``block_ids`` ``[..., n]`` as ``[..., kv_heads, n · block_size,
    head_dim]`` (new tensors; token ``t`` of the blocks at index ``t`` of the token axis)."""
    lead, n = block_ids.shape[:-1], block_ids.shape[-1]
    kvh, dim, bs = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    flat = block_ids.reshape(-1)
    k = k_cache.index_select(0, flat).view(*lead, n, kvh, dim, bs).movedim(-4, -3).transpose(-1, -2)
    v = v_cache.index_select(0, flat).view(*lead, n, kvh, bs, dim).movedim(-4, -3)
    return k.reshape(*lead, kvh, n * bs, dim), v.reshape(*lead, kvh, n * bs, dim)


class PagedKVCache:
    """The K/V tensors of every layer, addressed by block id (see the module docstring).

    ``null_block`` (the last block) is all zeros: gathers pad short rows with it.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.null_block = num_blocks
        self.keys = [torch.empty((num_blocks + 1, num_kv_heads, head_dim, block_size), dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.values = [torch.empty((num_blocks + 1, num_kv_heads, block_size, head_dim), dtype=dtype, device=device)
                       for _ in range(num_layers)]
        self.zero_blocks([self.null_block])

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

    def gather_row(self, layer: int, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one row's first ``length`` tokens (``block_ids`` ``[n]`` covers them),
        as ``[kv_heads, length, head_dim]``."""
        k, v = gather_blocks(self.keys[layer], self.values[layer], block_ids)
        return k[:, :length], v[:, :length]
