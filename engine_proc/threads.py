"""How many intra-op threads each forward pass runs on (CPU).

On a machine with few cores, the engine's OpenMP threads share them with the frontend,
the engine's I/O thread and often the clients. A parallel region waits for its slowest
thread, so a core taken away for a millisecond stalls every thread of the pass: for a
small pass (a few decode rows), one thread finishes sooner end to end than all of them
(measured with ``tools/bench_compare.py``: at one stream on 2 cores, 1 thread gave 1.5×
the tokens/s of 2). A large pass (a full decode batch, a prefill chunk) is long enough
that the extra cores win. :class:`ThreadPlan` picks per pass by its token count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass
class ThreadPlan:
    """``max_threads`` for passes of at least ``single_thread_below`` tokens, one thread
    below that (0: always ``max_threads``). With a ``board``
    (:class:`~engine_proc.core_lending.CoreBoard`), a pass of fewer than ``lend_below``
    tokens also takes ``max_threads`` more threads for every idle sibling engine (at most
    ``board.cpus`` in all). :meth:`apply` sets torch's thread count and that of every
    kernel object in ``kernels`` (their ``num_threads``) before a pass, only when it
    changes."""

    max_threads: int
    single_thread_below: int = 0
    kernels: list = field(default_factory=list)
    board: object | None = None
    lend_below: int = 0
    _current: int = 0

    def threads_for(self, num_tokens: int) -> int:
        if self.board is not None and num_tokens < self.lend_below:
            idle = self.board.idle_siblings()
            if idle:
                return min(self.board.cpus, self.max_threads * (1 + idle))
        if self.max_threads > 1 and num_tokens < self.single_thread_below:
            return 1
        return self.max_threads

    def apply(self, num_tokens: int) -> int:
        threads = self.threads_for(num_tokens)
        if threads != self._current:
            torch.set_num_threads(threads)
            for kernels in self.kernels:
                if hasattr(kernels, "num_threads"):
                    kernels.num_threads = threads
            self._current = threads
        return threads
