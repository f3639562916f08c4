"""Paged backend: every row's KV lives in fixed-size blocks named by the block pool.

KV layout: :mod:`engine_proc.kv_cache` (one K and one V tensor per decoder layer,
keys transposed within a block; block ``num_blocks`` is the null block)::

    row "a", block_size 4, table [7, 3, 12], seq_len 9 (KV of positions 0..8 written)

    position   0  1  2  3 | 4  5  6  7 | 8  .  .  .
    block      7            3            12 (partial)
    slot(p) = table[p // 4] * 4 + p % 4          e.g. slot(5) = 3 * 4 + 1 = 13

No left padding anywhere: each row keeps its own ``seq_len`` (tokens whose KV is
written) and is fed at its true positions. The model runs with no transformers
cache; attention over the blocks is :mod:`engine_proc.backends.paged_attention`
(registered with transformers, handed a :class:`PagedForward` per pass) or, for
Llama-family models, :class:`~engine_proc.backends.llama_runner.LlamaRunner`'s own.

Prefix caching needs nothing special here: a row that hit the cache starts its first
``prefill_chunk`` at ``start_pos = pool.num_cached_tokens(row)``, and the hit blocks
already hold that KV (written by the row that committed them). Blocks of a new row
past its cached prefix are zeroed once when the row starts, so the masked tail of a
partially written block is finite (the pool's tensor is allocated with ``empty``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_proc.backends.base import Backend, PrefillChunk
from engine_proc.backends.kernel_batch import BatchRejected, KernelLimits, check_batch
from engine_proc.backends.paged_attention import (ATTN_IMPLEMENTATION, DecodeAttention, MixedForward,
                                                  PagedForward, meta_is_prefill)
from engine_proc.block_pool import BlockPool, cdiv
from engine_proc.core_lending import LEND_MAX_ROWS
from engine_proc.kernels import select_kernels
from engine_proc.kv_cache import PagedKVCache, write_slots
from engine_proc.threads import ThreadPlan


def _check_supported(config, max_model_len: int) -> None:
    """:func:`~engine_proc.backends.paged_attention.paged_attention` is plain causal softmax
    attention over the whole row: refuse models that need more (a sliding window shorter
    than the context, logit soft-capping)."""
    window = getattr(config, "sliding_window", None)
    sliding = getattr(config, "use_sliding_window", True) or "sliding_attention" in (
        getattr(config, "layer_types", None) or [])
    if window and sliding and window < max_model_len:
        raise NotImplementedError(f"sliding-window attention ({window} tokens) is not supported by the "
                                  "paged backend; use --backend hf")
    if getattr(config, "attn_logit_softcapping", None):
        raise NotImplementedError("attention logit soft-capping is not supported by the paged backend; "
                                  "use --backend hf")


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
                 runner: bool | None = None, threads: ThreadPlan | None = None, low_bit=None,
                 kv_prefault: bool = False):
        """``decode_attention``: None → KERNEL. ``kernels``: ``auto`` (C on a CPU where
        they build, else torch ops) | ``c`` | ``torch``. ``runner``: None → the lean
        runner when the model is one it runs, False → always transformers. Raises
        NotImplementedError for a model whose attention this backend would get wrong,
        and KernelsUnavailable for ``kernels="c"`` where they cannot be built. ``low_bit``: packed
        low-bit projections (:class:`~engine_proc.gguf_weights.GGUFWeights`) for the lean
        runner, run by ``qmatmul.c`` for the passes :func:`~engine_proc.backends.linear.measure_crossover`
        gives them (it raises KernelsUnavailable where that cannot be built). ``kv_prefault``:
        map the KV pool's pages ahead of use on an idle thread (:mod:`engine_proc.kv_prefault`)."""
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
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
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
        self.qmatmul = None
        if low_bit is not None and why_not is None and self.device.type == "cpu":
            from engine_proc.kernels import QMatmul

            self.qmatmul = QMatmul(param.dtype, torch.get_num_threads())
        self.runner = LlamaRunner(model, self.cache, self.kernels, max_model_len, low_bit=low_bit,
                                  qmatmul=self.qmatmul) if why_not is None else None
        self.model_runner = "tickserve llama" if self.runner else "transformers"
        self.threads = threads if self.device.type == "cpu" else None
        if self.threads is not None:
            self.threads.kernels = [self.kernels, self.qmatmul]
        self.pairs_per_token = pairs_per_token(model, heads, head_dim)
        if self.runner is not None and self.qmatmul is not None:
            from engine_proc.backends.crossover_cache import host_crossover
            from engine_proc.backends.linear import PROBE_ROWS, measure_crossover

            probes = [layer.gate_up for layer in self.runner.layers]  # once per host: engines then agree
            probe = probes[0]
            self.runner.plan.quantized_below = host_crossover(
                lambda: measure_crossover(probes, param.dtype),
                (probe.out_features, probe.weight.shape[1] if probe.weight is not None else 0, param.dtype,
                 low_bit.summary, self.qmatmul.description, self.qmatmul.source_digest, torch.get_num_threads(),
                 f"{len(probes)} layers at rows {'/'.join(map(str, PROBE_ROWS))}"))
            if self.threads is not None:  # thread-count-independent passes may borrow idle engines' cores
                self.threads.lend_below = min(self.runner.plan.quantized_below, LEND_MAX_ROWS)
        self.weights_precision = f"{low_bit.summary} ({low_bit.kind})" if self.qmatmul is not None else ""
        self.matmul_plan = self._describe_matmul()
        rope_rows = self.runner.cos_sin.shape[0] if self.runner is not None else max_model_len
        self.limits = KernelLimits(block_pool.num_blocks, self.block_size, rope_rows, self.device)
        if self.runner is not None:
            self.runner.prefill_plan = measure_prefill_attention(self.kernels, self.cache, heads, head_dim,
                                                                 self.threads)
        self._rows: dict[str, _Row] = {}
        self._decode: list[str] = []  # decode batch order
        # last, after the start-up measurements: the pool's pages mapped ahead of use
        self.kv_prefaulter = self.cache.start_prefault() if kv_prefault else None

    def _describe_matmul(self) -> str:
        """The runtime record's ``matmul``: which kernel a pass of how many rows takes."""
        dense = "oneDNN" if self.runner is not None and self.runner.packed else "torch"
        if self.qmatmul is None:
            return dense
        below = self.runner.plan.quantized_below
        low = f"low-bit {self.qmatmul.description}"
        return f"{low} (every pass)" if below >= 1 << 30 else f"{low} below {below} rows, {dense} above"

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

    def adopt(self, row_id: str, seq_len: int) -> None:
        """A row whose first ``seq_len`` tokens' KV was copied into its blocks (a handover,
        ``PREFILL_MODE=disaggregated``): start it as prefilled; :meth:`promote` follows.
        Raises ``ValueError`` for a row that exists or a table too short."""
        if row_id in self._rows:
            raise ValueError(f"row {row_id} already exists")
        block_ids = self.block_pool.block_table(row_id)
        bs = self.block_size
        n = cdiv(seq_len, bs)
        if n > len(block_ids):
            raise ValueError(f"{seq_len} tokens exceed the row's {len(block_ids)} blocks")
        if self._reads_block_tails:  # the copied last block's tail is whatever the other engine had
            self.cache.zero_blocks(block_ids[n:])
            if seq_len % bs:
                slots = torch.arange(block_ids[n - 1] * bs + seq_len % bs, block_ids[n - 1] * bs + bs,
                                     device=self.device)
                zeros = torch.zeros(slots.numel(), self.num_kv_heads, self.head_dim, device=self.device)
                for layer in range(len(self.cache.keys)):
                    write_slots(self.cache.keys[layer], self.cache.values[layer], slots, zeros, zeros)
        self._rows[row_id] = _Row(block_ids, seq_len)

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
