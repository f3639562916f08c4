"""Scheduling policies: the order in which ``_pending`` requests are admitted.

Both policies implement :class:`SchedulingPolicy` — a queue of waiting requests
(``on_request_arrived`` / ``peek_next`` / ``pick_next`` / ``remove``) plus the card's
lifecycle hooks. The scheduler calls them as follows::

    arrive ─► on_request_arrived ─► [waiting] ─► pick_next ─► on_request_admitted
                                        │                         │ on_tokens_processed
                                        └─ remove                 ▼ (per chunk / step)
    any state ─────────────────────────────────────────────► on_request_finished

* FCFS — key ``(-priority, arrival_seq)``: higher priority first, oldest within a tier.
* Fair (VTC) — key ``(-priority, counter[session_id], arrival_seq)``: within a priority
  tier, the session that has been served the fewest weighted tokens goes first.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from typing import ClassVar, Iterator

from engine_proc.request import Request
from shared.config import PolicyName


class _WaitHeap:
    """Waiting requests ordered by ``(-priority, arrival_seq)``.

    push/peek/pop are O(log n) amortised; ``remove`` is O(1) and lazy: the heap entry
    stays until it reaches the top (or a compaction), and is recognised as dead because
    its ticket no longer matches ``_live``. Tickets also make a removed-then-re-added
    request safe: its old entry stays dead.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Request]] = []
        self._live: dict[Request, int] = {}  # waiting request → ticket of its live entry
        self._tickets = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, req: Request) -> bool:
        return req in self._live

    def push(self, req: Request) -> None:
        if req in self._live:
            raise ValueError(f"request {req.request_id!r} is already waiting")
        ticket = next(self._tickets)
        self._live[req] = ticket
        heapq.heappush(self._heap, (-req.priority, req.arrival_seq, ticket, req))

    def peek(self) -> Request | None:
        heap = self._heap
        while heap and self._live.get(heap[0][3]) != heap[0][2]:
            heapq.heappop(heap)  # dead entry left behind by remove()
        return heap[0][3] if heap else None

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pick_next from an empty queue")
        heapq.heappop(self._heap)
        del self._live[req]
        return req

    def remove(self, req: Request) -> bool:
        if self._live.pop(req, None) is None:
            return False
        if len(self._heap) > 2 * len(self._live) + 32:  # too many dead entries: compact
            self._heap = [e for e in self._heap if self._live.get(e[3]) == e[2]]
            heapq.heapify(self._heap)
        return True

    def __iter__(self) -> Iterator[Request]:
        """Waiting requests in key order (a sorted copy; O(n log n))."""
        return (e[3] for e in sorted(e for e in self._heap if self._live.get(e[3]) == e[2]))


