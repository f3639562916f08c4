"""The scheduler's state: the three queues, the request index and the reservation
accounting (part of :class:`~engine_proc.scheduler.Scheduler`).

Every request is in exactly one of ``_pending`` (ordered by the policy),
``_prefilling`` and ``_active``, and in the index ``_requests`` until it is released.
The ways in are :meth:`add_request`; the ways out all end in :meth:`_release`, the single
release path (queues, backend row, blocks, reservation, policy hook). The load-bearing
invariant: ``_active_kv_reserved`` is the sum of ``prompt_len + max_tokens`` over every
admitted row: admit adds, every exit subtracts (:meth:`check_invariants`).
"""

from __future__ import annotations

import collections
from concurrent.futures import Future
from typing import Callable

from engine_proc.backends.base import Backend
from engine_proc.block_pool import BlockPool
from engine_proc.gates import Limits
from engine_proc.grammar import GrammarCache
from engine_proc.outputs import OutputBuffer
from engine_proc.policy import SchedulingPolicy
from engine_proc.request import Request, RequestStatus
from engine_proc.sampler import RowSamplingState, Sampler
from shared.config import EngineConfig, EngineRole, PrefillMode
from shared.protocol import RequestOutput


PREFILL_ROLE_TOKENS = 2048
"""Prompt tokens a prefill-role engine computes per tick at least (``PREFILL_CHUNK_SIZE``
if larger; 0: whole prompts): no stream waits on its ticks, so a chunk only bounds how
long a short prompt waits behind a long one, and smaller chunks cost the long one's TTFT."""


