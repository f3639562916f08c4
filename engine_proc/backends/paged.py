"""Paged backend: every row's KV lives in fixed-size blocks named by the block pool.

KV layout: :mod:`engine_proc.kv_cache` (one K and one V tensor per decoder layer,
keys transposed within a block; block ``num_blocks`` is the null block)::

    row "a", block_size 4, table [7, 3, 12], seq_len 9 (KV of positions 0..8 written)

    position   0  1  2  3 | 4  5  6  7 | 8  .  .  .
    block      7            3            12 (partial)
    slot(p) = table[p // 4] * 4 + p % 4          e.g. slot(5) = 3 * 4 + 1 = 13

No left padding anywhere: each row keeps its own ``seq_len`` (tokens whose KV is
written) and is fed at its true positions. The model runs with no transformers
cache; attention is the function :func:`paged_attention`, registered under
:data:`ATTN_IMPLEMENTATION` through transformers' ``AttentionInterface``. Each
forward hands it a :class:`PagedForward` (block tables, slots, lengths) through the
model's forward kwargs, which transformers passes down to the attention function::

    model(input_ids, position_ids, paged_forward=PagedForward(...))
      └─ LlamaAttention ─► paged_attention(module, q, k, v, mask, paged_forward=...)
                             ① write k, v of the new tokens into their slots
                             ② attend over the row's KV [0, seq_len + q), causal in the chunk

Without ``paged_forward`` (the HF backend or a plain ``model(...)`` on the same model
object) the function is transformers' SDPA attention with transformers' SDPA mask,
so switching a model to this implementation changes nothing for other callers.

Prefix caching needs nothing special here: a row that hit the cache starts its first
``prefill_chunk`` at ``start_pos = pool.num_cached_tokens(row)``, and the hit blocks
already hold that KV (written by the row that committed them). Blocks of a new row
past its cached prefix are zeroed once when the row starts, so the masked tail of a
partially written block is finite (the pool's tensor is allocated with ``empty``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from engine_proc.backends.base import Backend, PrefillChunk
from engine_proc.backends.kernel_batch import BatchRejected, KernelLimits, check_batch
from engine_proc.block_pool import BlockPool, cdiv
from engine_proc.kernels import TorchKernels, select_kernels
from engine_proc.kv_cache import PagedKVCache
from engine_proc.threads import ThreadPlan

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
        out = _decode_attention(meta, layer, query, scaling)
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
    decoded = _decode_attention(meta.decode, layer, q_decode, scaling)
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


def _decode_attention(meta: PagedForward, layer: int, query: torch.Tensor,
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


def _check_supported(config, max_model_len: int) -> None:
    """:func:`paged_attention` is plain causal softmax attention over the whole row: refuse
    models that need more (a sliding window shorter than the context, logit soft-capping)."""
    window = getattr(config, "sliding_window", None)
    sliding = getattr(config, "use_sliding_window", True) or "sliding_attention" in (
        getattr(config, "layer_types", None) or [])
    if window and sliding and window < max_model_len:
        raise NotImplementedError(f"sliding-window attention ({window} tokens) is not supported by the "
                                  "paged backend; use --backend hf")
    if getattr(config, "attn_logit_softcapping", None):
        raise NotImplementedError("attention logit soft-capping is not supported by the paged backend; "
                                  "use --backend hf")


def meta_is_prefill(meta: PagedForward | MixedForward) -> bool:
    """A pass with no decode rows (their attention mode then does not matter)."""
    return isinstance(meta, PagedForward) and meta.is_prefill


@dataclass
class _PassPart:
    """One part of a forward pass being assembled: its tokens ``ids`` ``[n]`` at
    ``positions`` ``[n]``, its attention metadata, the sequence indices whose logits it
    needs (``keep``), and the row lengths to record once the pass succeeds."""

    meta: PagedForward
    ids: torch.Tensor
    positions: torch.Tensor
    keep: torch.Tensor
    rows: list[tuple["_Row", int]]
    spans: list[tuple[int, int]] | None = None  # prefill: per chunk, (first index into keep, count)

    def advance(self) -> None:
        for row, end in self.rows:
            row.seq_len = end

    def chunk_logits(self, logits: torch.Tensor, chunks) -> list[torch.Tensor | None]:
        """Per chunk: its last token's logits ``[vocab]``, every position's ``[n, vocab]``
        (``all_logits``), or ``None``; ``logits`` are this part's rows of the output."""
        return [logits[i: i + k] if c.all_logits else logits[i] if c.compute_logits else None
                for (i, k), c in zip(self.spans, chunks)]


@dataclass
class _Row:
    block_ids: list[int]  # the pool's table (covers the row's whole reservation)
    seq_len: int  # tokens whose KV is written


