"""Structured outputs in the engine: the compile cache, one matcher per row, and the
batch's token bitmask.

:class:`GrammarCache` compiles a :class:`~shared.constraints.Constraint` on its own
worker thread (never the tick thread), keyed by the constraint's hash, and hands the
scheduler a future; a request waits in ``_pending`` until its future is done. The
tokenizer that llguidance needs is built once (the engine builds it in its warm-up,
before serving; otherwise the first compile does).

Each constrained row owns a :class:`RowGrammar` (a copy of the compiled template
matcher) that is advanced with every token the row accepts. Per step,
:func:`fill_bitmask` writes the allowed tokens of every constrained row into one
``[rows, ceil(vocab / 32)]`` int32 bitmask and :func:`apply_bitmask` sets the logits of
every disallowed token to ``-inf`` in one masked fill (plain torch and numpy ops: any
float dtype, any device, no compile step). Rows without a constraint are not touched, and a batch
without one does none of this.
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch import Tensor

from shared.constraints import Constraint, ConstraintError, grammar_source

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A constraint that cannot be compiled; fails its request (``finish_reason`` error)."""


class GrammarCache:
    """Compiled template matchers by constraint hash, built on one worker thread.

    Args:
        load_tokenizer: returns the model's Hugging Face fast tokenizer; called once:
            by the engine's warm-up, or else by the first compile (on the worker thread).
        vocab_size: width of the model's logits (may exceed the tokenizer's vocabulary).
        eos_token_ids: the model's EOS ids; the grammar allows them once it accepts.
        max_entries: compiled grammars kept (least recently used dropped first).

    :meth:`get` is called on the tick thread and never blocks on a compile.
    """

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: list[int],
                 max_entries: int = 256):
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_entries = max_entries
        self._tokenizer = None
        self._tokenizer_error: Exception | None = None
        self._entries: collections.OrderedDict[str, Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.num_compiled = 0
        self.num_failed = 0
        self.compile_seconds: collections.deque[float] = collections.deque(maxlen=1024)

    def get(self, constraint: Constraint, on_done: Callable[[], None] | None = None) -> Future:
        """A future of the compiled template for ``constraint`` (done at once when
        cached). Its exception, if any, is a :class:`GrammarError`. ``on_done`` is
        called (on the worker thread) when a new compile finishes."""
        key = constraint.key
        with self._lock:
            fut = self._entries.get(key)
            if fut is not None:
                self._entries.move_to_end(key)
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
            fut = self._pool.submit(self._compile, constraint)
            self._entries[key] = fut
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        if on_done is not None:
            fut.add_done_callback(lambda _: on_done())
        return fut

    def _compile(self, constraint: Constraint):
        import time

        import llguidance

        t0 = time.perf_counter()
        try:
            tokenizer = self.tokenizer()
            matcher = llguidance.LLMatcher(tokenizer, grammar_source(constraint), log_level=0)
        except ConstraintError as exc:
            self._failed(constraint)
            raise GrammarError(str(exc)) from None
        except Exception as exc:  # a tokenizer that cannot load, a library error
            self._failed(constraint)
            raise GrammarError(f"cannot compile the constraint: {exc}") from None
        if matcher.is_error():
            self._failed(constraint)
            raise GrammarError(" ".join(matcher.get_error().split())[:500])
        self.num_compiled += 1
        self.compile_seconds.append(time.perf_counter() - t0)
        return matcher

    def _failed(self, constraint: Constraint) -> None:
        self.num_failed += 1
        with self._lock:  # a failure is not cached: the same text may be retried (it will fail again)
            self._entries.pop(constraint.key, None)

    def tokenizer(self):
        """llguidance's view of the model's tokenizer (built once, ~1 s). A tokenizer that
        cannot load raises its error now and at every later call (loaded once, not retried)."""
        if self._tokenizer is None:
            if self._tokenizer_error is not None:
                raise self._tokenizer_error
            import llguidance.hf

            try:
                hf = self._load_tokenizer()
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_ids or None)
            except Exception as exc:
                self._tokenizer_error = RuntimeError(f"the model's tokenizer does not load: {exc}")
                raise self._tokenizer_error from None
        return self._tokenizer

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict:
        times = sorted(self.compile_seconds)
        return {"grammars_cached": len(self._entries), "grammars_compiled": self.num_compiled,
                "grammars_failed": self.num_failed,
                "grammar_compile_p50_s": times[len(times) // 2] if times else None}


class RowGrammar:
    """One row's matcher: what its next token may be, advanced with each accepted token.

    ``masked_eos``: EOS ids kept out of the mask while the grammar could go on (the
    row's ``ignore_eos``: the output runs to ``max_tokens`` where the grammar allows); the
    row still ends with ``stop`` once the grammar is complete.
    """

    __slots__ = ("matcher", "masked_eos")

    def __init__(self, template, masked_eos: list[int] | None = None):
        self.matcher = template.deep_copy()
        self.masked_eos = list(masked_eos or [])

    def advance(self, token_id: int) -> bool:
        """Consume an accepted token; False if the grammar does not allow it."""
        return self.matcher.consume_token(token_id)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (but EOS)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (it may still be extended)."""
        return self.matcher.is_accepting()


def fill_bitmask(grammars: list[RowGrammar], vocab_size: int) -> Tensor:
    """The allowed next tokens of each row: ``[len(grammars), ceil(vocab_size / 32)]``
    int32 on the CPU, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed."""
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(grammars), words), -1, dtype=torch.int32)
    base, row_bytes = bitmask.data_ptr(), words * 4
    for i, g in enumerate(grammars):  # llguidance writes each row's mask in place (it drops the GIL)
        g.matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        if g.masked_eos and not g.finished:
            for t in g.masked_eos:
                if 0 <= t < vocab_size:
                    bitmask[i, t // 32] &= ~(1 << (t % 32))
    return bitmask


_SHIFTS: dict[torch.device, Tensor] = {}


def disallowed_mask(bitmask: Tensor, vocab_size: int, device: torch.device) -> Tensor:
    """``[n, vocab_size]`` bool on ``device``: True where ``bitmask`` forbids the token.

    On the CPU, numpy's ``unpackbits`` of the inverted words (one pass over bytes; the
    bool array is a zero-copy view of its 0/1 output); elsewhere, shifts and masks in
    torch on the device."""
    if device.type == "cpu":
        import numpy as np

        bits = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, count=vocab_size, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = bitmask.to(device, non_blocking=True)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).reshape(words.shape[0], -1)[:, :vocab_size]
    return bits == 0


def apply_bitmask(logits: Tensor, rows: list[int], bitmask: Tensor) -> None:
    """Set ``logits[rows[j], t]`` to ``-inf`` for every token ``t`` that ``bitmask[j]``
    does not allow, in place: one masked fill for all the rows.

    ``logits``: ``[batch, vocab]``, any float dtype; ``rows``: ``n`` distinct row indices
    in increasing order; ``bitmask``: ``[n, ceil(vocab / 32)]`` int32 on the CPU (from
    :func:`fill_bitmask`). No ``torch.compile`` (llguidance's own helper is compiled, and
    its first call took 57 s on the 2-core benchmark host).
    """
    vocab = logits.shape[1]
    forbidden = disallowed_mask(bitmask, vocab, logits.device)
    if len(rows) == logits.shape[0]:  # every row is constrained
        logits.masked_fill_(forbidden, float("-inf"))
        return
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[idx] = logits[idx].masked_fill(forbidden, float("-inf"))
