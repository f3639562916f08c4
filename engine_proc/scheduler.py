"""The scheduler: three queues and the ordered tick (see the scheduler card).

Every request is in exactly one of::

    _pending     waiting, ordered by the policy (FCFS or Fair/VTC)   ≤ MAX_QUEUE_SIZE
    _prefilling  prompt being computed, one chunk per tick           ┐ together
    _active      the decode batch, one token per row per tick        ┘ ≤ MAX_BATCH_SIZE

One tick, in this order (the worker holds the backend lock throughout)::

    ① _admit_pending        gates 2 and 3; admitted → _prefilling (or, monolithic,
                             prefilled at once and promoted)
    ② advance_prefill_chunk up to PREFILL_CHUNK_SIZE prompt tokens, oldest row first;
                             a final chunk samples the first token and promotes
    ③ evict_finished        rows that ended (EOS, stop id, max_tokens) release
                             their KV, blocks and reservation
    ④ decode_step           one batched forward, one new token per row

Admit and prefill run before evict so that a row whose *first* token ends it is
still seen by ③ and its token streamed; do not reorder without re-deriving that.

``PREFILL_MODE=mixed_batch`` (version B) runs ① → ③ → ②+④: :meth:`Scheduler.mixed_step`
is one forward pass for the decode rows and the tick's prefill chunks under one token
budget. ③ must precede it (a finished row must not be fed); a row whose first token
ends it is promoted with that token streamed and is evicted by the next tick's ③.

Where each part lives (every one a part of :class:`Scheduler`)::

    queues.py      the three queues, the request index, the card's MAX_* settings and gate
                   counters, reservation accounting; add_request, abort, the release path
    admission.py   ① _admit_pending: gates 2 and 3 (the configuration-only checks: gates.py)
    prefill.py     ② advance_prefill_chunk: the prefill plan, packed passes, prefix-cache hits
    decode.py      ④'s inputs, and sampling its logits
    outputs.py     the output rules (EOS, stop ids, max_tokens, context window); the tick's outputs
    constrained.py structured outputs: rows wait in _pending for their grammar; a matcher per row
    handover.py    disaggregated: the prefill role's handover at _promote_to_decode, the
                   decode role's admission of handovers (gates 2 and 3)
    scheduler.py   the tick itself, ③, ④, ②+④ (mixed_batch) and _promote_to_decode
"""

from __future__ import annotations

import logging
from typing import Callable

from engine_proc.admission import Admission
from engine_proc.backends.kernel_batch import BatchRejected
from engine_proc.constrained import Constrained
from engine_proc.decode import Decode
from engine_proc.handover import Handovers
from engine_proc.outputs import OutputRules
from engine_proc.prefill import Prefill
from engine_proc.queues import SchedulerState
from engine_proc.request import Request, RequestStatus
from shared.config import EngineRole, PrefillMode
from shared.protocol import RequestOutput

log = logging.getLogger(__name__)


class Scheduler(Admission, Prefill, Decode, OutputRules, Constrained, Handovers, SchedulerState):
    """Owns the queues, the gates and the reservation accounting; drives a backend.

    Constructed as :class:`~engine_proc.queues.SchedulerState` says. Not thread-safe:
    only the tick thread calls it (the engine's I/O thread talks to it through queues).
    """

    def step(self, stream: Callable[[list[tuple[str, RequestOutput]]], None] | None = None
             ) -> list[tuple[str, RequestOutput]]:
        """One tick: the four phases in the card's order. Returns what to stream,
        as ``(frontend_id, RequestOutput)`` pairs.

        With ``stream``, first tokens made by prefill are handed to it before the decode
        pass instead of waiting for the end of the tick (TTFT is one decode step shorter).
        """
        self.num_ticks += 1
        if self.role is EngineRole.PREFILL:  # disaggregated: handover.py
            self.prefill_role_step()
            return self.drain_outputs()
        if self.role is EngineRole.DECODE:
            self.decode_role_step()
            return self.drain_outputs()
        self._admit_pending()
        if self.prefill_mode is PrefillMode.MIXED_BATCH:  # ② and ④ are one pass: ③ goes first
            self.evict_finished()
            self.mixed_step()
            return self.drain_outputs()
        self.advance_prefill_chunk()
        if stream is not None and self._out.items:
            stream(self.drain_outputs())
        self.evict_finished()
        self.decode_step()
        return self.drain_outputs()

    # ------------------------------------------------------------------ ③ evict

    def evict_finished(self) -> None:
        for req in [r for r in self._active if r.status.is_finished]:
            self._release(req)

    # ------------------------------------------------------------------ ④ decode

    def decode_step(self) -> None:
        rows = self._active
        if not rows:
            return
        try:
            logits = self.backend.decode_step_batched(*self._decode_inputs(rows))
        except BatchRejected as exc:  # refused at the kernel boundary before it ran: fail those rows only
            self._fail_rejected(exc, list(rows))
            return
        self._after_decode(rows, logits)

    # ------------------------------------------------------------------ ②+④ mixed_batch

    def mixed_step(self) -> None:
        """②+④ as one forward pass (``PREFILL_MODE=mixed_batch``, the card's version B).

        The tick's token budget (``max_num_batched_tokens``) goes first to the decode
        rows, one token each, so running streams never wait; prefill chunks take what is
        left, oldest row first (as :meth:`advance_prefill_chunk` spends its budget).
        Rows whose prompt completes are promoted through :meth:`_promote_to_decode`
        after the pass and decode from the next tick. If the mixed pass fails (it
        changed no row state), its prefill and decode run again as separate passes, so a
        bad prompt fails only its own row.
        """
        rows = list(self._active)
        plan = self._plan_prefill(self.token_budget - len(rows), self.backend.pairs_per_token)
        if not plan:
            self.decode_step()
            return
        if not rows:
            self._run_prefill_plan(plan)
            return
        try:
            logits, prefill_logits = self.backend.mixed_step(*self._decode_inputs(rows), self._chunks(plan))
        except Exception:
            log.exception("mixed pass of %d decode rows and %d prefill chunks failed; retrying them "
                          "as separate passes", len(rows), len(plan))
            self._run_prefill_plan(plan)
            self.decode_step()
            return
        self._after_decode(rows, logits)
        self._after_prefills(plan, prefill_logits)

    # ------------------------------------------------------------------ the seam

    def _promote_to_decode(self, req: Request) -> None:
        """The one door from prefill into the decode batch (the disaggregation seam)."""
        self.backend.promote(req.request_id)
        req.status = RequestStatus.RUNNING
        self._active.append(req)
