"""The engine's rolling view of itself: what ``/scheduler/stats/stream`` and the
dashboard show, computed by the tick thread between ticks at a bounded rate.

One :class:`StatsWindow` lives in the engine. The tick thread feeds it as it works
(:meth:`on_arrival` when a request enters the scheduler, :meth:`on_outputs` for every
batch of streamed outputs) and asks :meth:`due` after each tick; when
``interval_s`` has passed it calls :meth:`publish`, which turns the scheduler's
counters into rates and the last minute's samples into percentiles. The result is
broadcast once to every frontend, so the cost does not grow with the number of
viewers. The I/O thread only calls :meth:`on_reject` (one writer per counter).

Latencies are measured inside the engine, so they cover every frontend:

- TTFT: from the request's arrival at the engine (``Request.arrival_time``, set when
  the I/O thread accepts it) to the tick that streams its first token, seconds.
- ITL: the gap between two successive streamed outputs of one request, divided by the
  tokens the later one carries, seconds.

Both go into log-spaced histograms (:class:`RollingHistogram`, one per second,
``window_s`` of them), so an observation costs O(1) and a percentile costs one sum over
the window; percentiles are exact to one bucket (``GROWTH`` − 1 ≈ 5 % relative).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable, Iterable

import numpy as np

from shared.protocol import RejectCode, RequestOutput

GROWTH = 1.05  # bucket i holds [MIN_S · GROWTH^i, MIN_S · GROWTH^(i+1)) seconds
MIN_S = 1e-4
NUM_BUCKETS = 330  # 100 µs … ≈ 1000 s; larger values land in the last bucket


class RollingHistogram:
    """Counts of seconds-valued samples per log bucket, per whole second, for the last
    ``window_s`` seconds (a ring of ``window_s`` rows)."""

    def __init__(self, window_s: int = 60):
        self.window_s = int(window_s)
        self._counts = np.zeros((self.window_s, NUM_BUCKETS), dtype=np.int64)
        self._second = np.full(self.window_s, -1, dtype=np.int64)  # which second a row holds

    def add(self, value_s: float, now: float) -> None:
        sec = int(now)
        row = sec % self.window_s
        if self._second[row] != sec:
            self._counts[row] = 0
            self._second[row] = sec
        if value_s <= MIN_S:
            idx = 0
        else:
            idx = min(NUM_BUCKETS - 1, int(math.log(value_s / MIN_S) / math.log(GROWTH)))
        self._counts[row, idx] += 1

    def _window(self, now: float) -> np.ndarray:
        live = self._second > int(now) - self.window_s
        return self._counts[live].sum(axis=0)

    def count(self, now: float) -> int:
        return int(self._window(now).sum())

    def quantiles(self, qs: Iterable[float], now: float) -> list[float | None]:
        """The ``qs`` quantiles (0..1) of the last ``window_s`` seconds, seconds; each is
        its bucket's geometric middle. ``None`` when the window is empty."""
        counts = self._window(now)
        total = int(counts.sum())
        if total == 0:
            return [None for _ in qs]
        cum = np.cumsum(counts)
        out = []
        for q in qs:
            rank = max(1, math.ceil(q * total))  # nearest-rank definition
            idx = int(np.searchsorted(cum, rank))
            out.append(MIN_S * GROWTH ** (idx + 0.5))
        return out


_HANDED = object()  # the last-token time of a handed-over row before its first output here