class SchedulerState:
    """The queues, the settings (the card's ``MAX_*``), the gate counters and the
    accounting of :class:`~engine_proc.scheduler.Scheduler`; its entry points and exits.

    Not thread-safe: only the tick thread calls it (the engine's I/O thread talks to
    it through queues).
    """

    def __init__(self, config: EngineConfig, backend: Backend, policy: SchedulingPolicy,
                 block_pool: BlockPool, eos_token_ids: list[int], sampler: Sampler | None = None,
                 prefix_caching: bool = False,
                 on_left_pending: Callable[[Request], None] | None = None,
                 grammars: GrammarCache | None = None):
        mode = config.resolved_prefill_mode
        if mode is PrefillMode.DISAGGREGATED and config.role == EngineRole.MONOLITHIC.value:
            raise NotImplementedError("PREFILL_MODE=disaggregated needs an engine role, prefill or decode")
        if mode is PrefillMode.DISAGGREGATED and not hasattr(backend, "cache"):
            raise NotImplementedError(f"PREFILL_MODE=disaggregated needs the paged backend (its KV blocks are "
                                      f"what is handed over); {type(backend).__name__} has none")
        if mode is PrefillMode.MIXED_BATCH and not backend.packs_mixed:
            raise NotImplementedError(f"PREFILL_MODE=mixed_batch needs a backend that mixes decode rows and "
                                      f"prefill chunks in one pass (paged); {type(backend).__name__} does not")
        self.config = config
        self.prefill_mode = mode
        self.chunk_size = config.prefill_chunk_size if mode is PrefillMode.CHUNKED else 0
        if mode is PrefillMode.DISAGGREGATED:  # a prefill engine has no decode batch to keep steady
            self.chunk_size = max(config.prefill_chunk_size, PREFILL_ROLE_TOKENS) if config.prefill_chunk_size \
                else backend.max_model_len
        # mixed_batch: tokens of one tick's pass, decode rows first (vLLM's max_num_batched_tokens)
        self.token_budget = config.resolved_max_num_batched_tokens if mode is PrefillMode.MIXED_BATCH else 0
        if mode is PrefillMode.MIXED_BATCH and self.token_budget <= config.max_batch_size:
            raise ValueError(f"max_num_batched_tokens ({self.token_budget}) must exceed max_batch_size "
                             f"({config.max_batch_size})")
        self.backend = backend
        self.policy = policy
        self.block_pool = block_pool
        kernels = getattr(backend, "kernels", None)
        self.sampler = sampler or Sampler(argmax=kernels.argmax if kernels is not None else None)
        self.eos_token_ids = list(eos_token_ids)
        self.prefix_caching = prefix_caching
        self.max_batch_size = config.max_batch_size
        self.kv_budget_tokens = config.resolved_kv_budget_tokens
        self.limits = Limits.from_config(config, backend.max_model_len, backend.vocab_size)
        self.on_left_pending = on_left_pending or (lambda req: None)  # called as a request leaves _pending
        self.grammars = grammars  # structured outputs' compile cache (engine_proc.constrained)
        self.on_grammar_ready: Callable[[], None] = lambda: None  # a compile finished (worker thread)

        self._pending = policy  # ordered by the policy; see SchedulingPolicy
        self._awaiting_grammar: dict[Request, Future] = {}  # also _pending: its grammar is compiling
        self._prefilling: collections.deque[Request] = collections.deque()
        self._active: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._sampling: dict[str, RowSamplingState] = {}
        self._active_kv_reserved = 0  # Σ (prompt_len + max_tokens) over admitted rows
        self._arrival_seq = 0
        self._out = OutputBuffer()

        self.kv_admit_blocked = 0
        self.num_generated_tokens = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.rejected_by_code: dict[str, int] = {}  # hard rejects at admission, by reason
        self.num_ticks = 0
        self._init_handovers()

    # ------------------------------------------------------------------ entry points

    def add_request(self, req: Request) -> None:
        """Put an accepted request into ``_pending``. Raises ``ValueError`` for the id of a
        request still in the engine (one that finished this tick and waits for its
        eviction is evicted now: its id was already free to its client)."""
        old = self._requests.get(req.request_id)
        if old is not None and old.status.is_finished and old in self._active:
            self._release(old)
        elif old is not None:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.arrival_seq = self._arrival_seq
        self._arrival_seq += 1
        req.status = RequestStatus.WAITING
        wait = self._wait_for_grammar(req)  # ValueError: constrained, but no compiler
        self._requests[req.request_id] = req
        if not wait:
            self.policy.on_request_arrived(req)

    def abort_request(self, request_id: str) -> bool:
        """Abort from whichever queue holds the request; False if unknown or done."""
        req = self._requests.get(request_id)
        if req is None:
            if self.abort_held(request_id):
                return True
            if self.role is EngineRole.DECODE:  # it may be on its way here: refuse it when it comes
                self.tombstone(request_id)
            return False
        self.cancel_handing(request_id)
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def abort_frontend(self, frontend_id: str) -> int:
        """Abort every request of a departed frontend; returns how many."""
        doomed = [r.request_id for r in list(self._requests.values()) + self.held_requests()
                  if r.frontend_id == frontend_id]
        for rid in doomed:
            self.abort_request(rid)
        return len(doomed)

    def has_work(self) -> bool:
        return bool(self._requests) or bool(self._held)

    def only_compiling(self) -> bool:
        """Every request waits for a grammar still compiling: a tick would do nothing."""
        return self._grammar_waiting_only()

    def drain_outputs(self) -> list[tuple[str, RequestOutput]]:
        """Outputs produced since the last drain (aborts between ticks included)."""
        return self._out.drain()

    def requests(self) -> list[Request]:
        """Every request in the engine (any queue, finished rows not yet evicted included)."""
        return list(self._requests.values()) + self.held_requests()

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is still in the engine (not yet released)."""
        return request_id in self._requests

    # ------------------------------------------------------------------ exits

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """End ``req`` with ``status`` from whichever queue holds it."""
        if req.status is RequestStatus.WAITING:
            if self._awaiting_grammar.pop(req, None) is None:
                self._pending.remove(req)
            self.on_left_pending(req)
        if not req.status.is_finished:
            req.status = status
            self._out.finish(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        """The single release path: queues, backend row, blocks, reservation, policy."""
        if req.status is RequestStatus.FINISHED_ABORTED:
            self.num_aborted += 1
        elif req.status.is_finished:
            self.num_finished += 1
        # else: handed over to a decode engine (the only exit of an unfinished row)
        if req in self._active:
            self._active.remove(req)
        elif req in self._prefilling:
            self._prefilling.remove(req)
        self.backend.release(req.request_id)
        self.block_pool.free(req.request_id)
        self._active_kv_reserved -= req.kv_reserved
        req.kv_reserved = 0
        self._sampling.pop(req.request_id, None)
        self.policy.on_request_finished(req)
        del self._requests[req.request_id]

    # ------------------------------------------------------------------ introspection

    @property
    def active_kv_reserved(self) -> int:
        return self._active_kv_reserved

    @property
    def batch_size(self) -> int:
        """Rows in the decode batch (``_active``)."""
        return len(self._active)

    def check_invariants(self) -> None:
        """Raise AssertionError if the card's invariants do not hold."""
        pending = list(self._pending) + list(self._awaiting_grammar)
        queues = pending + list(self._prefilling) + self._active
        assert len(queues) == len({id(r) for r in queues}), "a request is in two queues"
        finished_active = [r for r in self._active if r.status.is_finished]
        assert {r.request_id for r in queues} == set(self._requests), "queues and index disagree"
        assert all(r.status is RequestStatus.WAITING for r in pending)
        assert all(r.status is RequestStatus.PREFILLING for r in self._prefilling)
        assert all(r.status is RequestStatus.RUNNING for r in self._active if r not in finished_active)
        admitted = list(self._prefilling) + self._active
        assert self._active_kv_reserved == sum(r.kv_reserved for r in admitted), "reservation drift"
        assert all(r.kv_reserved == r.max_total_tokens for r in admitted)
        assert all(r.kv_reserved == 0 for r in pending)
        assert len(admitted) <= self.max_batch_size
        assert self.block_pool.num_used_blocks <= sum(
            self.block_pool.blocks_needed(r.max_total_tokens) for r in admitted), "leaked blocks"
        self.block_pool.check_invariants()

    def stats(self) -> dict:
        pool = self.block_pool
        return {
            "prefill_mode": self.prefill_mode.value,
            "max_num_batched_tokens": self.token_budget or None,  # mixed_batch only
            "num_pending": len(self._pending) + len(self._awaiting_grammar),
            "num_awaiting_grammar": len(self._awaiting_grammar),
            "num_prefilling": len(self._prefilling),
            "num_active": len(self._active),
            "batch_size": len(self._active),
            "max_batch_size": self.max_batch_size,
            "active_kv_reserved": self._active_kv_reserved,
            "kv_budget_tokens": self.kv_budget_tokens,
            "kv_admit_blocked": self.kv_admit_blocked,
            "kv_pressure": pool.usage,
            "kv_length": self.backend.kv_length(),
            "blocks": pool.stats(),
            "num_generated_tokens": self.num_generated_tokens,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "num_rejected": sum(self.rejected_by_code.values()),
            "rejected_by_code": dict(self.rejected_by_code),
            "num_ticks": self.num_ticks,
            **self.policy.snapshot(),
            **(self.grammars.stats() if self.grammars is not None else {}),
            **self.handover_stats(),
        }
