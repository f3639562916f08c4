"""Loading a model whose projections run in low-bit form (``--quantization``).

``auto``, the default, keeps a Llama GGUF's own low-bit weights (Q4_0 / Q4_1 / Q8_0 as
they are, other quantized types re-quantized to Q8_0: :mod:`engine_proc.gguf_weights`) and
runs a Hugging Face checkpoint as it is; ``int8`` / ``int4`` quantize a checkpoint's (or a
GGUF's de-quantized) projections to Q8_0 / Q4_1 with the ``gguf`` package's reference
quantizer (the LM head to Q8_0 in both); ``none`` runs the de-quantized weights in the
model dtype. On CUDA and MPS ``auto`` is ``none`` (the low-bit kernel is a CPU kernel).

A Llama GGUF's cache entry holds no float weights (:mod:`shared.models`): the engine
builds the transformers model from its ``config.json`` and fills it from the packed
weights, de-quantized to the model dtype — the numbers transformers' own GGUF loader
gives, exactly — so the dense path (``none``, the large passes a measured crossover may
give it, the transformers fallback) is always there. The packed layout of a GGUF is made
once and kept in its entry as ``lowbit.tickserve`` (a safetensors file of ``uint8`` tiles and the float norms,
with the formats in the file's metadata); later starts map it instead of repacking.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from engine_proc import quant
from engine_proc.gguf_weights import GGUFWeights, read as read_gguf
from shared.models import LOW_BIT_FILE as CACHE_FILE
from shared.models import OLD_LOW_BIT_FILE

log = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "none", "int8", "int4")
LOW_BIT_ATTR = "tickserve_low_bit"
"""The model attribute :func:`engine_proc.factory.load_model` leaves the packed weights in
(a :class:`~engine_proc.gguf_weights.GGUFWeights`), so every backend built on the model —
the engine's and the tools' — runs what the engine runs."""
CACHE_VERSION = "1"
_PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def resolve_quantization(requested: str, device: torch.device, gguf: Path | None, runs_lean: bool) -> str:
    """What ``--quantization`` means here: ``gguf`` (the file's own types), ``int8``,
    ``int4`` or ``none``. Low-bit needs a CPU and the lean Llama runner."""
    if requested == "none" or device.type != "cpu" or not runs_lean:
        return "none"
    if requested == "auto":
        return "gguf" if gguf is not None else "none"
    return requested


# ------------------------------------------------------------------ the packed cache

def save(weights: GGUFWeights, path: Path) -> None:
    """Write ``weights`` as one safetensors file (see the module doc)."""
    from safetensors.torch import save_file

    tensors, meta = {}, {}

    def put(key: str, w: quant.PackedWeight | None) -> None:
        if w is not None:
            tensors[key] = w.data
            meta[key] = [int(w.fmt), w.out_features, w.in_features, w.source]

    for (i, name), w in weights.layers.items():
        put(f"layers.{i}.{name}", w)
    put("embed", weights.embed)
    if weights.lm_head is not weights.embed:
        put("lm_head", weights.lm_head)
    for name, array in weights.floats.items():
        tensors[f"float.{name}"] = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    save_file(tensors, str(path), metadata={"tickserve_lowbit": CACHE_VERSION, "packed": json.dumps(meta),
                                            "types": json.dumps(weights.types),
                                            "tied": json.dumps(weights.lm_head is weights.embed)})
    path.chmod(0o644)  # as the rest of the entry: other users of a shared cache read it


def load(path: Path) -> GGUFWeights:
    """Read a file :func:`save` wrote. Raises ``ValueError`` for one of another version."""
    from safetensors import safe_open

    out = GGUFWeights()
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("tickserve_lowbit") != CACHE_VERSION:
            raise ValueError(f"{path} is not a version-{CACHE_VERSION} low-bit cache file")
        packed = json.loads(meta["packed"])
        for key in f.keys():
            tensor = f.get_tensor(key)
            if key.startswith("float."):
                out.floats[key[len("float."):]] = tensor.numpy()
                continue
            fmt, n, k, source = packed[key]
            w = quant.PackedWeight(quant.QuantFormat(fmt), n, k, tensor, source)
            if key == "embed":
                out.embed = w
            elif key == "lm_head":
                out.lm_head = w
            else:
                _, i, name = key.split(".")
                out.layers[(int(i), name)] = w
        if json.loads(meta.get("tied", "false")):
            out.lm_head = out.embed
        out.types = json.loads(meta.get("types", "{}"))
    return out


def gguf_weights(entry: Path, gguf: Path, config) -> GGUFWeights:
    """The packed weights of ``gguf``, from its cache entry's :data:`CACHE_FILE` (made from
    the file the first time, under the entry's lock)."""
    from shared import model_cache

    try:
        (entry / OLD_LOW_BIT_FILE).unlink(missing_ok=True)  # where vLLM would try to load it
    except OSError:
        pass
    cached = entry / CACHE_FILE
    if cached.exists():
        try:
            return load(cached)
        except (ValueError, OSError, KeyError) as exc:
            log.warning("%s cannot be read (%s); packing the weights again", cached, exc)
            cached.unlink(missing_ok=True)
    made: list[GGUFWeights] = []

    def pack(tmp: Path) -> None:  # under the entry's lock: a second engine waits, then loads the file
        log.info("packing %s's low-bit weights (once per model; kept in %s)", gguf.name, cached)
        made.append(read_gguf(gguf, config))
        save(made[0], tmp / CACHE_FILE)

    model_cache.add_files(entry, pack, (CACHE_FILE,))
    return made[0] if made else load(cached)


# ------------------------------------------------------------------ the model

def model_from_packed(model_dir: Path, weights: GGUFWeights, dtype: torch.dtype):
    """The transformers model of ``model_dir``'s config with every weight taken from
    ``weights`` (packed ones de-quantized to ``dtype``). Raises ``ValueError`` when a weight
    the model has is missing."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {name: torch.from_numpy(np.asarray(a, dtype=np.float32)).to(dtype) for name, a in weights.floats.items()}
    for (i, name), w in weights.layers.items():
        state[f"model.layers.{i}.{_PROJ[name]}.{name}.weight"] = quant.dequantize(w).to(dtype)
    if weights.embed is not None:
        state["model.embed_tokens.weight"] = quant.dequantize(weights.embed).to(dtype)
    if weights.lm_head is not None and weights.lm_head is not weights.embed:
        state["lm_head.weight"] = quant.dequantize(weights.lm_head).to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in state:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"{model_dir}: no weights for {', '.join(missing[:4])}" + (" …" if len(missing) > 4 else ""))
    return model.eval()


def quantize_model(model, kind: str) -> GGUFWeights:
    """Packed ``kind`` (``int8``: Q8_0 everywhere; ``int4``: Q4_1 projections, a Q8_0 LM
    head) copies of ``model``'s projections and LM head, quantized with the ``gguf``
    package's reference quantizer. Raises ``ValueError`` for a shape the kernel cannot take."""
    proj = "Q8_0" if kind == "int8" else "Q4_1"
    out = GGUFWeights(kind=kind)
    for i, layer in enumerate(model.model.layers):
        for name, parent in _PROJ.items():
            w = quant.quantize(getattr(getattr(layer, parent), name).weight, proj)
            out.layers[(i, name)] = w
            out.types[w.source] = out.types.get(w.source, 0) + 1
    out.lm_head = quant.quantize(model.lm_head.weight, "Q8_0")
    out.types["Q8_0"] = out.types.get("Q8_0", 0) + 1
    return out
