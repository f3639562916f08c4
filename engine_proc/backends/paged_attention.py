"""Attention over the paged KV cache, as a transformers attention function.

:func:`paged_attention` is registered under :data:`ATTN_IMPLEMENTATION` through
transformers' ``AttentionInterface``. Each forward of the paged backend hands it a
:class:`PagedForward` (block tables, slots, lengths) or a :class:`MixedForward` through
the model's forward kwargs, which transformers passes down to the attention function::

    model(input_ids, position_ids, paged_forward=PagedForward(...))
      └─ LlamaAttention ─► paged_attention(module, q, k, v, mask, paged_forward=...)
                             ① write k, v of the new tokens into their slots
                             ② attend over the row's KV [0, seq_len + q), causal in the chunk

Without ``paged_forward`` (the HF backend or a plain ``model(...)`` on the same model
object) the function is transformers' SDPA attention with transformers' SDPA mask,
so switching a model to this implementation changes nothing for other callers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from engine_proc.block_pool import cdiv
from engine_proc.kernels import TorchKernels
from engine_proc.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "tickserve_paged"
"""Name of :func:`paged_attention` in transformers' attention registry."""


class DecodeAttention(str, enum.Enum):
    """How a decode step attends (all give the same numbers, to rounding).

    KERNEL: ``kernels.decode_attention`` — on a CPU the C kernel that reads each row's
    blocks in place (no gather, no padding, one call per layer for the whole batch);
    elsewhere two batched matmuls over gathered blocks. The default.
    BATCHED: one SDPA call over every row's KV gathered into ``[B, kv_heads, W, head_dim]``,
    padded to the longest row with the null block, plus a key mask.
    PER_ROW: one SDPA call per row over exactly its own KV (a call per row per layer).
    The last two are kept as the baselines of ``tools/bench_attention.py``.
    """

    KERNEL = "kernel"
    BATCHED = "batched"
    PER_ROW = "per_row"


@dataclass
class PagedForward:
    """Per-forward metadata for :func:`paged_attention`, built once and shared by every layer.

    Two shapes of batch:

    * prefill: rows one after another in one sequence, row ``i`` being the
      ``segments[i] = (offset, q_i, start_i)`` slice of it: ``q_i`` new tokens at
      positions ``[start_i, start_i + q_i)``.
    * decode: ``B`` rows, one new token each, row ``i`` at position ``seq_lens[i] - 1``.

    ``slots``: ``[B * q]`` flat cache slots of the new tokens. ``block_tables``: ``[B, n]``
    block ids covering each row's KV after this forward, padded with the null block.
    ``seq_lens``: ``[B]`` KV length of each row after this forward (tokens).
    ``decode_attention``: decode only, the kernel choice; ``key_mask`` (BATCHED only),
    ``[B, 1, 1, n * block_size]`` bool, True where a key exists; ``kernel_lens``
    (KERNEL only): ``seq_lens`` as an int32 tensor. ``kernels``: the backend's
    :class:`~engine_proc.kernels.TorchKernels` (or C kernels).
    """

    cache: PagedKVCache
    slots: torch.Tensor
    block_tables: torch.Tensor  # int32
    seq_lens: list[int]
    is_prefill: bool
    decode_attention: DecodeAttention = DecodeAttention.KERNEL
    key_mask: torch.Tensor | None = field(default=None, repr=False)
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    kernels: TorchKernels | None = field(default=None, repr=False)
    kernel_lens: torch.Tensor | None = field(default=None, repr=False)

    def row_blocks(self, i: int) -> torch.Tensor:
        """Row ``i``'s block ids ``[n_i]``, exactly covering its ``seq_lens[i]`` tokens."""
        return self.block_tables[i, : cdiv(self.seq_lens[i], self.cache.block_size)]


@dataclass
class MixedForward:
    """Metadata of a mixed pass (``PREFILL_MODE=mixed_batch``): one sequence
    ``[1, B + Σ q_i]`` holding ``B`` decode rows as one-token segments first, then the
    prefill chunks. Each part attends with its own path (``decode``, ``prefill``), so
    the decode kernel choice carries over unchanged; the linear layers run once for all.

    ``slots``: ``[B + Σ q_i]`` cache slots of every new token, decode rows first.
    """

    cache: PagedKVCache
    slots: torch.Tensor
    decode: PagedForward
    prefill: PagedForward

    @property
    def num_decode(self) -> int:
        return len(self.decode.seq_lens)


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None = None,
                    dropout: float = 0.0, paged_forward: PagedForward | MixedForward | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """Attention over a paged KV cache (transformers' attention-function signature).

    ``query`` ``[B, heads, q, head_dim]``; ``key``/``value`` ``[B, kv_heads, q, head_dim]``
    of the new tokens only. Returns ``([B, q, heads, head_dim], None)``. Without
    ``paged_forward`` it is transformers' SDPA attention.
    """
    if paged_forward is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    meta = paged_forward
    layer = module.layer_idx
    meta.cache.write(layer, meta.slots, key, value)
    if isinstance(meta, MixedForward):
        out = _mixed_attention(meta, layer, query, key, value, scaling)
    elif meta.is_prefill:
        out = _prefill_attention(meta, layer, query, key, value, scaling)
    else:
        out = decode_attention(meta, layer, query, scaling)
    return out.transpose(1, 2).contiguous(), None