def pairs_per_token(model: torch.nn.Module, heads: int, head_dim: int) -> float | None:
    """:attr:`Backend.pairs_per_token` from the model's shapes: the multiply-adds of one
    token through a decoder layer's linear layers (every 2-D weight in the layer) over
    the ``2 · heads · head_dim`` of one query-key pair (QKᵀ and PV). About 3,000 for
    SmolLM2-135M; a measured pair on a CPU costs within 10 % of that ratio."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return None
    linear = sum(p.numel() for p in layers[0].parameters() if p.dim() == 2)
    return linear / (2 * heads * head_dim)


class PagedBackend(Backend):
    """Prefill chunks packed into one pass, decode batched, or both in one pass
    (:meth:`mixed_step`); KV in a :class:`PagedKVCache` indexed by the block tables of
    ``block_pool`` (read-only here: the scheduler allocates and frees).

    Llama-family models run through :class:`~engine_proc.backends.llama_runner.LlamaRunner`
    (fused projections and kernels); others through transformers' modeling code with
    :func:`paged_attention` as their attention function.
    """

    def __init__(self, model: torch.nn.Module, max_model_len: int, block_pool: BlockPool,
                 decode_attention: DecodeAttention | str | None = None, kernels: str = "auto",
                 runner: bool | None = None, threads: ThreadPlan | None = None):
        """``decode_attention``: None → KERNEL. ``kernels``: ``auto`` (C on a CPU where
        they build, else torch ops) | ``c`` | ``torch``. ``runner``: None → the lean
        runner when the model is one it runs, False → always transformers. Raises
        NotImplementedError for a model whose attention this backend would get wrong,
        and KernelsUnavailable for ``kernels="c"`` where they cannot be built."""
        from engine_proc.backends.llama_runner import LlamaRunner, unsupported_reason
        from engine_proc.backends.prefill_attention import measure as measure_prefill_attention

        config = model.config
        _check_supported(config, max_model_len)
        self.model = model
        param = next(model.parameters())
        self.device = param.device
        self.vocab_size = config.vocab_size
        self.max_model_len = max_model_len
        self.block_pool = block_pool
        self.block_size = block_pool.block_size
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.cache = PagedKVCache(config.num_hidden_layers, block_pool.num_blocks, self.block_size,
                                  num_kv_heads, head_dim, param.dtype, self.device)
        self.kernels = select_kernels(self.device, param.dtype, head_dim, heads // num_kv_heads, self.block_size,
                                      kernels)
        self.decode_attention = DecodeAttention(decode_attention or DecodeAttention.KERNEL)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise NotImplementedError(f"{type(model).__name__} cannot switch its attention function "
                                      "(AttentionInterface); use --backend hf")
        why_not = unsupported_reason(model) if runner is not False else "disabled"
        self.runner = LlamaRunner(model, self.cache, self.kernels, max_model_len) if why_not is None else None
        self.model_runner = "tickserve llama" if self.runner else "transformers"
        self.threads = threads if self.device.type == "cpu" else None
        if self.threads is not None:
            self.threads.kernels = self.kernels
        self.pairs_per_token = pairs_per_token(model, heads, head_dim)
        rope_rows = self.runner.cos_sin.shape[0] if self.runner is not None else max_model_len
        self.limits = KernelLimits(block_pool.num_blocks, self.block_size, rope_rows, self.device)
        if self.runner is not None:
            self.runner.prefill_plan = measure_prefill_attention(self.kernels, self.cache, heads, head_dim,
                                                                 self.threads)
        self._rows: dict[str, _Row] = {}
        self._decode: list[str] = []  # decode batch order

    @property
    def _reads_block_tails(self) -> bool:
        """Whether decode attention reads the unwritten tail of a row's last block and
        relies on it being finite (it masks the scores, but 0 · NaN is NaN): the torch
        kernel and BATCHED SDPA do, so a row's new blocks are zeroed for them. The C
        kernel and PER_ROW read exactly the written tokens."""
        if self.decode_attention is DecodeAttention.KERNEL:
            return self.kernels.name != "c"
        return self.decode_attention is DecodeAttention.BATCHED

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: PagedForward | MixedForward,
                 keep: torch.Tensor) -> torch.Tensor:
        """One forward pass over the flat sequence ``ids`` ``[T]``; float32 logits at the
        positions ``keep`` ``[K]``, shape ``[K, vocab]``."""
        if self.threads is not None:
            self.threads.apply(ids.numel())
        if self.runner is not None and (self.decode_attention is DecodeAttention.KERNEL or meta_is_prefill(meta)):
            decode = meta.decode if isinstance(meta, MixedForward) else None if meta.is_prefill else meta
            prefill = meta.prefill if isinstance(meta, MixedForward) else meta if meta.is_prefill else None
            return self.runner.forward(ids, positions, meta.slots, decode, prefill, keep).float()
        if isinstance(meta, PagedForward) and not meta.is_prefill:  # transformers: a batch of 1-token rows
            out = self.model(input_ids=ids.view(-1, 1), position_ids=positions.view(-1, 1), use_cache=False,
                             logits_to_keep=1, paged_forward=meta)
            return out.logits[:, -1].float()
        out = self.model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False,
                         logits_to_keep=keep, paged_forward=meta)
        return out.logits[0].float()

    # ------------------------------------------------------------------ prefill

    def prefill_chunk(self, row_id, token_ids, start_pos, compute_logits, all_logits=False):
        return self.prefill_chunks([PrefillChunk(row_id, token_ids, start_pos, compute_logits, all_logits)])[0]

    packs_prefill = True

    @torch.inference_mode()
    def prefill_chunks(self, chunks):
        """Several rows' prefill chunks packed into one sequence ``[1, Σ q_i]``: the linear
        layers run once for all of them; attention runs per row over its own KV. Row
        state advances only after the forward succeeds."""
        part = self._prefill_inputs(chunks)
        logits = self._forward(part.ids, part.positions, part.meta, part.keep)
        part.advance()
        return part.chunk_logits(logits, chunks)  # each row's last token

    def _prefill_inputs(self, chunks, offset: int = 0) -> "_PassPart":
        """Inputs of ``chunks`` packed one after another; ``offset``: tokens before them in
        the sequence. Validates every chunk; changes no row state."""
        rows, segments, slots, ids, positions, tables, lens, last = [], [], [], [], [], [], [], []
        seg_offset = 0
        spans: list[tuple[int, int]] = []  # per chunk: (first index into `last`, how many)
        for c in chunks:
            row = self._rows.get(c.row_id) or self._start_row(c.row_id)
            if row.seq_len != c.start_pos:
                raise BatchRejected([c.row_id], f"KV holds {row.seq_len} tokens, the chunk starts at {c.start_pos}")
            n = len(c.token_ids)
            end = c.start_pos + n
            self._check_room(c.row_id, row, end)
            rows.append((row, end))
            segments.append((seg_offset, n, c.start_pos))
            slots.append(self._slots(row.block_ids, range(c.start_pos, end)))
            ids.extend(c.token_ids)
            positions.append(torch.arange(c.start_pos, end, device=self.device))
            tables.append(row.block_ids[: cdiv(end, self.block_size)])
            lens.append(end)
            spans.append((len(last), n if c.all_logits else 1))
            first = offset + seg_offset
            last.extend(range(first, first + n) if c.all_logits else [first + n - 1])
            seg_offset += n
        width = max(len(t) for t in tables)
        null = self.cache.null_block
        meta = PagedForward(
            cache=self.cache, slots=torch.cat(slots), is_prefill=True, seq_lens=lens, segments=segments,
            block_tables=torch.tensor([t + [null] * (width - len(t)) for t in tables], dtype=torch.int32,
                                      device=self.device), kernels=self.kernels)
        pos = torch.cat(positions)
        check_batch(self.limits, [c.row_id for c in chunks], meta.block_tables, lens, meta.slots, pos,
                    token_offsets=[seg[0] for seg in segments])
        return _PassPart(meta, torch.tensor(ids, dtype=torch.long, device=self.device), pos,
                         torch.tensor(last, device=self.device), rows, spans)

    def _start_row(self, row_id: str) -> _Row:
        """A row's first chunk: its table from the pool; KV already holds the cached prefix."""
        block_ids = self.block_pool.block_table(row_id)
        cached = self.block_pool.num_cached_tokens(row_id)
        if self._reads_block_tails:
            self.cache.zero_blocks(block_ids[cached // self.block_size:])
        row = self._rows[row_id] = _Row(block_ids, cached)
        return row

    def promote(self, row_id):
        if row_id not in self._rows or row_id in self._decode:
            raise ValueError(f"row {row_id} is not a prefilled row")
        self._decode.append(row_id)

    # ------------------------------------------------------------------ decode

    @torch.inference_mode()
    def decode_step_batched(self, row_ids, token_ids, positions):
        part = self._decode_inputs(row_ids, token_ids, positions)
        logits = self._forward(part.ids, part.positions, part.meta, part.keep)
        part.advance()
        return logits

    def _decode_inputs(self, row_ids, token_ids, positions) -> "_PassPart":
        """Inputs of one decode step (one token per decode row). Validates (raises
        :class:`BatchRejected`); changes no row state."""
        if list(row_ids) != self._decode:
            raise BatchRejected(list(row_ids), "decode rows differ from the promoted rows")
        rows = [self._rows[r] for r in row_ids]
        bs = self.block_size
        slots, tables, lens = [], [], []
        for rid, row, pos in zip(row_ids, rows, positions):
            if pos != row.seq_len:
                raise BatchRejected([rid], f"KV holds {row.seq_len} tokens, a token fed at position {pos}")
            self._check_room(rid, row, pos + 1)
            slots.append(row.block_ids[pos // bs] * bs + pos % bs)
            tables.append(row.block_ids[: pos // bs + 1])
            lens.append(pos + 1)
        width = max(len(t) for t in tables)
        null = self.cache.null_block
        block_tables = torch.tensor([t + [null] * (width - len(t)) for t in tables], dtype=torch.int32,
                                    device=self.device)
        meta = PagedForward(cache=self.cache, slots=torch.tensor(slots, device=self.device),
                            block_tables=block_tables, seq_lens=lens, is_prefill=False,
                            decode_attention=self.decode_attention, kernels=self.kernels)
        if self.decode_attention is DecodeAttention.KERNEL:
            meta.kernel_lens = torch.tensor(lens, dtype=torch.int32, device=self.device)
        elif self.decode_attention is DecodeAttention.BATCHED:
            seq_lens = torch.tensor(lens, device=self.device)
            key_mask = torch.arange(width * bs, device=self.device)[None, :] < seq_lens[:, None]
            meta.key_mask = key_mask[:, None, None, :]
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.device)
        check_batch(self.limits, list(row_ids), block_tables, lens, meta.slots, pos, kernel_lens=meta.kernel_lens)
        return _PassPart(meta, ids, pos, torch.arange(len(rows), device=self.device),
                         [(row, row.seq_len + 1) for row in rows])

    # ------------------------------------------------------------------ mixed

    packs_mixed = True

    @torch.inference_mode()
    def mixed_step(self, row_ids, token_ids, positions, chunks):
        """Decode rows and prefill chunks in one forward pass (``PREFILL_MODE=mixed_batch``).

        One sequence ``[1, B + Σ q_i]``: the ``B`` decode rows' tokens first (one-token
        segments, attended by the decode path), then the chunks (attended per row, as in
        :meth:`prefill_chunks`); the weights are read once for both. Returns
        ``(decode logits [B, vocab], per-chunk logits or None)``, float32. All or
        nothing: if it raises, no row's state has advanced.
        """
        decode = self._decode_inputs(row_ids, token_ids, positions)
        batch = len(row_ids)
        prefill = self._prefill_inputs(chunks, offset=batch)
        meta = MixedForward(cache=self.cache, slots=torch.cat([decode.meta.slots, prefill.meta.slots]),
                            decode=decode.meta, prefill=prefill.meta)
        logits = self._forward(torch.cat([decode.ids, prefill.ids]), torch.cat([decode.positions, prefill.positions]),
                               meta, torch.cat([decode.keep, prefill.keep]))  # [B + len(chunks), vocab]
        decode.advance()
        prefill.advance()
        return logits[:batch], prefill.chunk_logits(logits[batch:], chunks)

    # ------------------------------------------------------------------ release

    def release(self, row_id):
        if self._rows.pop(row_id, None) is not None and row_id in self._decode:
            self._decode.remove(row_id)

    def kv_length(self):
        """Longest decode row's KV, in tokens (drops when that row leaves)."""
        return max((self._rows[r].seq_len for r in self._decode), default=0)

    def seq_len(self, row_id: str) -> int:
        """Tokens of ``row_id`` whose KV is written. KeyError for an unknown row."""
        return self._rows[row_id].seq_len

    @property
    def num_decode_rows(self) -> int:
        return len(self._decode)

    # ------------------------------------------------------------------ helpers

    def _check_room(self, row_id: str, row: _Row, num_tokens: int) -> None:
        """The pool's table must cover ``num_tokens``; refresh it if the pool grew it."""
        if num_tokens > len(row.block_ids) * self.block_size:
            old = len(row.block_ids)
            row.block_ids = self.block_pool.block_table(row_id)
            if self._reads_block_tails:
                self.cache.zero_blocks(row.block_ids[old:])
            if num_tokens > len(row.block_ids) * self.block_size:
                raise BatchRejected([row_id], f"{num_tokens} tokens exceed its {len(row.block_ids)} blocks")

    def _slots(self, block_ids: list[int], positions: range) -> torch.Tensor:
        bs = self.block_size
        table = torch.tensor(block_ids, device=self.device)
        pos = torch.arange(positions.start, positions.stop, device=self.device)
        return table[pos // bs] * bs + pos % bs
