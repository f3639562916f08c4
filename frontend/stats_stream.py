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

The first event after ``retry`` is ``event: history``: the last minute of the charted
figures, one point a second (:meth:`StatsHub.history_frame`), so that a page opened now
draws the minute before it. ``stats`` is the engine's ``/scheduler/stats`` body (``window`` holds the rates and
the last minute's TTFT/ITL percentiles) or ``null`` while the engine is down; when an
engine comes back (a new ``engine_id``) ``restarts`` counts up.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import AsyncIterator, Callable

DEFAULT_MAX_HZ = 4.0
KEEPALIVE_S = 1.0
HISTORY_S = 60  # a new viewer gets this many seconds of history, one point a second
HISTORY_FIELDS = ("num_pending", "num_prefilling", "num_active", "batch_size", "kv_pressure", "active_kv_reserved",
                  "kv_budget_tokens", "window")  # what the dashboard charts


def history_point(stats: dict, t: float) -> dict:
    """The charted fields of one stats body, at wall-clock time ``t`` (seconds)."""
    return {"t": t, **{k: stats.get(k) for k in HISTORY_FIELDS}}


def sse_frame(event_id: int, event: str, data: dict) -> str:
    """One server-sent event; ``data`` is JSON on a single line."""
    return f"id: {event_id}\nevent: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class StatsHub:
    """The latest engine stats of one frontend, shared by every viewer (event loop only).

    ``status``: returns ``(engine up?, engine id or None)`` — the engine client's view —
    or, for a frontend with several engines, a list of them (one per engine, in a fixed
    order); ``addresses`` names those engines. ``frontend``: extra fields for the event's
    ``frontend`` object (a callable). ``merge``: several engines' stats as one (the
    event's ``stats``; each engine's own are under ``engines``).
    """

    def __init__(self, status: Callable[[], tuple | list], frontend: Callable[[], dict] | None = None,
                 clock: Callable[[], float] = time.monotonic, addresses: list[str] | None = None,
                 merge: Callable[[list[dict]], dict] | None = None, wall: Callable[[], float] = time.time):
        self.status = status
        self.wall = wall
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY_S)  # one point a second
        self.frontend = frontend or (lambda: {})
        self.clock = clock
        self.addresses = addresses or [""]
        self.merge = merge
        self.latest_by: list[dict | None] = [None] * len(self.addresses)
        self.version = 0  # counts publications received
        self.num_dropped = 0  # malformed publications
        self.ids_by: list[list[str]] = [[] for _ in self.addresses]  # every engine seen per slot, oldest first
        self._changed = asyncio.Event()
        self._frame_key: tuple | None = None
        self._frame = ""

    @property
    def latest(self) -> dict | None:
        return self.latest_by[0]

    @property
    def engine_ids(self) -> list[str]:
        return self.ids_by[0]

    @property
    def restarts(self) -> int:
        return sum(max(0, len(ids) - 1) for ids in self.ids_by)

    def update(self, data, index: int = 0) -> None:
        """A broadcast ``Stats`` from engine ``index``. Checked field by field before use:
        a dict whose ``engine_id`` is a non-empty string; anything else is counted and dropped."""
        if not isinstance(data, dict) or not isinstance(data.get("engine_id"), str) or not data["engine_id"] \
                or not 0 <= index < len(self.latest_by):
            self.num_dropped += 1
            return
        ids = self.ids_by[index]
        if data["engine_id"] not in ids:
            ids.append(data["engine_id"])
        self.latest_by[index] = data
        self.version += 1
        self._changed.set()
        now = self.wall()
        if not self.history or now - self.history[-1]["t"] >= 1.0:
            current = self.current()
            if current is not None:
                self.history.append(history_point(current, now))

    def history_frame(self) -> str:
        """The ``history`` event a new viewer gets first: ``{"now": <wall-clock s>, "points":
        [history_point, …]}``, the last :data:`HISTORY_S` seconds, oldest first."""
        now = self.wall()
        points = [pt for pt in self.history if now - pt["t"] <= HISTORY_S]
        data = json.dumps({"now": now, "points": points}, separators=(",", ":"))
        return f"event: history\ndata: {data}\n\n"  # no id: the stats events keep theirs

    def engine_down(self) -> None:
        """Wake the viewers so they report the engine down at once."""
        self._changed.set()

    def _statuses(self) -> list[tuple[bool, str | None]]:
        st = self.status()
        statuses = list(st) if isinstance(st, list) else [st]
        # an engine that said hello counts as seen (and as a restart) before its first broadcast
        for ids, (up, eid) in zip(self.ids_by, statuses):
            if up and isinstance(eid, str) and eid and eid not in ids:
                ids.append(eid)
        return statuses

    def current(self) -> dict | None:
        """The latest stats of the engines that are up (several engines' merged), or ``None``."""
        statuses = self._statuses()
        fresh = [s for s in self._fresh(statuses) if s is not None]
        if len(statuses) == 1 or not fresh:
            return fresh[0] if fresh else None
        return self.merge(fresh) if self.merge else fresh[0]

    def _fresh(self, statuses: list) -> list[dict | None]:
        return [latest if up and latest is not None and latest.get("engine_id") == eid else None
                for (up, eid), latest in zip(statuses, self.latest_by)]

    def frame(self) -> str:
        """The current event, encoded once per (publication, engine state)."""
        statuses = self._statuses()
        key = (self.version, tuple(statuses), self.restarts)
        if key != self._frame_key:
            fresh = self._fresh(statuses)
            if len(statuses) == 1:
                up, engine_id = statuses[0]
                payload = {"engine": {"up": bool(up), "engine_id": engine_id, "restarts": self.restarts},
                           "frontend": self.frontend(), "stats": fresh[0]}
            else:
                alive = [s for s in fresh if s is not None]
                payload = {
                    "engine": {"up": any(up for up, _ in statuses),
                               "engine_id": ",".join(eid for up, eid in statuses if up and eid) or None,
                               "restarts": self.restarts},
                    "engines": [{"address": addr, "up": bool(up), "engine_id": eid,
                                 "restarts": max(0, len(ids) - 1), "stats": s}
                                for addr, (up, eid), ids, s in zip(self.addresses, statuses, self.ids_by, fresh)],
                    "frontend": self.frontend(),
                    "stats": self.merge(alive) if alive and self.merge else (alive[0] if alive else None),
                }
            self._frame = sse_frame(self.version, "stats", payload)
            self._frame_key = key
        return self._frame

    async def events(self, max_hz: float = DEFAULT_MAX_HZ,
                     stopping: Callable[[], bool] = lambda: False) -> AsyncIterator[str]:
        """One viewer's stream: ``retry``, the current event, then one per publication
        (at most ``max_hz`` a second, at least one every ``KEEPALIVE_S``) until
        ``stopping()`` (the frontend drains)."""
        min_gap = 1.0 / max_hz
        yield "retry: 1000\n\n"
        yield self.history_frame()
        while not stopping():
            sent_at = self.clock()
            frame = self.frame()
            seen = self._frame_key
            yield frame
            deadline = sent_at + KEEPALIVE_S
            while self.clock() < deadline:
                self._changed.clear()
                if (self.version, tuple(self._statuses()), self.restarts) != seen:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - self.clock()))
                except asyncio.TimeoutError:
                    break
            wait = sent_at + min_gap - self.clock()
            if wait > 0:
                await asyncio.sleep(wait)
