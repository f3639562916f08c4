"""Building an engine: the model on its device, the backend, the block pool sized for
the memory at hand, the policy and the scheduler; torch's threads; the warm-up pass.

Every function here runs before the engine serves (:func:`engine_proc.engine.start_engine`)
and in tools that drive a scheduler in-process.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from engine_proc.backends.base import Backend, pick_device, pick_dtype
from engine_proc.block_pool import BlockPool
from engine_proc.grammar import GrammarCache
from engine_proc.policy import make_policy
from engine_proc.scheduler import Scheduler
from engine_proc.core_lending import open_board
from engine_proc.threads import ThreadPlan, usable_cpus
from shared import config as cfg
from shared import placement, startup_faults

log = logging.getLogger("tickserve.engine")


def load_model(config: cfg.EngineConfig):
    """Load the causal LM on the configured device. Returns ``(model, model_dir)``; with
    low-bit weights (``--quantization``, :mod:`engine_proc.lowbit_model`) the model carries
    them as its ``tickserve_low_bit`` attribute, which :func:`make_backend` hands to the
    paged backend. Raises :class:`~shared.startup_faults.StartupFault` for files that
    cannot load."""
    from transformers import AutoModelForCausalLM

    from engine_proc import lowbit_model
    from engine_proc.backends.llama_runner import SUPPORTED_MODEL_TYPES
    from shared.models import LOW_BIT_ARCHITECTURES, gguf_architecture, gguf_source, has_weights, resolve_model

    model_dir = resolve_model(config.model)
    gguf = gguf_source(config.model)
    if gguf is not None and gguf_architecture(gguf) not in LOW_BIT_ARCHITECTURES:
        gguf = None  # transformers' de-quantized copy runs it
    packed_only = gguf is not None and not has_weights(model_dir)  # a Llama GGUF's entry
    startup_faults.check_model_dir(model_dir, weights=not packed_only, tokenizer=False)  # no tokenizer needed
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    with startup_faults.faults_of(gguf if packed_only else model_dir, tokenizer=False):
        low_bit = None
        if packed_only:
            from transformers import AutoConfig

            low_bit = lowbit_model.gguf_weights(model_dir, gguf, AutoConfig.from_pretrained(str(model_dir)))
            model = lowbit_model.model_from_packed(model_dir, low_bit, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        kind = lowbit_model.resolve_quantization(config.quantization, device, gguf,
                                                 model.config.model_type in SUPPORTED_MODEL_TYPES)
        if kind == "gguf" and low_bit is None:  # an entry that also holds the float32 copy
            low_bit = lowbit_model.gguf_weights(model_dir, gguf, model.config)
        elif kind in ("int8", "int4"):
            low_bit = lowbit_model.quantize_model(model, kind)
        setattr(model, lowbit_model.LOW_BIT_ATTR, low_bit if kind != "none" else None)
    return model.to(device).eval(), model_dir


def eos_ids_of(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def build_scheduler(config: cfg.EngineConfig, model, on_left_pending=None) -> Scheduler:
    """Backend, block pool, policy and scheduler for ``model`` as ``config`` says.

    Raises ``NotImplementedError`` for a prefill mode that is not built yet.
    """
    max_len = min(config.max_model_len, getattr(model.config, "max_position_embeddings", config.max_model_len))
    if config.kv_num_blocks == 0:  # enough for a full batch at full context, within the memory cap
        blocks = config.resolved_num_blocks
        if config.kv_memory_fraction > 0:
            blocks = min(blocks, blocks_for_memory(model, config.kv_block_size, config.kv_memory_fraction))
        config = dataclasses.replace(config, kv_num_blocks=blocks)
    prefix_caching = config.backend == cfg.BackendName.PAGED.value and config.prefix_caching
    pool = BlockPool(config.resolved_num_blocks, config.kv_block_size, enable_prefix_caching=prefix_caching)
    backend = make_backend(config, model, max_len, pool)
    policy = make_policy(config.policy, prompt_weight=config.fair_prompt_weight,
                         output_weight=config.fair_output_weight)
    eos = eos_ids_of(model)
    return Scheduler(config, backend, policy, pool, eos,
                     prefix_caching=prefix_caching, on_left_pending=on_left_pending,
                     grammars=GrammarCache(lambda: load_tokenizer(config.model), backend.vocab_size, eos))


def load_tokenizer(model: str):
    """The model's Hugging Face tokenizer (structured outputs need it; loaded at the first
    constrained request, on the grammar compiler's thread)."""
    from transformers import AutoTokenizer

    from shared.models import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(model)))


