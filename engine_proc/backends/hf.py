"""Hugging Face backend: transformers' ``DynamicCache``, decode rows left-padded.

Decode batch layout (``W`` = padded width, in tokens)::

    row 0   . . . . k k k k k k      mask 0 0 0 0 1 1 1 1 1 1
    row 1   k k k k k k k k k k      mask 1 1 1 1 1 1 1 1 1 1
    row 2   . . . . . . . k k k      mask 0 0 0 0 0 0 0 1 1 1
            ◄────────── W ─────────►

Each decode step appends one column to every row. A promoted row of length ``L`` is
left-padded to ``W`` (or the batch is padded to ``L`` when ``L > W``). A released
row is dropped; then leading columns that are padding in every remaining row are
trimmed. The attention mask is sized from its own width, never from
``kv_length()`` (the card's mask bookkeeping rule). Positions come from the
scheduler, so padding never shifts RoPE.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from transformers import DynamicCache

from engine_proc.backends.base import Backend


class HFBackend(Backend):
    """Batched decode on a left-padded ``DynamicCache`` ([batch, kv_heads, W, head_dim]
    per layer). Prefill runs per row on its own batch-1 cache."""

    def __init__(self, model: torch.nn.Module, max_model_len: int):
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        self.max_model_len = max_model_len
        self._prefill_caches: dict[str, DynamicCache] = {}
        self._rows: list[str] = []  # decode batch order
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [B, W]

    # ------------------------------------------------------------------ prefill

    @torch.inference_mode()
    def prefill_chunk(self, row_id, token_ids, start_pos, compute_logits, all_logits=False):
        cache = self._prefill_caches.setdefault(row_id, DynamicCache(config=self.config))
        if cache.get_seq_length() != start_pos:
            raise ValueError(f"row {row_id}: KV holds {cache.get_seq_length()} tokens, chunk starts at {start_pos}")
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        pos = torch.arange(start_pos, start_pos + ids.shape[1], device=self.device).unsqueeze(0)
        out = self.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True,
                         logits_to_keep=0 if all_logits else 1)
        if all_logits:
            return out.logits[0].float()
        return out.logits[0, -1].float() if compute_logits else None

    def promote(self, row_id):
        row = self._prefill_caches.pop(row_id)
        length = row.get_seq_length()
        width = self._mask.shape[1]
        new_width = max(width, length)
        row_mask = torch.zeros(1, new_width, dtype=torch.long, device=self.device)
        row_mask[:, new_width - length:] = 1
        mask = F.pad(self._mask, (new_width - width, 0))
        self._mask = torch.cat([mask, row_mask], dim=0)
        if self._cache is None:
            self._cache = row
        else:
            for batch_layer, row_layer in zip(self._cache.layers, row.layers):
                keys = F.pad(batch_layer.keys, (0, 0, new_width - width, 0))
                values = F.pad(batch_layer.values, (0, 0, new_width - width, 0))
                row_k = F.pad(row_layer.keys, (0, 0, new_width - length, 0))
                row_v = F.pad(row_layer.values, (0, 0, new_width - length, 0))
                batch_layer.keys = torch.cat([keys, row_k], dim=0)
                batch_layer.values = torch.cat([values, row_v], dim=0)
        self._rows.append(row_id)

    # ------------------------------------------------------------------ decode

    @torch.inference_mode()
    def decode_step_batched(self, row_ids, token_ids, positions):
        if list(row_ids) != self._rows:
            raise ValueError("decode rows differ from the promoted rows")
        batch = len(self._rows)
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device).view(batch, 1)
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.device).view(batch, 1)
        self._mask = F.pad(self._mask, (0, 1), value=1)
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=self._mask,
                         cache=self._cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    # ------------------------------------------------------------------ release

    def release(self, row_id):
        self._prefill_caches.pop(row_id, None)
        if row_id not in self._rows:
            return
        index = self._rows.index(row_id)
        self._rows.pop(index)
        if not self._rows:
            self._cache = None
            self._mask = self._mask[:0, :0]
            return
        keep = torch.tensor([i for i in range(len(self._rows) + 1) if i != index], device=self.device)
        mask = self._mask.index_select(0, keep)
        # Trim columns that are padding in every remaining row (sized from the mask itself).
        trim = int((mask.cumsum(dim=1) == 0).sum(dim=1).min())
        self._mask = mask[:, trim:]
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, keep)[:, :, trim:]
            layer.values = layer.values.index_select(0, keep)[:, :, trim:]

    def kv_length(self):
        return 0 if self._cache is None else self._cache.get_seq_length()

    @property
    def num_decode_rows(self) -> int:
        return len(self._rows)