def _prefill_attention(meta: PagedForward, layer: int, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Prefill rows: each attends causally over its own ``[0, start + q)``."""
    if len(meta.segments) == 1:
        return _prefill_row(meta, layer, 0, meta.segments[0][2], query, key, value, scaling)
    return torch.cat([
        _prefill_row(meta, layer, i, start, query[:, :, off:off + q], key[:, :, off:off + q],
                     value[:, :, off:off + q], scaling)
        for i, (off, q, start) in enumerate(meta.segments)], dim=2)


def _mixed_attention(meta: MixedForward, layer: int, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Decode rows (the first ``B`` tokens of the sequence) through the decode path,
    the prefill chunks after them through the prefill path. ``[1, heads, B + Σ q_i, dim]``."""
    b = meta.num_decode
    q_decode = query[0, :, :b].transpose(0, 1).unsqueeze(2)  # [B, heads, 1, dim]
    decoded = decode_attention(meta.decode, layer, q_decode, scaling)
    prefilled = _prefill_attention(meta.prefill, layer, query[:, :, b:], key[:, :, b:], value[:, :, b:], scaling)
    return torch.cat([decoded.squeeze(2).transpose(0, 1).unsqueeze(0), prefilled], dim=2)


def _prefill_row(meta: PagedForward, layer: int, i: int, start: int, query: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Row ``i`` of a prefill, ``q`` tokens from ``start``: causal over ``[0, start + q)``."""
    gqa = query.shape[1] != key.shape[1]
    if start == 0:  # nothing earlier: the new tokens are the whole KV
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                              enable_gqa=gqa)
    length = meta.seq_lens[i]
    k, v = meta.cache.gather_row(layer, meta.row_blocks(i), length)
    q_len = query.shape[2]
    q_pos = torch.arange(start, start + q_len, device=query.device)
    mask = torch.arange(length, device=query.device)[None, :] <= q_pos[:, None]  # [q, length]
    return F.scaled_dot_product_attention(query, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                          scale=scaling, enable_gqa=gqa)


def decode_attention(meta: PagedForward, layer: int, query: torch.Tensor,
                      scaling: float | None) -> torch.Tensor:
    """``B`` rows, one query token each (see :class:`DecodeAttention`). ``[B, heads, 1, dim]``.

    GQA is folded into the query axis: the ``heads / kv_heads`` query heads sharing a
    KV head become that head's "query tokens" (``[kv_heads, group, head_dim]``), so
    K/V are never repeated and a key mask broadcasts over heads and group.
    """
    batch, heads, _, dim = query.shape
    if meta.decode_attention is DecodeAttention.KERNEL:
        out = meta.kernels.decode_attention(query.reshape(batch, heads * dim), meta.cache.keys[layer],
                                            meta.cache.values[layer], meta.block_tables, meta.kernel_lens,
                                            scaling if scaling is not None else dim ** -0.5)
        return out.view(batch, heads, 1, dim)
    return decode_sdpa(meta, layer, query, scaling)


def decode_sdpa(meta: PagedForward, layer: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Decode attention through SDPA (BATCHED or PER_ROW): ``[B, heads, 1, dim]``."""
    batch, heads, _, dim = query.shape
    kv_heads = meta.cache.keys[layer].shape[1]
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    if meta.decode_attention is DecodeAttention.BATCHED:
        k, v = meta.cache.gather(layer, meta.block_tables)  # [B, kv_heads, W, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.key_mask, scale=scaling)
        return out.reshape(batch, heads, 1, dim)
    out = torch.empty_like(q)
    for i, length in enumerate(meta.seq_lens):
        k, v = meta.cache.gather_row(layer, meta.row_blocks(i), length)  # [kv_heads, L, head_dim]
        out[i] = F.scaled_dot_product_attention(q[i], k, v, scale=scaling)
    return out.reshape(batch, heads, 1, dim)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
# The model's mask builder then behaves as for "sdpa" (callers without paged metadata
# get exactly SDPA); with paged metadata there is no padding mask and no cache, so it
# returns None and costs nothing.
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def meta_is_prefill(meta: PagedForward | MixedForward) -> bool:
    """A pass with no decode rows (their attention mode then does not matter)."""
    return isinstance(meta, PagedForward) and meta.is_prefill
