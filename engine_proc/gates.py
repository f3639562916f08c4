"""Checks that depend only on configuration: they can run in the engine's I/O thread
(before the ack, so a request that can never fit gets its 429 before any SSE byte)
and again in ``_admit_pending``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import EngineConfig
from shared.protocol import RejectCode, RejectReason


@dataclass(frozen=True)
class Limits:
    max_model_len: int  # tokens
    kv_budget_tokens: int  # gate 2 capacity, tokens
    num_blocks: int  # gate 3 capacity, blocks
    block_size: int  # tokens per block
    vocab_size: int

    @classmethod
    def from_config(cls, config: EngineConfig, max_model_len: int, vocab_size: int) -> "Limits":
        return cls(max_model_len, config.resolved_kv_budget_tokens, config.resolved_num_blocks,
                   config.kv_block_size, vocab_size)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def never_fits(limits: Limits, prompt_len: int, max_tokens: int) -> RejectReason | None:
    """The reason a request can never run, or ``None``.

    Context length first (a client mistake, HTTP 400), then gate 2's and gate 3's
    hard-reject (HTTP 429: the request is valid, this engine is too small for it).
    """
    total = prompt_len + max_tokens
    if total > limits.max_model_len:
        return RejectReason(
            RejectCode.CONTEXT_LENGTH,
            f"this model's maximum context length is {limits.max_model_len} tokens; the request "
            f"asks for {total} ({prompt_len} in the prompt, {max_tokens} to generate)",
            total, limits.max_model_len)
    if total > limits.kv_budget_tokens:
        return RejectReason(
            RejectCode.KV_BUDGET,
            f"request needs {total} KV tokens (prompt + max_tokens); the active-KV budget is "
            f"{limits.kv_budget_tokens}, so it can never be admitted", total, limits.kv_budget_tokens,
            retryable=False)
    blocks = limits.blocks_for(total)
    if blocks > limits.num_blocks:
        return RejectReason(
            RejectCode.BLOCK_POOL,
            f"request needs {blocks} KV blocks of {limits.block_size} tokens; the pool has "
            f"{limits.num_blocks}, so it can never be admitted", blocks, limits.num_blocks, retryable=False)
    return None


def capacity_problems(config: EngineConfig, max_model_len: int, num_blocks: int | None = None) -> list[str]:
    """Why no request at the full context could ever be admitted with this KV pool, as
    one-line problems naming the flag and its minimum (empty when it can).

    ``max_model_len``: the effective context window in tokens (the flag capped by the
    model's own); ``num_blocks``: the pool's blocks after the memory cap (default: the
    configured ``kv_num_blocks``, whose 0 means "derived" and is not checked). The rule is
    vLLM's: the pool must hold one sequence of ``max_model_len`` tokens, or every request
    that omits ``max_tokens`` is refused as "can never be admitted"."""
    blocks = config.kv_num_blocks if num_blocks is None else num_blocks
    need = -(-max_model_len // config.kv_block_size)
    if blocks <= 0 or blocks >= need:
        return []
    where = f"--kv-num-blocks {blocks}" if num_blocks is None else \
        f"the KV pool that fits in --kv-memory-fraction {config.kv_memory_fraction} ({blocks} blocks)"
    return [f"{where} holds {blocks * config.kv_block_size} "
            f"tokens, less than one request at the full context (--max-model-len {max_model_len}): "
            f"it needs at least {need} blocks of {config.kv_block_size} tokens, or a smaller --max-model-len"]
