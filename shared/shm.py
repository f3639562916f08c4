"""The shared-memory carrier: one single-writer, single-reader ring per frontend in each
direction, for frontends on the engine's host.

Handshake and liveness
----------------------
The engine listens on a unix-domain stream socket, ``<run_dir>/shm.sock``, beside its
ZeroMQ ``ipc://`` sockets. A frontend connects and sends its frontend id; the engine
creates two anonymous rings (``memfd_create``: frontend → engine, engine → frontend) and
two ``eventfd`` doorbells (one each way) and hands all four over the socket with
``SCM_RIGHTS``. Both sides ``mmap`` the rings. Nothing has a name, so nothing is left in
``/dev/shm`` or on disk after ``kill -9`` of either side: the kernel frees the memory and
the eventfds with the last process that holds them. The socket stays open for the life
of the connection: end of file on it is the peer's death, seen at once. It also carries
the frames too large for a ring (below).

Ring layout (``Ring``)
----------------------
::

    offset   0   head      u64   read position, written by the reader only
            64   tail      u64   write position, written by the writer only
           128   epoch     u64   the engine's id (both sides check it)
           192   capacity  u64   bytes of the data area (a power of two)
           256   data      capacity bytes

Each index is on its own 64-byte line (no false sharing). Positions grow without bound;
a position's place in the data area is ``position % capacity``. A record::

    u32 length of the payload   u8 kind   u8 topic   u16 0   u64 seq   payload   pad to 8

``kind`` is DATA (the payload is a msgpack frame), OVERFLOW (the frame did not fit: it
follows on the socket, length-prefixed, in the same order as the markers) or WRAP (the
rest of the data area is unused; the next record starts at offset 0). ``topic`` is 0 for
the frontend's own topic and 1 for the broadcast topic, and ``seq`` counts per topic as
over ZeroMQ, so a dropped frame is a gap the reader sees.

Memory ordering
---------------
The writer copies the record into the data area, then stores ``tail``, then writes the
doorbell; the reader reads the doorbell (or wakes on its timeout), loads ``tail``, copies
records out, then stores ``head``. Only the writer stores ``tail`` and the data it
covers; only the reader stores ``head``. On x86-64 (TSO) stores become visible in
program order and loads are not reordered with other loads or with later stores, so a
reader that sees a ``tail`` sees every byte before it, and a writer that sees a ``head``
sees the reader done with every byte before it: no half-written frame is ever read, no
unread byte ever overwritten. On weakly ordered CPUs (aarch64) the same two points need
barriers: ``fence()`` issues a full fence (``__atomic_thread_fence``, from a two-line C
helper compiled like the kernels) after the writer's copy and before its ``tail`` store,
and after the reader's ``tail`` load and after its copy (before its ``head`` store); where
that helper cannot be built there, ``--transport auto`` falls back to ZeroMQ. The
doorbell carries no data: it only says "look at tail". A reader re-checks ``tail`` after
each wake-up, so a ring of the doorbell that races with a read is never lost.

Full rings
----------
Engine → frontend: a record that does not fit is dropped and counted, and its topic's
sequence number still advances, so the frontend sees the gap and fails the requests it
concerns (as with ZeroMQ PUB at its high-water mark); the tick loop never waits.
Frontend → engine: the frontend waits for room up to its send timeout, then raises
:class:`RingFull` (the caller answers 503, as for a ZeroMQ send that timed out).
Records larger than half a ring take the overflow path. Bytes in a ring that do not form
a record (a corrupted header) are counted, everything up to ``tail`` is skipped, and the
reader goes on.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import select
import socket
import struct
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

HEAD, TAIL, EPOCH, CAPACITY, DATA = 0, 64, 128, 192, 256
REC = struct.Struct("<IBBHQ")  # length, kind, topic, 0, seq
REC_SIZE = REC.size  # 16
DATA_KIND, OVERFLOW_KIND, WRAP_KIND = 1, 2, 3
OWN, BROADCAST = 0, 1
U64 = struct.Struct("<Q")
LEN = struct.Struct("<Q")  # length prefix of a frame on the socket
SOCKET_NAME = "shm.sock"
OUTBOUND_BYTES = 4 << 20  # engine → frontend ring (the default; frontend → engine gets a quarter)
MAX_SOCKET_FRAME = 64 << 20


class RingFull(Exception):
    """No room in a ring within the time allowed."""


class PeerGone(Exception):
    """The other side closed its socket (it exited or died)."""


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


def available() -> str | None:
    """Why this host cannot use the shared-memory carrier, or ``None`` if it can."""
    if not hasattr(os, "memfd_create") or not hasattr(os, "eventfd") or not hasattr(socket, "send_fds"):
        return "needs Linux with Python 3.10+ (memfd_create, eventfd, send_fds)"
    try:
        fence()
    except RuntimeError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------- the ring


class Ring:
    """One direction of a connection: a mapped memfd (see the module doc for the layout).
    One object writes, the peer's object reads; each is used from one thread at a time."""

    def __init__(self, fd: int, size: int | None = None, epoch: int | None = None):
        total = os.fstat(fd).st_size if size is None else DATA + size
        if size is not None:
            os.ftruncate(fd, total)
        self.map = mmap.mmap(fd, total)
        self.buf = memoryview(self.map)
        if size is not None:
            U64.pack_into(self.buf, CAPACITY, size)
            U64.pack_into(self.buf, EPOCH, epoch or 0)
        self.capacity = U64.unpack_from(self.buf, CAPACITY)[0]
        if self.capacity <= 0 or self.capacity & (self.capacity - 1) or DATA + self.capacity > total:
            raise ValueError("not a ring: bad capacity")
        self.epoch = U64.unpack_from(self.buf, EPOCH)[0]
        self.bad_records = 0

    def _load(self, at: int) -> int:
        return U64.unpack_from(self.buf, at)[0]

    def free(self) -> int:
        return self.capacity - (self._load(TAIL) - self._load(HEAD))

    def fits(self, payload_len: int) -> bool:
        """Whether a frame of ``payload_len`` bytes can go in the ring at all (else: overflow)."""
        return REC_SIZE + _pad(payload_len) <= self.capacity // 2

    def try_write(self, kind: int, topic: int, seq: int, payload: bytes) -> bool:
        """Append one record; ``False`` (nothing written) when there is no room now."""
        need = REC_SIZE + _pad(len(payload))
        tail, head = self._load(TAIL), self._load(HEAD)
        at = tail % self.capacity
        room_to_end = self.capacity - at
        wrap = need > room_to_end
        if (tail - head) + need + (room_to_end if wrap else 0) > self.capacity:
            return False
        if wrap:  # mark the end of the data area unused and start over at 0
            if room_to_end >= REC_SIZE:
                REC.pack_into(self.buf, DATA + at, 0, WRAP_KIND, 0, 0, 0)
            tail += room_to_end
            at = 0
        REC.pack_into(self.buf, DATA + at, len(payload), kind, topic, 0, seq)
        self.buf[DATA + at + REC_SIZE: DATA + at + REC_SIZE + len(payload)] = payload
        fence()  # the record before the tail that covers it
        U64.pack_into(self.buf, TAIL, tail + need)
        return True

    def read(self) -> tuple[int, int, int, bytes] | None:
        """The next record as ``(kind, topic, seq, payload)``, or ``None`` if the ring is
        empty. A corrupted header skips everything written so far (counted)."""
        while True:
            head, tail = self._load(HEAD), self._load(TAIL)
            fence()  # the tail before the bytes it covers
            if head >= tail:
                return None
            at = head % self.capacity
            room_to_end = self.capacity - at
            if room_to_end < REC_SIZE:  # too little left for a header: the writer wrapped
                self._advance(head + room_to_end)
                continue
            length, kind, topic, _, seq = REC.unpack_from(self.buf, DATA + at)
            if kind == WRAP_KIND:
                self._advance(head + room_to_end)
                continue
            need = REC_SIZE + _pad(length)
            if kind not in (DATA_KIND, OVERFLOW_KIND) or topic not in (OWN, BROADCAST) or need > room_to_end \
                    or head + need > tail:
                self.bad_records += 1
                self._advance(tail)  # nothing here can be trusted; start again at the writer's position
                return None
            payload = bytes(self.buf[DATA + at + REC_SIZE: DATA + at + REC_SIZE + length])
            self._advance(head + need)
            return kind, topic, seq, payload

    def _advance(self, head: int) -> None:
        fence()  # done with the bytes before the head that releases them
        U64.pack_into(self.buf, HEAD, head)

    def close(self) -> None:
        self.buf.release()
        self.map.close()


