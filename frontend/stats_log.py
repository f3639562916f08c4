"""A periodic stats line while the engines have work; silent while they are idle.

::

    2026-12-03 07:01:20,001 tickserve.stats INFO running: 12 reqs, waiting: 3 reqs, KV usage: 18.4%
        (377 of 2048 blocks), generation: 412.0 tokens/s

(one line, every ``--log-stats-interval-s`` seconds, 10 by default as vLLM's). ``running``
is the scheduler's prefilling plus decoding rows (``_prefilling`` + ``_active``), ``waiting``
the requests not admitted yet (``_pending`` and the engine's inbound queue), KV usage the
used blocks over the pool's (``kv_pressure``), generation the engines' output tokens per
second over the last 5 seconds. The figures are the engines' own broadcasts as the
dashboard gets them (:class:`~frontend.stats_stream.StatsHub`), summed over engines. One
last line follows the work's end, then nothing until work comes back. Only the first
frontend of ``tickserve serve`` writes it (the others get ``--disable-log-stats``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

log = logging.getLogger("tickserve.stats")


def stats_line(stats: dict) -> tuple[str, bool]:
    """``(the line, whether there is work)`` for one engine stats body (``/scheduler/stats``)."""
    running = int(stats.get("num_active", 0) or 0) + int(stats.get("num_prefilling", 0) or 0)
    waiting = int(stats.get("num_pending", 0) or 0) + int(stats.get("num_waiting", 0) or 0)
    blocks = stats.get("blocks") or {}
    used, total = int(blocks.get("num_used_blocks", 0) or 0), int(blocks.get("num_blocks", 0) or 0)
    rate = float((stats.get("window") or {}).get("output_tokens_per_s") or 0.0)
    usage = f"{100.0 * used / total:.1f}% ({used} of {total} blocks)" if total else "-"
    line = f"running: {running} reqs, waiting: {waiting} reqs, KV usage: {usage}, generation: {rate:.1f} tokens/s"
    return line, bool(running or waiting)


class StatsLog:
    """Writes :func:`stats_line` of ``current()`` (the hub's merged stats, or ``None``)
    while there is work, and once more when it ends."""

    def __init__(self, current: Callable[[], dict | None]):
        self.current = current
        self.busy = False  # the last line reported work

    def tick(self) -> str | None:
        """One period: the line written, or ``None`` when silent."""
        stats = self.current()
        if stats is None:
            return None
        line, busy = stats_line(stats)
        if not (busy or self.busy):
            return None
        self.busy = busy
        log.info("%s", line)
        return line

    async def run(self, interval_s: float) -> None:
        """Until cancelled: :meth:`tick` every ``interval_s`` seconds."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a malformed broadcast must not end the logging
                log.debug("stats line failed", exc_info=True)
