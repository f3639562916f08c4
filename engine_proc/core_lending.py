"""Engines on one host lending their cores to each other while they are idle.

``tickserve serve`` runs one single-threaded engine per core (``shared/placement.py``):
under load the engines never wait for each other's threads. A lone stream, though, then
runs on one core while the others sit idle. The engines of one ``serve`` share a small
board, a file of one slot per engine in the run directory (``cores.board``, mapped into
every engine): each engine's tick thread writes whether it has work (running or waiting
requests) before every tick, and an engine about to run a forward pass counts the idle
slots of its siblings and runs that pass on its own threads plus one per idle sibling
(:class:`~engine_proc.threads.ThreadPlan`).

Only passes on the low-bit path borrow (``lend_below``: the host's low-bit/dense
crossover): the low-bit matmul and the C kernels give every output to one thread, so a
pass's numbers do not depend on how many threads it ran on, and a greedy request gets the
same tokens whether its engine borrowed or not. Measured on a 2-core AMX host (SmolLM2
Q4_1, one decode row, ``tools/bench_step.py``-style timing): one thread 15.2 ms a step,
two 9.1 ms.

A slot holds -1 while its engine has work, else the CLOCK_MONOTONIC time (ns) it last went
idle; a sibling counts as idle only after :data:`MIN_IDLE_S` of it, so that the short
gaps between one engine's requests under load are not lent out. A sibling that starts a
tick while another engine's borrowed pass runs shares its core for that one pass
(milliseconds); the borrower's next pass sees the slot busy and runs on its own threads.
An engine keeps its main (tick) thread on its own share of the CPUs and lets only the
OpenMP threads it borrows with run on the others (:meth:`CoreBoard.pin_home`). A slot is
one aligned 8-byte word, written by one engine and read by the others: no lock. An engine
that dies leaves its slot as it was (busy: its siblings stop borrowing its core; idle:
they borrow a core nobody uses).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time

from shared.placement import cpu_share

log = logging.getLogger("tickserve.engine")

SLOT = struct.Struct("<q")
BOARD_NAME = "cores.board"
BUSY = -1
MIN_IDLE_S = 0.05  # a sibling idle for less than this is not lent out
#: Passes of fewer rows than this may borrow an idle sibling engine's core (as long as
#: they are low-bit, whose numbers do not depend on the thread count). Longer passes do
#: not: a sibling that gets work mid-pass shares its core with the borrowed thread until
#: the pass ends. With every pass up to 256 rows low-bit (AMX tiles) and all of them
#: lending, a 2-core AMX host served 16 streams at 446 tok/s against 492 with lending off
#: (two rounds, tools/bench_compare.py); a lone stream's decode rows still borrow.
LEND_MAX_ROWS = 32


def create_board(path: str, engines: int) -> None:
    """Write a board of ``engines`` idle slots at ``path`` (replacing any). Raises OSError."""
    with open(path, "wb") as f:
        f.write(bytes(SLOT.size * engines))


class CoreBoard:
    """This engine's view of the board at ``path``: its own ``slot`` and the others'.

    Raises OSError when the file cannot be opened or mapped, ValueError when ``slot`` is
    not one of its slots."""

    def __init__(self, path: str, slot: int):
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < SLOT.size or size % SLOT.size:
                raise ValueError(f"{path}: {size} bytes is not a board of {SLOT.size}-byte slots")
            self.engines = size // SLOT.size
            if not 0 <= slot < self.engines:
                raise ValueError(f"slot {slot} is not on the board of {self.engines} engines at {path}")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.slot = slot
        self._published: bool | None = None
        try:  # the CPUs the engine may lend threads onto (taken before pin_home narrows this thread's)
            self.cpus = max(1, len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            self.cpus = max(1, os.cpu_count() or 1)

    def publish(self, busy: bool) -> None:
        """Say whether this engine has work (a write only when that changes)."""
        if busy != self._published:
            SLOT.pack_into(self._map, self.slot * SLOT.size, BUSY if busy else time.monotonic_ns())
            self._published = busy

    def idle_siblings(self, min_idle_s: float = MIN_IDLE_S) -> int:
        """How many of the other engines have had no work for at least ``min_idle_s``."""
        since = time.monotonic_ns() - int(min_idle_s * 1e9)
        return sum(1 for i in range(self.engines)
                   if i != self.slot and 0 <= SLOT.unpack_from(self._map, i * SLOT.size)[0] <= since)

    def pin_home(self, threads: int) -> None:
        """Start torch's OpenMP pool with ``threads`` threads while this thread may still run
        on every CPU (the pool's threads keep that), then keep the calling thread, the one
        that will run every pass, on this engine's own share: the borrowed threads go where
        a sibling is idle, the engine's own thread never leaves its core. Call it on the
        main thread before any other OpenMP region with more than one thread."""
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return
        if threads < 2 or len(cpus) < 2:
            return
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        torch.ones(1 << 22).add_(1)  # a parallel region: the pool's threads now exist, unpinned
        torch.set_num_threads(before)
        try:
            os.sched_setaffinity(0, cpu_share(cpus, self.slot, self.engines))  # this thread only (Linux)
        except OSError as exc:
            log.warning("cannot keep the engine on its own CPUs (%s)", exc)

    def close(self) -> None:
        """Leave the slot idle (this engine stops) and unmap the board."""
        try:
            self.publish(False)
            self._map.close()
        except (ValueError, OSError):
            pass


def open_board(path: str, slot: int) -> CoreBoard | None:
    """The board at ``path`` (``None`` for an empty path, or with one warning when it
    cannot be opened: the engine then runs on its own threads only)."""
    if not path:
        return None
    try:
        return CoreBoard(path, slot)
    except (OSError, ValueError) as exc:
        log.warning("core board unavailable (%s); this engine will not borrow idle engines' cores", exc)
        return None
