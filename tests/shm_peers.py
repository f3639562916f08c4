"""Shared-memory peers made by hand, as a buggy or hostile process would make them (for
``tests/test_shm_hostile.py`` and ``tools/probe_hardening.py --shm``)."""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

from shared import protocol as p
from shared import shm
from shared.transport import topic_for


def rogue(run: Path | str, name: str) -> shm.ShmChannel:
    """A connected channel under frontend id ``name``, to misuse; raises ``AssertionError``
    with the engine's reason if it refused."""
    chan = shm.ShmChannel(str(run), name, topic_for(name), p.BROADCAST_TOPIC)
    assert chan.connect(), chan.refusal
    return chan


def closed_by_engine(sock: socket.socket, within: float) -> float | None:
    """Seconds until the engine closed its end of ``sock`` (what it sent first is read and
    dropped), or ``None`` if it had not within ``within`` seconds."""
    t0 = time.monotonic()
    deadline = t0 + within
    while time.monotonic() < deadline:
        select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        try:
            while shm.recv_message(sock) is not None:
                pass
        except shm.PeerFault:
            continue
        except shm.PeerGone:
            return time.monotonic() - t0
    return None


class LoopLag:
    """The running event loop's longest stall, in seconds: a task that asks to wake every
    5 ms records how late it woke. Start it inside the loop; ``stop()`` ends it."""

    def __init__(self):
        import asyncio

        self.worst = 0.0
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self):
        import asyncio

        while True:
            t0 = time.monotonic()
            await asyncio.sleep(0.005)
            self.worst = max(self.worst, time.monotonic() - t0 - 0.005)

    def stop(self):
        self._task.cancel()


async def until(predicate, timeout: float, what: str = "condition") -> None:
    """Wait on the event loop (10 ms steps) for ``predicate()``; ``TimeoutError`` after ``timeout`` s."""
    import asyncio

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout}s")
        await asyncio.sleep(0.01)
