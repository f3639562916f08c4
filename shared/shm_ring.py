"""One direction of a shared-memory connection: a single-writer, single-reader byte ring
in a sealed memfd, mapped by two processes that do not trust each other.

Layout
------
::

    offset   0   head      u64   read position, stored by the reader only
            64   tail      u64   write position, stored by the writer only
           128   epoch     u64   the engine's id
           192   capacity  u64   bytes of the data area (a power of two)
           256   data      capacity bytes

Each index is on its own 64-byte line (no false sharing). Positions count bytes modulo
2^64 and wrap there; a position's place in the data area is ``position % capacity``
(``capacity`` divides 2^64). A record::

    u32 length of the payload   u8 kind   u8 topic   u16 0   u64 seq   payload   pad to 8

``kind`` is DATA (the payload is the frame), OVERFLOW (the frame is too large for the
ring and travels beside it: :mod:`shared.shm`) or WRAP (the rest of the data area is
unused; the next record starts at offset 0).

Trusting nothing of the peer's
------------------------------
The peer maps the same memory and may write anything anywhere in it, at any time. So:

* **Each side keeps its own index privately** (``_tail`` for the writer, ``_head`` for
  the reader) and only *publishes* it to the ring; it never reads its own index back.
  A peer that rewrites our index changes nothing we do.
* **The peer's index is accepted only when** ``0 ≤ tail − head ≤ capacity`` (mod 2^64),
  computed with our private index; anything else raises :class:`PeerFault` (the caller
  drops the connection). An honest peer never trips it: the reader never moves past a
  tail it saw, the writer never past the room a head gave it.
* **Capacity and epoch are read once**, at attach; later writes to them are ignored.
* **A record header is copied out once**, then checked (kind, topic, its length against
  the validated tail and the end of the data area); one that fails is counted in
  ``bad_records`` and the reader skips to the validated tail. Payload bytes are copied
  out before ``head`` is published; a peer scribbling on them yields a frame that fails
  to decode, never a read out of bounds.
* **The memfd is sealed** (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) by its creator
  before it is handed over, and the attaching side refuses one that is not: neither side
  can ``ftruncate`` the mapping away under the other (a ``SIGBUS`` on the next access).

Index loads and stores
----------------------
Each index is loaded and stored as **one aligned 8-byte access**: ``memoryview.cast("Q")``
item access is a single ``memcpy`` of 8 bytes that the compiler emits as one ``mov``
(x86-64) or ``ldr``/``str`` (aarch64), and an aligned 8-byte access is single-copy atomic
on both. (``struct.pack_into``/``unpack_from`` of ``"<Q"`` move the bytes one at a time:
a concurrent reader saw a half-written index, 0 in 1,449 of 10.2 M loads, which made the
writer see a full ring.) ``tests/test_shm_ring.py`` stores and loads an index millions of
times across two processes and checks every load.

Memory ordering
---------------
The writer copies the record into the data area, then stores ``tail``, then rings the
doorbell; the reader loads ``tail``, copies records out, then stores ``head``. On x86-64
(TSO) stores become visible in program order and loads are not reordered with other loads
or with later stores, so a reader that sees a ``tail`` sees every byte before it, and a
writer that sees a ``head`` sees the reader done with every byte before it. On weakly
ordered CPUs (aarch64) the same two points need barriers: :func:`fence` issues a full
fence (``__atomic_thread_fence``, from a two-line C helper compiled like the kernels)
after the writer's copy and before its ``tail`` store, and after the reader's ``tail``
load and before its ``head`` store; where that helper cannot be built, ``--transport
auto`` falls back to ZeroMQ.
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import mmap
import os
import platform
import socket
import struct

HEAD, TAIL, EPOCH, CAPACITY, DATA = 0, 64, 128, 192, 256  # byte offsets
_HEAD, _TAIL, _EPOCH, _CAPACITY = HEAD // 8, TAIL // 8, EPOCH // 8, CAPACITY // 8  # u64 slots
REC = struct.Struct("<IBBHQ")  # length, kind, topic, 0, seq
REC_SIZE = REC.size  # 16
DATA_KIND, OVERFLOW_KIND, WRAP_KIND = 1, 2, 3
OWN, BROADCAST = 0, 1
M64 = (1 << 64) - 1
RING_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
FRAME_SEALS = RING_SEALS | fcntl.F_SEAL_WRITE  # a frame's own memfd: not even its bytes change


class RingFull(Exception):
    """No room in a ring within the time allowed."""


class PeerGone(Exception):
    """The other side closed its socket (it exited or died), or the connection is unusable."""


class PeerFault(PeerGone):
    """The peer broke the protocol — an index out of range, an unsealed memfd, an overflow
    marker with no frame beside it, a message that is not one: drop the connection."""


def _pad(n: int) -> int:
    return (n + 7) & ~7


# ---------------------------------------------------------------- fences

def _make_fence():
    """A full memory fence for weakly ordered CPUs; a no-op on x86-64 (see the module doc)."""
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return lambda: None
    from shared.native_build import BuildFailed, build_source

    try:
        lib = ctypes.CDLL(str(build_source("shm_fence", "void tickserve_fence(void) "
                                                       "{ __atomic_thread_fence(__ATOMIC_SEQ_CST); }\n")))
    except (BuildFailed, OSError) as exc:
        raise RuntimeError(f"no memory fence for the shared-memory rings on {platform.machine()}: {exc}") from None
    fn = lib.tickserve_fence
    fn.restype = None
    fn.argtypes = []
    return fn


_fence = None


def fence() -> None:
    global _fence
    if _fence is None:
        _fence = _make_fence()
    _fence()


# ---------------------------------------------------------------- sealed memfds


def sealed_memfd(name: str, size: int, data: bytes | None = None, seals: int = RING_SEALS) -> int:
    """A memfd of ``size`` bytes (holding ``data`` if given), sealed with ``seals``, ready to
    hand over. The caller closes it. Raises ``OSError``."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if data:
            view, done = memoryview(data), 0
            while done < len(data):
                done += os.pwrite(fd, view[done:], done)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def require_seals(fd: int, seals: int, what: str) -> None:
    """Raise :class:`PeerFault` unless the memfd ``fd`` carries every seal in ``seals``."""
    try:
        have = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:  # not a memfd at all
        raise PeerFault(f"{what} is not a sealable memfd: {exc}") from None
    if have & seals != seals:
        raise PeerFault(f"{what} is not sealed (seals {have:#x}, needs {seals:#x})")