class StatsWindow:
    """Rolling rates and latency percentiles of one engine (see the module docstring).

    ``interval_s``: at most one publication per this many seconds (0 → never due).
    ``window_s``: the span of TTFT/ITL percentiles and of the prefix-cache hit rate.
    ``rate_window_s``: the span that rates (tokens/s, holds/s, rejects/s) average over.
    ``top_sessions``: how many sessions (the busiest by service rate) are reported.
    """

    def __init__(self, interval_s: float = 0.25, window_s: int = 60, rate_window_s: float = 5.0,
                 top_sessions: int = 8, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.window_s = window_s
        self.rate_window_s = rate_window_s
        self.top_sessions = top_sessions
        self.clock = clock
        self.ttft = RollingHistogram(window_s)
        self.itl = RollingHistogram(window_s)
        self.rejects = {code.value: 0 for code in RejectCode}  # written by the I/O thread only
        self.latest: dict = {}  # the last publication
        self.num_publications = 0
        self._next_due = 0.0
        self._live: dict[str, tuple[str, float | None, float]] = {}  # rid → (session, last emit, arrival)
        self._session_tokens: dict[str, int] = {}  # cumulative output tokens per session
        self._session_seen: dict[str, float] = {}
        self._prompt_tokens: deque[tuple[float, int, int]] = deque()  # (t, prompt, cached) per request
        self._samples: deque[tuple[float, dict]] = deque()  # counters at past publications

    # ------------------------------------------------------------------ feeding (tick thread)

    def on_arrival(self, request_id: str, session_id: str, arrival_time: float) -> None:
        """A request entered the scheduler; ``arrival_time`` is on this window's clock."""
        self._live[request_id] = (session_id, None, arrival_time)

    def on_handed_over(self, request_id: str, now: float | None = None) -> None:
        """A prefill engine handed the row to a decode engine with its first token: TTFT
        is counted here, now; the rest of the row is the decode engine's."""
        entry = self._live.pop(request_id, None)
        if entry is not None and entry[1] is None:
            now = self.clock() if now is None else now
            self.ttft.add(now - entry[2], now)

    def on_taken_over(self, request_id: str, session_id: str) -> None:
        """A decode engine took a handed-over row: its first output (counted for TTFT by
        the prefill engine) adds tokens but no latency; later ones are ITL."""
        self._live[request_id] = (session_id, _HANDED, 0.0)

    def on_outputs(self, outputs: Iterable[RequestOutput], now: float | None = None) -> None:
        """Outputs about to be streamed: first tokens → TTFT, later ones → ITL."""
        now = self.clock() if now is None else now
        for out in outputs:
            entry = self._live.get(out.request_id)
            if entry is None:
                continue
            session, last, arrival = entry
            n = len(out.token_ids)
            if n:
                if last is _HANDED:
                    pass
                elif last is None:
                    self.ttft.add(now - arrival, now)
                    self._prompt_tokens.append((now, out.num_prompt_tokens, out.num_cached_tokens))
                else:
                    self.itl.add((now - last) / n, now)
                self._session_tokens[session] = self._session_tokens.get(session, 0) + n
                self._session_seen[session] = now
                last = now
            if out.finish_reason is not None:
                del self._live[out.request_id]
            elif n:
                self._live[out.request_id] = (session, last, arrival)

    def on_reject(self, code: RejectCode) -> None:
        """The engine refused a submit (I/O thread)."""
        self.rejects[code.value] += 1

    # ------------------------------------------------------------------ publishing (tick thread)

    def due(self, now: float | None = None) -> bool:
        """True when a publication is due; at most one per ``interval_s``."""
        if self.interval_s <= 0:
            return False
        now = self.clock() if now is None else now
        return now >= self._next_due

    def publish(self, scheduler_stats: dict, now: float | None = None) -> dict:
        """Compute the window from ``scheduler_stats`` (:meth:`Scheduler.stats`) and the
        samples fed so far; store it as :attr:`latest` and return it."""
        now = self.clock() if now is None else now
        self._next_due = now + self.interval_s
        counters = {
            "output_tokens": scheduler_stats.get("num_generated_tokens", 0),
            "kv_admit_blocked": scheduler_stats.get("kv_admit_blocked", 0),
            **{f"reject:{k}": v for k, v in list(self.rejects.items())},
            **{f"session:{s}": v for s, v in self._session_tokens.items()},
        }
        self._samples.append((now, counters))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.rate_window_s:
            self._samples.popleft()
        t0, base = self._samples[0]
        dt = now - t0

        def rate(key: str) -> float:
            return (counters.get(key, 0) - base.get(key, 0)) / dt if dt > 0 else 0.0

        cutoff = now - self.window_s
        while self._prompt_tokens and self._prompt_tokens[0][0] < cutoff:
            self._prompt_tokens.popleft()
        prompt = sum(x[1] for x in self._prompt_tokens)
        cached = sum(x[2] for x in self._prompt_tokens)
        for s, seen in list(self._session_seen.items()):  # forget sessions idle for a window
            if seen < cutoff:
                del self._session_seen[s]
                self._session_tokens.pop(s, None)
        vtc = scheduler_stats.get("counters") or {}
        service = {s: rate(f"session:{s}") for s in self._session_tokens}
        busiest = sorted(set(service) | set(vtc), key=lambda s: (-service.get(s, 0.0), -vtc.get(s, 0.0), s))
        ttft50, ttft99 = self.ttft.quantiles((0.5, 0.99), now)
        itl50, itl99 = self.itl.quantiles((0.5, 0.99), now)
        self.latest = {
            "interval_s": self.interval_s,
            "window_s": self.window_s,
            "rate_window_s": self.rate_window_s,
            "output_tokens_per_s": rate("output_tokens"),
            "kv_admit_blocked_per_s": rate("kv_admit_blocked"),
            "rejects_per_s": {code.value: rate(f"reject:{code.value}") for code in RejectCode},
            "rejects_total": dict(self.rejects),
            "ttft_p50_s": ttft50, "ttft_p99_s": ttft99, "ttft_count": self.ttft.count(now),
            "itl_p50_s": itl50, "itl_p99_s": itl99, "itl_count": self.itl.count(now),
            "prefix_cache_hit_rate": cached / prompt if prompt else None,
            "sessions": [{"session": s, "tokens_per_s": service.get(s, 0.0), "vtc_counter": vtc.get(s)}
                         for s in busiest[:self.top_sessions]],
        }
        self.num_publications += 1
        return self.latest