# ---------------------------------------------------------------- the socket beside the rings


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(LEN.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise PeerGone("the peer closed its socket")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = LEN.unpack(_recv_exact(sock, LEN.size))
    if n > MAX_SOCKET_FRAME:
        raise PeerGone(f"a frame of {n} bytes on the socket: not a tickserve peer")
    return _recv_exact(sock, n)


def _doorbell(fd: int) -> None:
    try:
        os.eventfd_write(fd, 1)
    except BlockingIOError:  # the counter is saturated: the reader has plenty to look at
        pass


def _drain_doorbell(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


# ---------------------------------------------------------------- engine side


@dataclass
class Counters:
    frames_in: int = 0
    frames_out: int = 0
    dropped: int = 0  # outbound frames dropped on a full ring
    overflow_in: int = 0
    overflow_out: int = 0


def _socket_gone(sock: socket.socket, peer: str) -> str | None:
    """Why the handshake socket says its peer is gone (an end of file or an error), or
    ``None`` when it is alive; reads nothing (``MSG_PEEK``, non-blocking)."""
    sock.settimeout(0)
    try:
        data = sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return None
    except OSError as exc:
        return str(exc)
    return None if data else f"{peer} closed its socket"


class ShmPeer:
    """The engine's end of one frontend's connection (I/O thread only)."""

    def __init__(self, sock: socket.socket, frontend_id: str, epoch: int, outbound_bytes: int = OUTBOUND_BYTES):
        self.sock = sock
        self.frontend_id = frontend_id
        in_fd = os.memfd_create("tickserve-ring-in", os.MFD_CLOEXEC)
        out_fd = os.memfd_create("tickserve-ring-out", os.MFD_CLOEXEC)
        self.in_bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # frontend rings the engine
        self.out_bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # engine rings the frontend
        try:
            self.inbound = Ring(in_fd, max(1 << 12, outbound_bytes // 4), epoch)
            self.outbound = Ring(out_fd, outbound_bytes, epoch)
            socket.send_fds(sock, [b"tickserve-shm 1"], [in_fd, out_fd, self.in_bell, self.out_bell])
        finally:
            os.close(in_fd)  # the mappings keep the memory; the frontend holds its own fds
            os.close(out_fd)
        self.counters = Counters()
        self._seq = {OWN: 0, BROADCAST: 0}
        self.closed = False

    @property
    def fds(self) -> tuple[int, int]:
        """What the I/O thread polls: the inbound doorbell and the socket (EOF, overflow frames)."""
        return self.in_bell, self.sock.fileno()

    def publish(self, broadcast: bool, payload: bytes) -> bool:
        """Send one frame to this frontend; ``False`` if it was dropped (ring full)."""
        topic = BROADCAST if broadcast else OWN
        seq = self._seq[topic]
        self._seq[topic] = seq + 1
        try:
            if self.outbound.fits(len(payload)):
                ok = self.outbound.try_write(DATA_KIND, topic, seq, payload)
            else:
                ok = self.outbound.try_write(OVERFLOW_KIND, topic, seq, b"")
                if ok:
                    self.sock.settimeout(1.0)
                    _send_frame(self.sock, payload)
                    self.counters.overflow_out += 1
        except (OSError, socket.timeout):
            ok = False
        if not ok:
            self.counters.dropped += 1
            return False
        self.counters.frames_out += 1
        _doorbell(self.out_bell)
        return True

    def receive(self, deadline: float) -> list[bytes]:
        """Frames from the inbound ring (and their overflow frames) until it is empty or
        ``deadline`` (monotonic) passes. Raises :class:`PeerGone` when the frontend left."""
        _drain_doorbell(self.in_bell)
        frames = []
        while time.monotonic() < deadline:
            rec = self.inbound.read()
            if rec is None:
                break
            kind, _, _, payload = rec
            if kind == OVERFLOW_KIND:
                self.sock.settimeout(5.0)
                payload = _recv_frame(self.sock)
                self.counters.overflow_in += 1
            frames.append(payload)
        self.counters.frames_in += len(frames)
        if self.inbound._load(HEAD) < self.inbound._load(TAIL):
            _doorbell(self.in_bell)  # the deadline came first: come back for the rest after the heartbeat check
        return frames

    def check_socket(self) -> None:
        """The socket is readable: only an end of file may be there outside an overflow."""
        why = _socket_gone(self.sock, "the frontend")
        if why:
            raise PeerGone(why)

    def stats(self) -> dict:
        return {"carrier": "shm", "dropped": self.counters.dropped, "overflow_in": self.counters.overflow_in,
                "overflow_out": self.counters.overflow_out, "bad_records": self.inbound.bad_records,
                "frames_in": self.counters.frames_in, "frames_out": self.counters.frames_out}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for closer in (self.inbound.close, self.outbound.close, self.sock.close,
                       lambda: os.close(self.in_bell), lambda: os.close(self.out_bell)):
            try:
                closer()
            except OSError:
                pass


class ShmListener:
    """The engine's unix socket in its run directory, accepting frontends (I/O thread)."""

    def __init__(self, run_dir: str, epoch: int, ring_bytes: int = OUTBOUND_BYTES):
        self.path = os.path.join(run_dir, SOCKET_NAME)
        self.epoch = epoch
        self.ring_bytes = ring_bytes
        if os.path.exists(self.path):  # left by a dead engine: the caller holds the run directory's lock
            os.unlink(self.path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self.sock.listen(64)
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> ShmPeer | None:
        """One handshake: the frontend's id in, the rings and doorbells out. ``None`` if
        nothing is waiting or the peer is not a tickserve frontend."""
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return None
        try:
            conn.settimeout(2.0)
            hello = _recv_frame(conn)
            frontend_id = hello.decode("utf-8")
            if not (1 <= len(frontend_id) <= 256) or not frontend_id.isprintable():
                raise ValueError("bad frontend id")
            return ShmPeer(conn, frontend_id, self.epoch, self.ring_bytes)
        except (OSError, ValueError, PeerGone, UnicodeDecodeError) as exc:
            log.warning("shared-memory handshake refused: %s", exc)
            conn.close()
            return None

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------- frontend side


def socket_path(run_dir: str) -> str:
    return os.path.join(run_dir, SOCKET_NAME)


class ShmChannel:
    """A frontend's (or a script's) end: implements :class:`shared.transport.Client`.

    ``connect()`` runs the handshake; until then, and after the engine is gone,
    ``send`` raises :class:`PeerGone` and ``recv`` returns nothing. ``recv`` raises
    :class:`shared.transport.SequenceGap` when frames were lost, and
    :class:`PeerGone` when the engine died (at once: its socket closes)."""

    carrier = "shm"

    def __init__(self, run_dir: str, frontend_id: str, topic: bytes, broadcast: bytes | None):
        self.path = socket_path(run_dir)
        self.frontend_id = frontend_id
        self.topic, self.broadcast = topic, broadcast
        self.sock: socket.socket | None = None
        self.inbound: Ring | None = None  # engine → us
        self.outbound: Ring | None = None  # us → engine
        self.in_bell = self.out_bell = -1
        self._expected: dict[int, int] = {}
        self._poller = None
        self._sock_readable = False

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def connect(self, timeout: float = 2.0) -> bool:
        """Handshake with the engine at the run directory; ``False`` if none answers."""
        self.disconnect()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            sock.connect(self.path)
            _send_frame(sock, self.frontend_id.encode())
            msg, fds, _, _ = socket.recv_fds(sock, 64, 4)
        except OSError:
            sock.close()
            return False
        if msg != b"tickserve-shm 1" or len(fds) != 4:
            for fd in fds:
                os.close(fd)
            sock.close()
            return False
        out_fd, in_fd, self.out_bell, self.in_bell = fds  # the engine's "in" is our "out"
        try:
            self.outbound, self.inbound = Ring(out_fd), Ring(in_fd)
        finally:
            os.close(out_fd)
            os.close(in_fd)
        self.sock = sock
        self._expected.clear()
        self._poller = select.poll()
        self._poller.register(self.in_bell, select.POLLIN)
        self._poller.register(sock.fileno(), select.POLLIN)
        self._sock_readable = False
        return True

    def send(self, msg, timeout_ms: int = 1000) -> None:
        """Send one message; waits for room up to ``timeout_ms`` (then :class:`RingFull`)."""
        from shared import codec

        self.send_frame(codec.encode(msg), timeout_ms)

    def send_frame(self, payload: bytes, timeout_ms: int = 1000) -> None:
        """Callers serialise sends with :meth:`connect` / :meth:`disconnect` (one lock)."""
        if self.sock is None:
            raise PeerGone("not connected to an engine")
        ring = self.outbound
        deadline = time.monotonic() + timeout_ms / 1000
        overflow = not ring.fits(len(payload))
        while not ring.try_write(OVERFLOW_KIND if overflow else DATA_KIND, OWN, 0, b"" if overflow else payload):
            if time.monotonic() >= deadline:
                raise RingFull("the engine is not taking messages")
            time.sleep(0.0005)
        if overflow:
            self.sock.settimeout(max(0.1, deadline - time.monotonic()))
            _send_frame(self.sock, payload)
        _doorbell(self.out_bell)

    def poll(self, timeout_ms: int) -> bool:
        """Wait for the doorbell (or the socket: the engine left, or an overflow frame) at
        most ``timeout_ms``; at once when records are already waiting. The doorbell is
        drained here, once per wake-up, not per record."""
        if self.sock is None:
            time.sleep(timeout_ms / 1000)
            return False
        if self.inbound._load(HEAD) < self.inbound._load(TAIL):
            return True
        events = self._poller.poll(timeout_ms)
        for fd, _ in events:
            if fd == self.in_bell:
                _drain_doorbell(fd)
            else:
                self._sock_readable = True
        return bool(events)

    def recv(self):
        """One message, or ``None`` if nothing is waiting (non-blocking)."""
        from shared import codec
        from shared.transport import Received, SequenceGap

        if self.sock is None:
            return None
        rec = self.inbound.read()
        if rec is None:
            if self._sock_readable:
                self._sock_readable = False
                self._check_socket()
            return None
        kind, topic, seq, payload = rec
        if kind == OVERFLOW_KIND:
            self.sock.settimeout(5.0)
            payload = _recv_frame(self.sock)
        expected = self._expected.get(topic)
        self._expected[topic] = seq + 1
        name = self.topic if topic == OWN else (self.broadcast or b"")
        if expected is not None and seq != expected:
            raise SequenceGap(name, expected, seq)
        return Received(name, codec.decode(payload, "frontend"))

    def _check_socket(self) -> None:
        why = _socket_gone(self.sock, "the engine")
        if why:
            self.disconnect()
            raise PeerGone(why)

    def reset_sequence(self) -> None:
        self._expected.clear()

    def disconnect(self) -> None:
        """Drop the connection and every fd and mapping of it (idempotent)."""
        for ring in (self.inbound, self.outbound):
            if ring is not None:
                ring.close()
        self.inbound = self.outbound = None
        for fd in (self.in_bell, self.out_bell):
            if fd >= 0:
                os.close(fd)
        self.in_bell = self.out_bell = -1
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self._poller = None

    def close(self) -> None:
        self.disconnect()

    @property
    def bad_records(self) -> int:
        return self.inbound.bad_records if self.inbound is not None else 0


__all__ = ["Ring", "ShmListener", "ShmPeer", "ShmChannel", "RingFull", "PeerGone", "available", "fence",
           "socket_path"]