# ---------------------------------------------------------------- the ring


class Ring:
    """One direction of a connection (see the module doc). One object writes, the peer's
    object reads; each is used from one thread at a time.

    ``Ring.create(size, epoch)`` makes the sealed memfd and maps it (the engine);
    ``Ring(fd)`` maps one received from the peer, refusing it unless sealed and well
    formed (:class:`PeerFault`). ``start`` sets both indices of a new ring (tests start
    near 2^64 to cross the wrap)."""

    def __init__(self, fd: int, *, _created: tuple[int, int, int] | None = None):
        if _created is None:
            require_seals(fd, RING_SEALS, "a ring")
        total = os.fstat(fd).st_size
        if total < DATA + 8:
            raise PeerFault(f"a ring of {total} bytes")
        self.map = mmap.mmap(fd, total)
        self.buf = memoryview(self.map)
        self._idx = self.buf[:DATA].cast("Q")  # each item access: one aligned 8-byte load or store
        if _created is not None:
            size, epoch, start = _created
            self._idx[_CAPACITY], self._idx[_EPOCH] = size, epoch
            self._idx[_HEAD] = self._idx[_TAIL] = start
        self.capacity = self._idx[_CAPACITY]
        self.epoch = self._idx[_EPOCH]
        if self.capacity <= 0 or self.capacity & (self.capacity - 1) or DATA + self.capacity > total:
            self.close()
            raise PeerFault("not a ring: bad capacity")
        # Our own positions, private from here on: the peer may rewrite the published ones.
        self._head = self._idx[_HEAD]
        self._tail = self._idx[_TAIL]
        self.bad_records = 0

    @classmethod
    def create(cls, name: str, size: int, epoch: int, start: int = 0) -> tuple["Ring", int]:
        """A new ring of ``size`` data bytes (a power of two) in a sealed memfd: ``(ring, fd)``;
        the caller hands ``fd`` over and closes it."""
        fd = sealed_memfd(name, DATA + size)
        try:
            return cls(fd, _created=(size, epoch, start & M64)), fd
        except BaseException:
            os.close(fd)
            raise

    # -------------------------------------------- the peer's index, checked

    def _peer_tail(self) -> int:
        """Reader: the writer's tail, accepted only within ``capacity`` of our head."""
        tail = self._idx[_TAIL]
        fence()  # the tail before the bytes it covers
        if (tail - self._head) & M64 > self.capacity:
            raise PeerFault(f"ring tail {tail} is not within {self.capacity} of head {self._head}")
        return tail

    def _peer_head(self) -> int:
        """Writer: the reader's head, accepted only within ``capacity`` behind our tail."""
        head = self._idx[_HEAD]
        if (self._tail - head) & M64 > self.capacity:
            raise PeerFault(f"ring head {head} is not within {self.capacity} behind tail {self._tail}")
        return head

    # -------------------------------------------- writer

    def free(self) -> int:
        """Writer: bytes of room now. Raises :class:`PeerFault`."""
        return self.capacity - ((self._tail - self._peer_head()) & M64)

    def fits(self, payload_len: int) -> bool:
        """Whether a frame of ``payload_len`` bytes can go in the ring at all (else: overflow)."""
        return REC_SIZE + _pad(payload_len) <= self.capacity // 2

    def has_room(self, payload_len: int) -> bool:
        """Writer: whether :meth:`try_write` of ``payload_len`` bytes would succeed now (room
        only grows until this side writes). Raises :class:`PeerFault`."""
        return self._room(REC_SIZE + _pad(payload_len))[0]

    def _room(self, need: int) -> tuple[bool, int, int]:
        used = (self._tail - self._peer_head()) & M64
        at = self._tail % self.capacity
        room_to_end = self.capacity - at
        skip = room_to_end if need > room_to_end else 0
        return used + skip + need <= self.capacity, at, skip

    def try_write(self, kind: int, topic: int, seq: int, payload: bytes) -> bool:
        """Append one record; ``False`` (nothing written) when there is no room now. Raises
        ``ValueError`` for a record that can never fit (see :meth:`fits`) and
        :class:`PeerFault` when the reader's head is out of range."""
        need = REC_SIZE + _pad(len(payload))
        if need > self.capacity // 2:
            raise ValueError(f"a record of {len(payload)} bytes never fits a ring of {self.capacity}")
        ok, at, skip = self._room(need)
        if not ok:
            return False
        tail = self._tail
        if skip:  # mark the end of the data area unused and start over at 0
            if skip >= REC_SIZE:
                REC.pack_into(self.buf, DATA + at, 0, WRAP_KIND, 0, 0, 0)
            tail, at = (tail + skip) & M64, 0
        REC.pack_into(self.buf, DATA + at, len(payload), kind, topic, 0, seq)
        self.buf[DATA + at + REC_SIZE: DATA + at + REC_SIZE + len(payload)] = payload
        fence()  # the record before the tail that covers it
        self._tail = (tail + need) & M64
        self._idx[_TAIL] = self._tail
        return True

    # -------------------------------------------- reader

    def pending(self) -> int:
        """Reader: bytes written and not yet read. Raises :class:`PeerFault`."""
        return (self._peer_tail() - self._head) & M64

    def read(self) -> tuple[int, int, int, bytes] | None:
        """The next record as ``(kind, topic, seq, payload)``, or ``None`` if the ring is
        empty. A corrupted header skips everything written so far (counted). Raises
        :class:`PeerFault` when the writer's tail is out of range."""
        while True:
            avail = self.pending()
            if avail == 0:
                return None
            head = self._head
            at = head % self.capacity
            room_to_end = self.capacity - at
            if room_to_end < REC_SIZE:  # too little left for a header: the writer wrapped
                if room_to_end > avail:
                    return self._bad(avail)
                self._advance(head + room_to_end)
                continue
            length, kind, topic, _, seq = REC.unpack_from(self.buf, DATA + at)
            if kind == WRAP_KIND:
                if room_to_end > avail:
                    return self._bad(avail)
                self._advance(head + room_to_end)
                continue
            need = REC_SIZE + _pad(length)
            if kind not in (DATA_KIND, OVERFLOW_KIND) or topic not in (OWN, BROADCAST) or need > room_to_end \
                    or need > avail:
                return self._bad(avail)
            payload = bytes(self.buf[DATA + at + REC_SIZE: DATA + at + REC_SIZE + length])
            self._advance(head + need)
            return kind, topic, seq, payload

    def _bad(self, avail: int) -> None:
        self.bad_records += 1
        self._advance(self._head + avail)  # nothing here can be trusted; start again at the writer's tail

    def _advance(self, head: int) -> None:
        fence()  # done with the bytes before the head that releases them
        self._head = head & M64
        self._idx[_HEAD] = self._head

    def close(self) -> None:
        self._idx.release()
        self.buf.release()
        self.map.close()


def fds_of(ancdata) -> list[int]:
    """The file descriptors an ``SCM_RIGHTS`` control message carried (``recvmsg``'s
    ``ancdata``); a truncated trailing one is dropped."""
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)