def kv_bytes_per_block(model, block_size: int) -> int:
    """Bytes of K and V for one block: 2 · layers · kv_heads · head_dim · block_size · dtype size."""
    c = model.config
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    elem = next(model.parameters()).element_size()
    return 2 * c.num_hidden_layers * kv_heads * head_dim * block_size * elem


def available_memory_bytes(device: torch.device) -> int:
    """Free accelerator memory (CUDA), else MemAvailable from /proc/meminfo (bytes; 4 GiB where
    there is none)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    host = placement.available_memory_bytes()
    return 4 << 30 if host is None else host


def blocks_for_memory(model, block_size: int, fraction: float) -> int:
    """KV blocks that fit in ``fraction`` of the memory available now (at least 1)."""
    device = next(model.parameters()).device
    return max(1, int(available_memory_bytes(device) * fraction) // kv_bytes_per_block(model, block_size))


def make_backend(config: cfg.EngineConfig, model, max_model_len: int, pool: BlockPool) -> Backend:
    """The configured backend; the paged one keeps its KV in ``pool``'s blocks."""
    if config.backend == cfg.BackendName.HF.value:
        from engine_proc.backends.hf import HFBackend

        return HFBackend(model, max_model_len)
    from engine_proc.backends.paged import PagedBackend

    from engine_proc.lowbit_model import LOW_BIT_ATTR

    board = open_board(config.core_board, config.core_board_slot) if config.lend_idle_cores else None
    if board is not None:
        board.pin_home(usable_cpus())
    threads = ThreadPlan(config.torch_threads or usable_cpus(), config.single_thread_below, board=board)
    return PagedBackend(model, max_model_len, pool, kernels=config.kernels, threads=threads,
                        kv_prefault=config.kv_prefault,
                        low_bit=getattr(model, LOW_BIT_ATTR, None))


def configure_torch(config: cfg.EngineConfig) -> None:
    torch.set_num_threads(config.torch_threads or usable_cpus())
    torch.manual_seed(config.seed)



def warm_up(scheduler: Scheduler) -> None:
    """One short prefill and two decode steps through the backend before any frontend can
    connect: kernels are built and first-call costs paid, so the engine that says hello
    (and makes /health 200) serves its first request at speed. The grammar compiler's
    tokenizer is built here too: built while serving, it would hold the GIL long enough
    to delay the engine's heartbeats, and a first constrained request's TTFT."""
    if scheduler.grammars is not None:  # structured outputs' tokenizer (~1 s, holds the GIL): not mid-serving
        try:
            scheduler.grammars.tokenizer()
        except Exception as exc:  # noqa: BLE001 - a model without a (fast) tokenizer still serves text
            log.warning("structured outputs unavailable: the tokenizer does not load (%s); constrained "
                        "requests will fail", exc)
    pool, backend, row = scheduler.block_pool, scheduler.backend, "__warm_up__"
    ids = [1] * 8
    pool.allocate(row, [], len(ids) + 2)
    try:
        backend.prefill_chunk(row, ids, 0, True)
        backend.promote(row)
        for step in range(2):
            backend.decode_step_batched([row], [1], [len(ids) + step])
    finally:
        backend.release(row)
        pool.free(row)