class SchedulingPolicy(ABC):
    """Orders waiting requests and sees every request's lifecycle.

    Every hook is O(log n) or better except where a subclass says otherwise.
    ``on_request_finished`` may be called for a request in any state; one that is
    still waiting is removed, so a finished request is never picked.
    """

    name: ClassVar[PolicyName]

    @abstractmethod
    def on_request_arrived(self, req: Request) -> None:
        """``req`` entered ``_pending``. Raises ``ValueError`` if it is already waiting."""

    @abstractmethod
    def peek_next(self) -> Request | None:
        """The request ``pick_next`` would return, or ``None`` if nothing waits."""

    @abstractmethod
    def pick_next(self) -> Request:
        """Remove and return the head. Raises ``IndexError`` if nothing waits."""

    @abstractmethod
    def remove(self, req: Request) -> bool:
        """Drop a waiting request (abort, hard-reject); ``False`` if it was not waiting."""

    def on_tokens_processed(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        """Charge ``req`` for ``prompt_tokens`` uncached prompt tokens (the scheduler
        reports the whole prompt once, at admission) and/or ``output_tokens`` decoded
        tokens (after every decode step). Counts in tokens."""

    def on_request_admitted(self, req: Request) -> None:
        """``req`` left ``_pending`` (after ``pick_next``) for prefill/decode."""

    def on_request_finished(self, req: Request) -> None:
        """``req`` left the engine — finished, aborted or rejected, from any state."""
        self.remove(req)

    @abstractmethod
    def __len__(self) -> int:
        """Number of waiting requests."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Waiting requests in the order they would be picked now."""

    def snapshot(self) -> dict:
        """JSON-ready state for ``/scheduler/stats``."""
        return {"policy": self.name.value}

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if internal bookkeeping disagrees (for tests)."""
        assert len(list(self)) == len(self)


class FCFSPolicy(SchedulingPolicy):
    """First come, first served with priority on top: key ``(-priority, arrival_seq)``."""

    name = PolicyName.FCFS

    def __init__(self) -> None:
        self._queue = _WaitHeap()

    def on_request_arrived(self, req: Request) -> None:
        self._queue.push(req)

    def peek_next(self) -> Request | None:
        return self._queue.peek()

    def pick_next(self) -> Request:
        return self._queue.pop()

    def remove(self, req: Request) -> bool:
        return self._queue.remove(req)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class FairPolicy(SchedulingPolicy):
    """Virtual Token Counter (VTC) — Sheng et al., "Fairness in Serving Large Language
    Models", OSDI 2024, §4.

    Each session (``req.session_id``; ``""`` is one anonymous session) has a counter of
    weighted tokens it has been served: ``on_tokens_processed`` adds
    ``w_p · prompt_tokens + w_q · output_tokens`` (paper defaults ``w_p = 1``,
    ``w_q = 2``). The next request is the minimum of
    ``(-priority, counter[session], arrival_seq)`` over each session's head, so priority
    still beats fairness and, within a tier, the least-served session goes first.

    Lift rule: when a request arrives for a session with no queued *or running* work,
    its counter becomes ``max(own, min counter over sessions that have work)``; if no
    session has work, ``max(own, counter of the session that went idle last)`` — so a
    newcomer arriving while the engine is idle cannot later claim a catch-up burst
    against a heavy session that returns. Either way it is not pushed behind others.

    The paper's bound: for two clients that stay backlogged over an interval, VTC keeps
    the difference in their weighted service within ``2 · max(w_p · L_input, w_q · M)``
    (``L_input``: longest prompt; ``M``: most tokens a running batch holds). It is proved
    for the paper's model, which this follows (the uncached prompt is charged at
    admission, every output token per step); prefix-cache hits are free here.

    ``peek_next`` / ``pick_next`` scan the sessions with waiting work: O(#sessions).

    Bounded state: a session with no work is lifted on return to ``max(own, floor)``,
    where the floor is the minimum counter of the sessions with work (the last idle
    session's counter when none has any), and the floor never decreases. So once an idle
    session's counter is at or below the floor, forgetting it changes nothing — it is
    forgotten then, never earlier (forgetting a well-served session's higher counter
    would let it reset its debt by going idle). Sessions kept: those with work, plus
    idle ones still above the floor.
    """

    name = PolicyName.FAIR

    def __init__(self, prompt_weight: float = 1.0, output_weight: float = 2.0) -> None:
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self._counters: dict[str, float] = {}
        self._queues: dict[str, _WaitHeap] = {}  # sessions with waiting requests only
        self._running: dict[str, int] = {}  # session → admitted, unfinished requests (> 0)
        self._admitted: set[Request] = set()
        self._waiting = 0
        self._last_idle_counter = 0.0  # counter of the session whose work emptied last
        self._idle: list[tuple[float, str]] = []  # heap of (counter, session) of idle sessions (lazy)

    def _has_work(self, session: str) -> bool:
        return session in self._queues or session in self._running

    def on_request_arrived(self, req: Request) -> None:
        session = req.session_id
        if not self._has_work(session):
            self._counters[session] = max(self._counters.get(session, 0.0), self.floor())
        self._queues.setdefault(session, _WaitHeap()).push(req)
        self._waiting += 1

    def _head_session(self) -> str | None:
        best, best_key = None, None
        for session, queue in self._queues.items():
            head = queue.peek()
            key = (-head.priority, self._counters[session], head.arrival_seq)
            if best_key is None or key < best_key:
                best, best_key = session, key
        return best

    def peek_next(self) -> Request | None:
        session = self._head_session()
        return None if session is None else self._queues[session].peek()

    def pick_next(self) -> Request:
        session = self._head_session()
        if session is None:
            raise IndexError("pick_next from an empty queue")
        req = self._queues[session].pop()
        self._drop_if_empty(session)
        self._waiting -= 1
        return req

    def remove(self, req: Request) -> bool:
        queue = self._queues.get(req.session_id)
        if queue is None or not queue.remove(req):
            return False
        self._drop_if_empty(req.session_id)
        self._waiting -= 1
        return True

    def _drop_if_empty(self, session: str) -> None:
        if not self._queues[session]:
            del self._queues[session]

    def on_tokens_processed(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        cost = self.prompt_weight * prompt_tokens + self.output_weight * output_tokens
        self._counters[req.session_id] = self._counters.get(req.session_id, 0.0) + cost

    def on_request_admitted(self, req: Request) -> None:
        if req not in self._admitted:
            self._admitted.add(req)
            self._counters.setdefault(req.session_id, 0.0)
            self._running[req.session_id] = self._running.get(req.session_id, 0) + 1

    def on_request_finished(self, req: Request) -> None:
        self.remove(req)
        if req in self._admitted:
            self._admitted.discard(req)
            self._running[req.session_id] -= 1
            if not self._running[req.session_id]:
                del self._running[req.session_id]
        if not self._has_work(req.session_id) and req.session_id in self._counters:
            self._last_idle_counter = self._counters[req.session_id]
            heapq.heappush(self._idle, (self._counters[req.session_id], req.session_id))
        self._forget_served_sessions()

    def floor(self) -> float:
        """What an idle session is lifted to on return: the minimum counter of the sessions
        with work, or the last idle session's counter when none has any."""
        busy = [self._counters[s] for s in self._queues.keys() | self._running.keys()]
        return min(busy) if busy else self._last_idle_counter

    def _forget_served_sessions(self) -> None:
        """Drop idle sessions whose counter is at or below the floor (see the class doc)."""
        if len(self._idle) > 2 * len(self._counters) + 64:  # stale entries of sessions that came back
            self._idle = [(c, s) for s, c in self._counters.items() if not self._has_work(s)]
            heapq.heapify(self._idle)
        floor = self.floor()
        while self._idle and self._idle[0][0] <= floor:
            counter, session = heapq.heappop(self._idle)
            if not self._has_work(session) and self._counters.get(session) == counter:
                del self._counters[session]

    @property
    def num_sessions(self) -> int:
        """Sessions whose counter is kept (with work, or idle above the floor)."""
        return len(self._counters)

    def __len__(self) -> int:
        return self._waiting

    def __iter__(self) -> Iterator[Request]:
        """Waiting requests in pick order at the current counters."""
        waiting = [r for queue in self._queues.values() for r in queue]
        waiting.sort(key=lambda r: (-r.priority, self._counters[r.session_id], r.arrival_seq))
        return iter(waiting)

    SNAPSHOT_SESSIONS = 32

    def snapshot(self) -> dict:
        """The policy, the counters of the busiest sessions with work (highest first, at
        most ``SNAPSHOT_SESSIONS``), how many sessions are kept in all, and the floor."""
        busy = sorted(self._queues.keys() | self._running.keys(), key=lambda s: (-self._counters[s], s))
        return {"policy": self.name.value,
                "counters": {s: self._counters[s] for s in busy[:self.SNAPSHOT_SESSIONS]},
                "num_sessions": len(self._counters), "num_sessions_with_work": len(busy),
                "counter_floor": self.floor()}

    def check_invariants(self) -> None:
        super().check_invariants()
        assert self._waiting == sum(len(q) for q in self._queues.values())
        assert all(len(q) > 0 for q in self._queues.values())
        assert sum(self._running.values()) == len(self._admitted)
        assert all(n > 0 for n in self._running.values())
        assert all(s in self._counters for s in self._queues.keys() | self._running.keys())


def make_policy(name: PolicyName | str, *, prompt_weight: float = 1.0,
                output_weight: float = 2.0) -> SchedulingPolicy:
    """Build the policy called ``name`` (``"fcfs"`` or ``"fair"``); the weights are
    VTC's ``w_p`` / ``w_q`` and only matter for ``"fair"``. Raises ``ValueError`` for an
    unknown name."""
    try:
        policy = PolicyName(name)
    except ValueError:
        known = ", ".join(p.value for p in PolicyName)
        raise ValueError(f"unknown scheduling policy {name!r} (known: {known})") from None
    if policy is PolicyName.FAIR:
        return FairPolicy(prompt_weight=prompt_weight, output_weight=output_weight)
    return FCFSPolicy()
