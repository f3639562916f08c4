"""A lean forward pass for Llama-family models over the paged KV cache.

transformers' modeling code is general: per decoder layer it runs three projections
for Q, K and V, RoPE as a dozen elementwise ops, an RMSNorm that round-trips through
float32 in seven ops, the attention interface's dispatch, and two MLP projections plus
the activation — about forty tensor ops a layer, 1,200 a step for SmolLM2's 30 layers.
On a CPU each costs microseconds of dispatch, which at batch 1 is as much as the
matmuls themselves. This runner reads the same weights and does, per layer::

    h   = rms_norm(x + residual)                      kernels.add_rms_norm   (fused)
    qkv = h @ W_qkvᵀ                                  one matmul (Q, K, V fused)
    rope(q, k); k, v → cache slots                    kernels.rope_write_kv  (fused; a decode row's k, v
                                                      are written by its attention, which reads that block)
    a   = attention(q, paged KV)                      kernels.decode_attention; per prefill segment the
                                                      path measured at start-up (prefill_attention.py)
    x   = a @ W_oᵀ
    h   = rms_norm(x + residual)                      kernels.add_rms_norm
    x   = silu(h @ W_gateᵀ) · (h @ W_upᵀ) @ W_downᵀ    one matmul (gate, up fused) + kernels.silu_and_mul

and the final norm and the LM head only on the positions whose logits are wanted. A
decode-only pass on the low-bit weights runs the same calls over every layer from C, in
one call (:mod:`engine_proc.backends.decode_loop`).
The fused weight matrices become the storage of the model's own ``q/k/v_proj`` and
``gate/up_proj`` weights (views), so memory is not doubled and the model still runs
through transformers unchanged.

Numbers: the same as transformers' Llama to float32 rounding in float32 (tested); in
bfloat16, RoPE is computed in float32 and rounded once where transformers rounds after
each op, so logits differ by bfloat16 noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_proc.backends.decode_loop import DecodeLoop
from engine_proc.backends.linear import Linear, MatmulPlan
from engine_proc.backends.prefill_attention import SDPA_ONLY, PrefillAttentionPlan, matmul_attention, sdpa_attention
from engine_proc.kernels import NewKV, TorchKernels

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def unsupported_reason(model) -> str | None:
    """Why :class:`LlamaRunner` cannot run ``model`` (then the paged backend runs it
    through transformers), or ``None``."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") in ("dynamic", "longrope"):
        return f"rope type {rope['rope_type']!r} depends on the sequence length"
    inner = getattr(model, "model", None)
    layer = getattr(inner, "layers", [None])[0]
    needed = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")
    if layer is None or any(_get(layer, n) is None for n in needed) or not hasattr(inner, "rotary_emb"):
        return "the model's modules are not laid out as transformers' Llama"
    return None


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def _fuse(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight ``[Σ out, in]`` (and bias) for several projections of the same input;
    each module's parameters become views into it."""
    weight = torch.cat([m.weight.detach() for m in linears])
    biases = [m.bias for m in linears]
    bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    if any(b is not None for b in biases) and bias is None:
        raise NotImplementedError("projections with and without bias cannot be fused")
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[start:start + n], requires_grad=False)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
    return weight, bias


@dataclass
class _Layer:
    ln1: torch.Tensor
    eps1: float
    qkv: Linear
    o: Linear
    ln2: torch.Tensor
    eps2: float
    gate_up: Linear
    down: Linear


