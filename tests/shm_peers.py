"""Shared-memory peers made by hand, as a buggy or hostile process would make them (for
``tests/test_shm_hostile.py`` and ``tools/probe_hardening.py --shm``)."""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

from shared import protocol as p
from shared import shm
from shared import shm_channel
from shared.transport import topic_for


def rogue(run: Path | str, name: str) -> shm_channel.ShmChannel:
    """A connected channel under frontend id ``name``, to misuse; raises ``AssertionError``
    with the engine's reason if it refused."""
    chan = shm_channel.ShmChannel(str(run), name, topic_for(name), p.BROADCAST_TOPIC)
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


_STORES = r"""
import mmap, os, struct, sys
from shared import shm_ring
fd, bell, old, n = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
m = mmap.mmap(fd, os.fstat(fd).st_size)
buf = memoryview(m)
idx, U, k = buf[:shm_ring.DATA].cast("Q"), struct.Struct("<Q"), 0x0001000100010001
for i in range(n):  # every 16-bit lane of the value holds the same count, never 0
    v = (i % 0xFFFF + 1) * k
    if old:
        U.pack_into(buf, shm_ring.TAIL, v); U.pack_into(buf, shm_ring.HEAD, v)
    else:
        idx[shm_ring._TAIL] = v; idx[shm_ring._HEAD] = v
os.eventfd_write(bell, 1)
"""


def torn_index_loads(old: bool = False, stores: int = 2_000_000) -> dict:
    """Two processes on one ring: a child stores HEAD and TAIL ``stores`` times each while
    this process loads both; a load is torn when its 16-bit lanes differ (bytes of two
    stores) or it is 0 after a store was seen. ``old``: struct's ``"<Q"`` accessors instead
    of the ring's single 8-byte ones. ``{"loads", "torn", "seen_stored", "samples"}``, where
    ``samples`` holds up to 8 torn loads as ``(load number, "head"/"tail", hex value)``."""
    import os
    import struct
    import subprocess
    import sys

    from shared import shm_ring
    from tests.procs import REPO, _env

    ring, fd = shm.Ring.create("torn-test", 1 << 12, 1)
    bell = os.eventfd(0, os.EFD_NONBLOCK)
    child = subprocess.Popen([sys.executable, "-c", _STORES, str(fd), str(bell), "1" if old else "0", str(stores)],
                             pass_fds=(fd, bell), env=_env(), cwd=REPO)
    U, idx, buf, k = struct.Struct("<Q"), ring._idx, ring.buf, 0x0001000100010001
    loads = torn = stored = 0
    samples: list = []
    try:
        while True:
            for _ in range(10_000):
                for slot in (shm_ring._TAIL, shm_ring._HEAD):
                    v = U.unpack_from(buf, slot * 8)[0] if old else idx[slot]
                    if v != (v & 0xFFFF) * k or (v == 0 and stored > 0):
                        torn += 1
                        if len(samples) < 8:
                            samples.append((loads, "tail" if slot == shm_ring._TAIL else "head", hex(v)))
                    stored += v != 0
                loads += 2
            try:
                os.eventfd_read(bell)
                break
            except BlockingIOError:
                pass
        assert child.wait(60) == 0
    finally:
        child.kill()
        os.close(fd)
        os.close(bell)
        ring.close()
    return {"loads": loads, "torn": torn, "seen_stored": stored, "samples": samples}
