"""A GGUF file's Llama weights as packed low-bit tensors (:mod:`engine_proc.quant`).

Read with the ``gguf`` package's :class:`gguf.GGUFReader` (memory-mapped: nothing is
de-quantized). Names follow llama.cpp's Llama layout::

    token_embd.weight                 [vocab, hidden]   the LM head too when output.weight is absent (tied)
    output.weight                     [vocab, hidden]
    blk.{i}.attn_q / attn_k / attn_v / attn_output.weight
    blk.{i}.ffn_gate / ffn_up / ffn_down.weight

llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` for its RoPE
(``permute`` in ``convert_hf_to_gguf.py``: within each head, the rotary pairs ``(i, i +
D/2)`` become neighbours); transformers undoes it when it loads a GGUF
(``reverse_permute_weights``). The blocks run along the input dimension, so a row moves
whole: :func:`unpermute_rows` applies the same inverse permutation to the codes and
scales without de-quantizing them.

Q4_0, Q4_1 and Q8_0 are packed as they are. Other quantized types (the K-quants, Q5_*)
are de-quantized and re-quantized to Q8_0 (its 8-bit codes hold a 4–6-bit type's values
to within 1/254 of each block's range); float tensors stay float (``None`` here).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine_proc import quant

log = logging.getLogger(__name__)

NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
PROJECTIONS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
               "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


@dataclass
class GGUFWeights:
    """Packed projections by ``(layer, hf_name)`` (``hf_name`` as in transformers' Llama:
    ``q_proj``, …, ``down_proj``), the packed LM head and token embedding (``None`` when
    float tensors), the float tensors by their transformers name (the norms; the
    embedding or head where they are float), and the GGUF types seen, for the runtime
    record."""

    layers: dict[tuple[int, str], quant.PackedWeight] = field(default_factory=dict)
    lm_head: quant.PackedWeight | None = None
    embed: quant.PackedWeight | None = None
    floats: dict[str, np.ndarray] = field(default_factory=dict)
    types: dict[str, int] = field(default_factory=dict)
    kind: str = "gguf"  # what --quantization resolved to: gguf (the file's own types) | int8 | int4

    @property
    def summary(self) -> str:
        """E.g. ``"Q4_1×210 Q8_0×1"``: the source types of the packed weights."""
        return " ".join(f"{t}×{n}" for t, n in sorted(self.types.items()))


def unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation for ``n_head`` heads of
    ``n_rows / n_head`` rows: ``new[h, t, i] = old[h, i, t]`` with rows viewed as
    ``[n_head, D/2, 2]`` (transformers' ``reverse_permute_weights``)."""
    half = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(-1)


def _packed(tensor, n_out: int, n_in: int, rows: np.ndarray | None) -> quant.PackedWeight | None:
    from gguf import GGMLQuantizationType, quants

    kind = tensor.tensor_type.name
    if kind in ("F32", "F16", "BF16"):
        return None
    if kind in quant.GGUF_FORMATS:
        codes, d, m = quant.blocks_of(np.asarray(tensor.data), kind, n_out, n_in)
        if rows is not None:
            codes, d, m = codes[rows], d[rows], (m[rows] if m is not None else None)
        return quant.pack(codes, d, m, kind)
    dense = quants.dequantize(np.asarray(tensor.data), GGMLQuantizationType[kind]).reshape(n_out, n_in)
    if rows is not None:
        dense = dense[rows]
    raw = quants.quantize(np.ascontiguousarray(dense, dtype=np.float32), GGMLQuantizationType.Q8_0)
    packed = quant.from_gguf(raw, "Q8_0", n_out, n_in)
    packed.source = f"{kind}→Q8_0"
    return packed


def read(path: str | Path, config) -> GGUFWeights:
    """The packed weights of the Llama GGUF at ``path`` for a model of ``config`` (a
    transformers ``LlamaConfig``). Raises ``ValueError`` for a tensor whose shape the
    kernel cannot take or that the file lacks."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    out = GGUFWeights()
    for i in range(config.num_hidden_layers):
        for gguf_name, hf_name in PROJECTIONS.items():
            t = tensors.get(f"blk.{i}.{gguf_name}.weight")
            if t is None:
                raise ValueError(f"{path}: no tensor blk.{i}.{gguf_name}.weight")
            n_in, n_out = (int(x) for x in t.shape)  # GGUF lists the fastest dimension first
            rows = None
            if gguf_name == "attn_q":
                rows = unpermute_rows(n_out, heads)
            elif gguf_name == "attn_k":
                rows = unpermute_rows(n_out, kv_heads)
            packed = _packed(t, n_out, n_in, rows)
            if packed is not None:
                out.layers[(i, hf_name)] = packed
                out.types[packed.source] = out.types.get(packed.source, 0) + 1
        for gguf_name, hf_name in NORMS.items():
            out.floats[f"model.layers.{i}.{hf_name}.weight"] = _float(tensors, f"blk.{i}.{gguf_name}.weight", path)
    out.floats["model.norm.weight"] = _float(tensors, "output_norm.weight", path)
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{path}: no tensor token_embd.weight")
    head = tensors.get("output.weight")
    for name, t in (("model.embed_tokens.weight", embed), ("lm_head.weight", head)):
        if t is None:
            continue
        n_in, n_out = (int(x) for x in t.shape)
        packed = _packed(t, n_out, n_in, None)
        if packed is None:
            out.floats[name] = _float(tensors, t.name, path).reshape(n_out, n_in)
        elif name == "lm_head.weight":
            out.lm_head = packed
        else:
            out.embed = packed
    if head is None:  # tied: the embedding is the LM head
        out.lm_head = out.embed
    if out.lm_head is not None:
        out.types[out.lm_head.source] = out.types.get(out.lm_head.source, 0) + 1
    return out


def _float(tensors: dict, name: str, path) -> np.ndarray:
    t = tensors.get(name)
    if t is None:
        raise ValueError(f"{path}: no tensor {name}")
    if t.tensor_type.name not in ("F32", "F16", "BF16"):
        from gguf import GGMLQuantizationType, quants

        return quants.dequantize(np.asarray(t.data), GGMLQuantizationType[t.tensor_type.name]).astype(np.float32)
    if t.tensor_type.name == "BF16":
        return (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(t.data).astype(np.float32)
