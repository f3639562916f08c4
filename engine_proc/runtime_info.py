"""The engine's runtime record: what actually runs (model, device, dtype, threads,
backend, prefill mode, policy, transport, kernels, KV blocks).

One :class:`~shared.protocol.RuntimeInfo` per engine, read off the built scheduler once
at start-up; the engine's start-up line, its ``Welcome`` (hence the frontend's
``/version``) and every ``Stats`` (``/scheduler/stats``, the dashboard) all carry this
same record.
"""

from __future__ import annotations

import torch

from engine_proc.scheduler import Scheduler
from shared import config as cfg
from shared import protocol as p


def runtime_info(config: cfg.EngineConfig, scheduler: Scheduler, model_dir: str = "") -> p.RuntimeInfo:
    """The engine's :class:`~shared.protocol.RuntimeInfo`, read off what actually runs."""
    backend = scheduler.backend
    dtype = next(backend.model.parameters()).dtype if hasattr(backend, "model") else None
    from shared.models import model_fingerprint

    schemes = sorted({addr.split("://", 1)[0] for addr in (config.resolved_input_addr, config.resolved_output_addr)})
    return p.RuntimeInfo(
        model=str(model_dir or config.model), device=str(backend.device),
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else "unknown",
        torch_threads=backend.threads.max_threads if getattr(backend, "threads", None) else torch.get_num_threads(),
        backend=config.backend,
        prefill_mode=scheduler.prefill_mode.value, policy=config.policy,
        transport=("shm+" if config.transport != "zmq" and config.run_dir else "") + "zmq " + "+".join(schemes),
        model_fingerprint=model_fingerprint(model_dir) if model_dir else "",
        kernels=_kernels_of(backend),
        model_runner=getattr(backend, "model_runner", "transformers"),
        single_thread_below=backend.threads.single_thread_below if getattr(backend, "threads", None) else 0,
        **_lending_of(backend),
        kv_block_size=scheduler.block_pool.block_size, kv_num_blocks=scheduler.block_pool.num_blocks,
        weights=getattr(backend, "weights_precision", "") or (str(dtype).removeprefix("torch.") if dtype else ""),
        matmul=getattr(backend, "matmul_plan", ""), role=config.role)


def _kernels_of(backend) -> str:
    """``c (attention amx-bf16)``, ``torch``, or "" (no paged kernels)."""
    kernels = getattr(backend, "kernels", None)
    return getattr(kernels, "description", None) or getattr(kernels, "name", "")


def _lending_of(backend) -> dict:
    """``lent_threads`` / ``lend_below`` of the thread plan (engine_proc/core_lending.py); zeros without a board."""
    plan = getattr(backend, "threads", None)
    board = getattr(plan, "board", None)
    if board is None or not plan.lend_below:
        return {}
    most = min(board.cpus, plan.max_threads * board.engines)
    return {"lent_threads": max(0, most - plan.max_threads), "lend_below": plan.lend_below}