class LlamaRunner:
    """Runs a Llama-family model (see :func:`unsupported_reason`) on a flat token
    sequence whose KV lives in a :class:`~engine_proc.kv_cache.PagedKVCache`.

    ``kernels``: :class:`~engine_proc.kernels.CKernels` on a CPU, or the torch ops.
    ``low_bit``: the model's projections and LM head as packed low-bit weights
    (:class:`~engine_proc.gguf_weights.GGUFWeights`), run by ``qmatmul``
    (:class:`~engine_proc.kernels.QMatmul`) for the passes ``plan`` gives them.
    """

    def __init__(self, model, cache, kernels: TorchKernels, max_model_len: int, pack_weights: bool = True,
                 low_bit=None, qmatmul=None, plan: MatmulPlan | None = None):
        reason = unsupported_reason(model)
        if reason:
            raise NotImplementedError(reason)
        config = model.config
        inner = model.model
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = self.head_dim ** -0.5
        self.cache = cache
        self.kernels = kernels
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.norm_eps = float(inner.norm.variance_epsilon)
        self.plan = plan or MatmulPlan()
        q = qmatmul if low_bit is not None else None

        def low(i, *names):
            parts = [low_bit.layers.get((i, n)) for n in names] if q is not None else []
            return dict(parts=parts, qmatmul=q, plan=self.plan) if parts and all(parts) else {}

        self.lm_head = Linear(model.lm_head.weight.detach(), _bias(model.lm_head), pack_weights, logits=True,
                              **(dict(parts=[low_bit.lm_head], qmatmul=q, plan=self.plan)
                                 if q is not None and low_bit.lm_head is not None else {}))
        self.layers: list[_Layer] = []
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                layer.input_layernorm.weight.detach(), float(layer.input_layernorm.variance_epsilon),
                Linear(*_fuse(attn.q_proj, attn.k_proj, attn.v_proj), pack_weights, **low(i, "q_proj", "k_proj", "v_proj")),
                Linear(attn.o_proj.weight.detach(), _bias(attn.o_proj), pack_weights, **low(i, "o_proj")),
                layer.post_attention_layernorm.weight.detach(), float(layer.post_attention_layernorm.variance_epsilon),
                Linear(*_fuse(mlp.gate_proj, mlp.up_proj), pack_weights, **low(i, "gate_proj", "up_proj")),
                Linear(mlp.down_proj.weight.detach(), _bias(mlp.down_proj), pack_weights, **low(i, "down_proj"))))
        self.packed = all(lin.packed is not None for layer in self.layers for lin in (layer.qkv, layer.o))
        self.low_bit = low_bit.summary if q is not None else ""
        self.cos_sin = rope_table(inner.rotary_emb, max_model_len, self.head_dim, self.embed.device)
        # which path each prefill segment's attention takes (measured by the backend)
        self.prefill_plan: PrefillAttentionPlan = SDPA_ONLY
        #: decode-only passes on the low-bit path run their layers in one C call (None: not here)
        self.decode_loop: DecodeLoop | None = DecodeLoop.build(self)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, decode, prefill,
                keep: torch.Tensor) -> torch.Tensor:
        """Logits at the positions ``keep`` ``[K]`` of the sequence ``ids`` ``[T]``, shape
        ``[K, vocab]`` in the model dtype.

        The sequence holds ``B`` decode rows (one token each, first; ``decode``, a
        ``PagedForward`` with int32 ``block_tables`` and ``kernel_lens``, or ``None``) and
        then the prefill segments of ``prefill`` (a ``PagedForward`` or ``None``).
        ``positions`` and ``slots`` ``[T]`` int64: each token's position and KV-cache slot.
        """
        num_decode = len(decode.seq_lens) if decode is not None else 0
        residual = F.embedding(ids, self.embed)
        if prefill is None and self.decode_loop is not None and self.decode_loop.applies(num_decode):
            x = self.decode_loop.run(residual, positions, slots, decode)
        else:
            x = self._layers(residual, positions, slots, decode, prefill, num_decode)
        last = residual.index_select(0, keep)
        last.add_(x.index_select(0, keep))
        return self.lm_head(self.kernels.add_rms_norm(last, None, self.norm, self.norm_eps))  # float32

    def _layers(self, residual: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, decode, prefill,
                num_decode: int) -> torch.Tensor:
        """Every decoder layer, one kernel call at a time: ``residual`` ``[T, hidden]`` (the
        embeddings) becomes the residual stream after the last attention block, in place;
        returns the last layer's MLP output ``[T, hidden]``."""
        k_caches, v_caches = self.cache.keys, self.cache.values
        kern = self.kernels
        hd, kvd = self.heads * self.head_dim, self.kv_heads * self.head_dim
        small, large = self._split_prefill(prefill, num_decode) if prefill is not None else (None, [])
        decode_slots = slots[:num_decode]
        x = None
        for i, layer in enumerate(self.layers):
            h = kern.add_rms_norm(residual if x is None else x, None if x is None else residual, layer.ln1, layer.eps1)
            qkv = layer.qkv(h)
            # decode rows' keys and values are written by their own attention (NewKV): one fetch of the lines
            kern.rope_write_kv(qkv, self.heads, self.kv_heads, positions, self.cos_sin, slots, k_caches[i], v_caches[i],
                               first_write=num_decode)
            q = qkv[:, :hd]
            new_kv = NewKV(qkv[:num_decode, hd:hd + kvd], qkv[:num_decode, hd + kvd:], decode_slots) \
                if num_decode else None
            if prefill is None:
                attn = kern.decode_attention(q, k_caches[i], v_caches[i], decode.block_tables, decode.kernel_lens,
                                             self.scale, new_kv)
            else:
                attn = torch.empty(q.shape, dtype=q.dtype, device=q.device)
                if num_decode:
                    attn[:num_decode] = kern.decode_attention(q[:num_decode], k_caches[i], v_caches[i],
                                                              decode.block_tables, decode.kernel_lens, self.scale,
                                                              new_kv)
                if small is not None:  # short segments: every prompt token as a one-query "row"
                    rows, tables, lens = small
                    attn[rows] = kern.decode_attention(q[rows], k_caches[i], v_caches[i], tables, lens, self.scale)
                self._prefill_attention(i, q, prefill, num_decode, attn, large)
            x = layer.o(attn)
            h = kern.add_rms_norm(x, residual, layer.ln2, layer.eps2)
            x = layer.down(kern.silu_and_mul(layer.gate_up(h)))
        return x

    def _split_prefill(self, prefill, offset: int):
        """Short segments for the decode kernel — ``(rows [Tk] in the sequence, block tables
        [Tk, W] int32, lengths [Tk] int32)`` with token ``j`` of a segment at ``start`` seeing
        ``start + j + 1`` keys, or ``None`` — and the indices of the other segments."""
        if not self.prefill_plan.kernel_pairs:  # the plan measured no kernel path (not the C kernels)
            return None, list(range(len(prefill.segments)))
        rows, tables, lens, large = [], [], [], []
        for i, (off, n, start) in enumerate(prefill.segments):
            if not self.prefill_plan.uses_kernel(n, start):
                large.append(i)
                continue
            rows.append(torch.arange(offset + off, offset + off + n))
            tables.append(prefill.block_tables[i].expand(n, -1))
            lens.append(torch.arange(start + 1, start + n + 1, dtype=torch.int32))
        if not rows:
            return None, large
        return (torch.cat(rows), torch.cat(tables).contiguous(), torch.cat(lens)), large

    def _prefill_attention(self, layer: int, q: torch.Tensor, prefill, offset: int, out: torch.Tensor,
                           which: list[int]) -> None:
        """Prefill segments ``which`` attend causally over their row's KV ``[0, start + n)``
        (already written to the cache this pass)."""
        d = self.head_dim
        for i in which:
            off, n, start = prefill.segments[i]
            k, v = self.cache.gather_row(layer, prefill.row_blocks(i), prefill.seq_lens[i])  # [kv_heads, L, D]
            qs = q[offset + off: offset + off + n].view(n, self.heads, d).transpose(0, 1)  # [heads, n, D]
            path = matmul_attention if self.prefill_plan.uses_matmul(n, start + n) else sdpa_attention
            o = path(qs, k, v, start, self.scale)
            out[offset + off: offset + off + n] = o.transpose(0, 1).reshape(n, self.heads * d)


def _bias(linear: torch.nn.Linear) -> torch.Tensor | None:
    return linear.bias.detach() if linear.bias is not None else None


def rope_table(rotary_emb, max_positions: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """``[max_positions, head_dim]`` float32: row ``p`` is ``(cos θ_p | sin θ_p)`` over the
    first half of the dimensions, from the model's own rotary module (so its rope type
    and attention scaling apply). Raises NotImplementedError for a layout whose two
    halves differ (an interleaved RoPE)."""
    positions = torch.arange(max_positions, device=device)[None]
    with torch.inference_mode():
        cos, sin = rotary_emb(torch.zeros(1, dtype=torch.float32, device=device), positions)
    cos, sin = cos[0].float(), sin[0].float()
    half = head_dim // 2
    if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
        raise NotImplementedError("the model's rotary embedding is not the half-split layout")
    return torch.cat([cos[:, :half], sin[:, :half]], dim=1).contiguous()
