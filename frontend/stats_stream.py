"""``GET /scheduler/stats/stream``: the engine's stats as server-sent events.

The engine broadcasts its stats every ``stats_interval_s`` (``Stats`` with nonce 0,
computed by its tick thread between ticks). :class:`StatsHub` keeps the latest one
and encodes each event once, whatever the number of viewers; every viewer's
generator (:meth:`StatsHub.events`) waits for the next publication and sends it, at
most ``max_hz`` events a second, and at least one a second (a keep-alive that also
reports the engine down while no publication comes).

Framing (``text/event-stream``): a ``retry: 1000`` line first (browsers reconnect one
second after losing the frontend), then events of the form::

    id: <n>
    event: stats
    data: {"engine": {"up": true, "engine_id": "...", "restarts": 0}, "stats": {...}}

``stats`` is the engine's ``/scheduler/stats`` body (``window`` holds the rates and
the last minute's TTFT/ITL percentiles) or ``null`` while the engine is down; when an
engine comes back (a new ``engine_id``) ``restarts`` counts up.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator, Callable

DEFAULT_MAX_HZ = 4.0
KEEPALIVE_S = 1.0


def sse_frame(event_id: int, event: str, data: dict) -> str:
    """One server-sent event; ``data`` is JSON on a single line."""
    return f"id: {event_id}\nevent: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class StatsHub:
    """The latest engine stats of one frontend, shared by every viewer (event loop only).

    ``status``: returns ``(engine up?, engine id or None)`` — the engine client's view.
    ``frontend``: extra fields for the event's ``frontend`` object (a callable).
    """

    def __init__(self, status: Callable[[], tuple[bool, str | None]],
                 frontend: Callable[[], dict] | None = None, clock: Callable[[], float] = time.monotonic):
        self.status = status
        self.frontend = frontend or (lambda: {})
        self.clock = clock
        self.latest: dict | None = None
        self.version = 0  # counts publications received
        self.num_dropped = 0  # malformed publications
        self.engine_ids: list[str] = []  # every engine seen, oldest first
        self._changed = asyncio.Event()
        self._frame_key: tuple | None = None
        self._frame = ""

    @property
    def restarts(self) -> int:
        return max(0, len(self.engine_ids) - 1)

    def update(self, data) -> None:
        """A broadcast ``Stats`` from the engine. Checked field by field before use:
        a dict whose ``engine_id`` is a non-empty string; anything else is counted and dropped."""
        if not isinstance(data, dict) or not isinstance(data.get("engine_id"), str) or not data["engine_id"]:
            self.num_dropped += 1
            return
        if not self.engine_ids or self.engine_ids[-1] != data["engine_id"]:
            if data["engine_id"] not in self.engine_ids:
                self.engine_ids.append(data["engine_id"])
        self.latest = data
        self.version += 1
        self._changed.set()

    def engine_down(self) -> None:
        """Wake the viewers so they report the engine down at once."""
        self._changed.set()

    def frame(self) -> str:
        """The current event, encoded once per (publication, engine state)."""
        up, engine_id = self.status()
        key = (self.version, up, engine_id, self.restarts)
        if key != self._frame_key:
            fresh = up and self.latest is not None and self.latest.get("engine_id") == engine_id
            self._frame = sse_frame(self.version, "stats", {
                "engine": {"up": bool(up), "engine_id": engine_id, "restarts": self.restarts},
                "frontend": self.frontend(),
                "stats": self.latest if fresh else None,
            })
            self._frame_key = key
        return self._frame

    async def events(self, max_hz: float = DEFAULT_MAX_HZ,
                     stopping: Callable[[], bool] = lambda: False) -> AsyncIterator[str]:
        """One viewer's stream: ``retry``, the current event, then one per publication
        (at most ``max_hz`` a second, at least one every ``KEEPALIVE_S``) until
        ``stopping()`` (the frontend drains)."""
        min_gap = 1.0 / max_hz
        yield "retry: 1000\n\n"
        while not stopping():
            sent_at = self.clock()
            frame = self.frame()
            seen = self._frame_key
            yield frame
            deadline = sent_at + KEEPALIVE_S
            while self.clock() < deadline:
                self._changed.clear()
                up, engine_id = self.status()
                if (self.version, up, engine_id, self.restarts) != seen:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - self.clock()))
                except asyncio.TimeoutError:
                    break
            wait = sent_at + min_gap - self.clock()
            if wait > 0:
                await asyncio.sleep(wait)
