"""The backend interface: what the scheduler asks of a model runner.

A backend holds the model and the KV cache of every row (a request that is
prefilling or decoding). Rows are named by request id. The scheduler owns *which*
rows run and their positions; the backend owns the tensors.

Lifecycle of a row::

    prefill_chunk(...) × k      KV for prompt positions [0, prompt_len)
    promote(row)                the row joins the decode batch (_promote_to_decode)
    decode_step_batched(...) × m

(``prefill_chunks`` packs several rows' chunks into one pass; ``mixed_step`` runs a
decode step and prefill chunks in one pass. Both are optional, see ``packs_*``.)
    release(row)                from any state, idempotent
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens ``token_ids`` of row ``row_id`` at positions ``[start_pos, start_pos + n)``."""

    row_id: str
    token_ids: Sequence[int]
    start_pos: int
    compute_logits: bool  # the chunk ends the prompt: its last token's logits are needed
    all_logits: bool = False  # every position's logits are needed (prompt logprobs)


class Backend(ABC):
    """Model runner interface. All methods are called from the tick thread only."""

    device: torch.device
    vocab_size: int
    max_model_len: int  # tokens

    @abstractmethod
    def prefill_chunk(self, row_id: str, token_ids: Sequence[int], start_pos: int,
                      compute_logits: bool, all_logits: bool = False) -> torch.Tensor | None:
        """Run prompt tokens ``token_ids`` at positions ``[start_pos, start_pos + n)``
        through the model, storing their KV for ``row_id``.

        The row's KV must already cover exactly ``start_pos`` tokens (earlier chunks
        or prefix-cache hits). Returns the logits of the last token, shape ``[vocab]``
        float32, when ``compute_logits``; else ``None``. With ``all_logits``, the logits
        of every position instead, shape ``[n, vocab]`` float32 (for prompt logprobs).
        """

    packs_prefill: bool = False
    """Whether :meth:`prefill_chunks` runs several rows' chunks in one forward pass."""

    def prefill_chunks(self, chunks: Sequence[PrefillChunk]) -> list[torch.Tensor | None]:
        """Several rows' chunks (each row at most once) in one forward pass, for a backend
        with ``packs_prefill``. Returns, per chunk, what :meth:`prefill_chunk` would.
        All or nothing: if it raises, no row's state has advanced."""
        raise NotImplementedError(f"{type(self).__name__} does not pack prefills")

    packs_mixed: bool = False
    """Whether :meth:`mixed_step` runs decode rows and prefill chunks in one forward pass."""

    pairs_per_token: float | None = None
    """How many query-key pairs of attention cost as much as one token's pass through the
    linear layers (``2 · linear weights per layer`` FLOPs against ``4 · heads · head_dim``
    per pair); ``None`` where unknown. ``mixed_batch`` charges a prompt chunk its
    attention with it (see :func:`prompt_chunk_cost`)."""

    def mixed_step(self, row_ids: Sequence[str], token_ids: Sequence[int], positions: Sequence[int],
                   chunks: Sequence[PrefillChunk]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """:meth:`decode_step_batched` and :meth:`prefill_chunks` in one forward pass, for
        a backend with ``packs_mixed`` (``PREFILL_MODE=mixed_batch``). Returns
        ``(decode logits [batch, vocab], per-chunk logits or None)``. All or nothing."""
        raise NotImplementedError(f"{type(self).__name__} does not mix decode and prefill in one pass")

    @abstractmethod
    def promote(self, row_id: str) -> None:
        """Move a fully prefilled row into the decode batch (appended last)."""

    @abstractmethod
    def decode_step_batched(self, row_ids: Sequence[str], token_ids: Sequence[int],
                            positions: Sequence[int]) -> torch.Tensor:
        """One forward pass for every decoding row: feed ``token_ids[i]`` at position
        ``positions[i]`` to row ``row_ids[i]``.

        ``row_ids`` must be exactly the promoted, unreleased rows, in promote order.
        Returns next-token logits ``[batch, vocab]`` float32, in ``row_ids`` order.
        """

    @abstractmethod
    def release(self, row_id: str) -> None:
        """Drop a row's KV (prefilling or decoding). Unknown rows are ignored."""

    @abstractmethod
    def kv_length(self) -> int:
        """Backend-specific KV length in tokens (the HF backend's padded width; the
        paged backend's longest row). Report it; never size scheduler state from it."""


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` → CUDA if available, else MPS, else CPU."""
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively: AMX or AVX-512 BF16 on x86
    (asked of torch), the ``bf16`` feature on Arm. Without it, oneDNN emulates bfloat16
    through float32 and it is slower than float32 itself."""
    import platform

    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        fn = getattr(torch.cpu, probe, None)
        if fn is not None and fn():
            return True
    if platform.machine().lower() in ("aarch64", "arm64"):
        try:
            with open("/proc/cpuinfo") as fh:
                return any(line.startswith("Features") and " bf16" in line for line in fh)
        except OSError:
            return False
    return False


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` → bfloat16 on CUDA and on a CPU that runs it natively
    (:func:`cpu_has_native_bf16`), float32 elsewhere (MPS included). bfloat16 matches
    float32 closely on the default model (``tools/bench_accuracy.py``). Raises
    ``ValueError`` for an unknown name."""
    if name == "auto":
        if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def prompt_chunk_cost(start: int, n: int, pairs_per_token: float | None) -> float:
    """Cost in token-equivalents of prompt tokens ``[start, start + n)``: ``n`` for their
    linear layers plus their causal attention's ``n · (start + n / 2)`` query-key pairs
    over ``pairs_per_token`` (0 when that is ``None``)."""
    return n + (n * (start + n / 2) / pairs_per_token if pairs_per_token else 0.0)


def affordable_prompt_tokens(start: int, budget: float, pairs_per_token: float | None) -> int:
    """The most prompt tokens from position ``start`` whose :func:`prompt_chunk_cost`
    fits ``budget`` (``n²/2k + n(1 + start/k) ≤ budget``, the positive root), at least 1
    when ``budget ≥ 1``; 0 for a smaller budget."""
    if budget < 1:
        return 0
    if not pairs_per_token:
        return int(budget)
    a, b = 1 / (2 * pairs_per_token), 1 + start / pairs_per_token
    return max(1, int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a)))
