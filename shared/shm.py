"""The shared-memory carrier: one ring pair per frontend on the engine's host
(:mod:`shared.shm_ring`), two eventfd doorbells, and a unix socket beside them. This
module is the handshake, the socket's frames and the engine's end (:class:`ShmListener`,
:class:`ShmPeer`); the frontend's end is :class:`shared.shm_channel.ShmChannel`.

Handshake and liveness
----------------------
The engine listens on a unix-domain ``SOCK_SEQPACKET`` socket, ``<run_dir>/shm.sock``,
beside its ZeroMQ ``ipc://`` sockets. A frontend connects and sends one message,
``tickserve-shm 2 <frontend id>``. The engine reads it without blocking, within
:data:`HANDSHAKE_TIMEOUT_S` of the connection (a silent connection is closed then; a
message is whole or absent, so a trickle cannot hold it), and answers either
``refused: <reason>`` (and closes) or ``tickserve-shm 2`` with four fds by
``SCM_RIGHTS``: two sealed memfd rings (frontend → engine, engine → frontend) and two
``eventfd`` doorbells (one each way). Both sides ``mmap`` the rings. Nothing has a name,
so nothing is left in ``/dev/shm`` or on disk after ``kill -9`` of either side. The
socket stays open for the life of the connection: end of file on it is the peer's death,
seen at once.

The engine refuses (``refused: ...``, which the frontend logs) a frontend id that a live
connection holds — a frontend that reconnects closes its old socket first, so its old
connection is seen dead and retired before the new one is accepted — and any connection
beyond its ``max_shm_peers`` (``engine_proc/shm_frontends.py``).

Frames too large for a ring
---------------------------
A frame over half a ring travels as **a sealed memfd of its own**: the writer puts the
frame in a new memfd, seals it (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE |
F_SEAL_SEAL``), sends it on the socket in one 9-byte message (``F`` + u64 length) with
the fd, and only then writes an OVERFLOW marker in the ring, in order with the records
around it. The reader, on the marker, takes the next frame already received from the
socket (it drains the socket whenever it is readable, without blocking); a marker with
no frame waiting is a protocol fault. Why a memfd and not the bytes on the socket: the
socket then carries a few bytes per frame, however large the frame, so no frame can fill
the socket buffer and wait for a reader that waits for the doorbell (a frame larger
than the socket buffer deadlocked both sides); and the reader never waits for a frame
that a stopped or hostile writer announced but did not send. The cost, one memfd
per frame over half a ring (512 KiB by default), is small beside the frame's copy.

Full rings
----------
Engine → frontend: a record that does not fit is dropped and counted, and its topic's
sequence number still advances, so the frontend sees the gap and fails the requests it
concerns (as with ZeroMQ PUB at its high-water mark); the engine never waits.
Frontend → engine: the frontend's sender waits for room up to the message's deadline,
then raises :class:`RingFull`. Bytes in a ring that do not form a record are counted and
skipped; anything else a peer does against the protocol raises :class:`PeerFault`, and
the side that sees it drops that one connection.

The doorbell carries no data: it only says "look at tail". A reader drains it before it
reads, so a ring that races with a read leaves the doorbell set, never a record unseen.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass

from shared.shm_ring import (fds_of, BROADCAST, DATA, DATA_KIND, FRAME_SEALS, HEAD, OVERFLOW_KIND, OWN, REC_SIZE, TAIL,
                             WRAP_KIND, PeerFault, PeerGone, Ring, RingFull, fence, require_seals, sealed_memfd)

log = logging.getLogger(__name__)

SOCKET_NAME = "shm.sock"
HELLO = b"tickserve-shm 2 "
WELCOME = b"tickserve-shm 2"
REFUSED = b"refused: "
OUTBOUND_BYTES = 4 << 20  # engine → frontend ring (the default; frontend → engine gets a quarter)
MAX_SOCKET_FRAME = 16 << 20  # codec.MAX_FRAME_BYTES: no frame is larger
MAX_PENDING_FRAMES = 8  # overflow frames received and not yet claimed by a marker
HANDSHAKE_TIMEOUT_S = 1.0
FRAME_MSG = struct.Struct("<cQ")  # b"F", length: the message that carries a frame's memfd
_FDS_SPACE = socket.CMSG_SPACE(8 * array.array("i").itemsize)


def available() -> str | None:
    """Why this host cannot use the shared-memory carrier, or ``None`` if it can."""
    if not hasattr(os, "memfd_create") or not hasattr(os, "eventfd") or not hasattr(socket, "send_fds"):
        return "needs Linux with Python 3.10+ (memfd_create, eventfd, send_fds)"
    try:
        fence()
    except RuntimeError as exc:
        return str(exc)
    return None


def socket_path(run_dir: str) -> str:
    return os.path.join(run_dir, SOCKET_NAME)


def ring_doorbell(fd: int) -> None:
    try:
        os.eventfd_write(fd, 1)
    except BlockingIOError:  # the counter is saturated: the reader has plenty to look at
        pass


def drain_doorbell(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


def recv_message(sock: socket.socket, size: int = 4096) -> tuple[bytes, list[int]] | None:
    """One whole message and the fds it carried, without blocking; ``None`` when none is
    waiting. Raises :class:`PeerGone` at end of file and :class:`PeerFault` when the
    message or its fds did not fit (the fds received are closed)."""
    try:
        msg, ancdata, flags, _ = sock.recvmsg(size, _FDS_SPACE, socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as exc:
        raise PeerGone(str(exc)) from None
    fds = fds_of(ancdata)
    if not msg and not fds:
        raise PeerGone("the peer closed its socket")
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        close_all(fds)
        raise PeerFault("a socket message larger than any the protocol sends")
    return msg, fds


def close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def send_frame_fd(sock: socket.socket, payload: bytes) -> None:
    """Send ``payload`` as a sealed memfd of its own (see the module doc), without
    blocking. Raises ``BlockingIOError`` when the socket has no room for even that
    message, ``OSError`` otherwise."""
    fd = sealed_memfd("tickserve-frame", len(payload), payload, FRAME_SEALS)
    try:
        sock.sendmsg([FRAME_MSG.pack(b"F", len(payload))],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], socket.MSG_DONTWAIT)
    finally:
        os.close(fd)


def _read_frame_fd(msg: bytes, fds: list[int]) -> bytes:
    """The frame a ``F`` message carried (its fd closed). Raises :class:`PeerFault`."""
    try:
        if len(msg) != FRAME_MSG.size or len(fds) != 1 or msg[:1] != b"F":
            raise PeerFault(f"a socket message that is not a frame ({len(msg)} bytes, {len(fds)} fds)")
        (_, n) = FRAME_MSG.unpack(msg)
        if n > MAX_SOCKET_FRAME:
            raise PeerFault(f"a frame of {n} bytes: not a tickserve peer")
        require_seals(fds[0], FRAME_SEALS, "a frame's memfd")
        if os.fstat(fds[0]).st_size != n:
            raise PeerFault("a frame's memfd is not the size announced")
        chunks, got = [], 0
        while got < n:
            chunk = os.pread(fds[0], min(n - got, 1 << 22), got)
            if not chunk:
                raise PeerFault("a frame's memfd ended early")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise PeerFault(f"a frame's memfd could not be read: {exc}") from None
    finally:
        close_all(fds)


class SocketFrames:
    """The socket beside the rings, read side: frames (memfds) received ahead of their
    markers, and end of file. Used by the one thread that reads the rings."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.frames: deque[bytes] = deque()

    def drain(self) -> None:
        """Take every message waiting. Raises :class:`PeerGone` at end of file,
        :class:`PeerFault` for anything but a frame, or too many frames unclaimed."""
        while True:
            got = recv_message(self.sock, 64)
            if got is None:
                return
            self.frames.append(_read_frame_fd(*got))
            if len(self.frames) > MAX_PENDING_FRAMES:
                raise PeerFault(f"more than {MAX_PENDING_FRAMES} frames on the socket without their markers")

    def claim(self) -> bytes:
        """The frame an OVERFLOW marker stands for. Raises :class:`PeerFault` when none
        is waiting: its sender puts it on the socket before the marker in the ring."""
        if not self.frames:
            self.drain()
        if not self.frames:
            raise PeerFault("an overflow marker with no frame on the socket")
        return self.frames.popleft()


# ---------------------------------------------------------------- engine side


@dataclass
class Counters:
    frames_in: int = 0
    frames_out: int = 0
    dropped: int = 0  # outbound frames dropped on a full ring (or a full socket, for overflow frames)
    overflow_in: int = 0
    overflow_out: int = 0


def parse_hello(msg: bytes) -> str:
    """The frontend id of a handshake message. Raises ``ValueError`` saying what is wrong."""
    if not msg.startswith(HELLO):
        raise ValueError("not a tickserve shared-memory handshake")
    try:
        frontend_id = msg[len(HELLO):].decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the frontend id is not UTF-8") from None
    if not (1 <= len(frontend_id) <= 256) or not frontend_id.isprintable():
        raise ValueError("bad frontend id")
    return frontend_id


def refuse(sock: socket.socket, reason: str) -> None:
    """Tell a connecting peer why it is refused (best effort, never blocks) and close."""
    try:
        sock.send(REFUSED + reason.encode()[:1000], socket.MSG_DONTWAIT)
    except OSError:
        pass
    sock.close()


class ShmPeer:
    """The engine's end of one frontend's connection (I/O thread only). Nothing here
    blocks, and :meth:`publish` never raises: a fault it meets is kept in ``failure`` for
    the owner to retire the peer."""

    def __init__(self, sock: socket.socket, frontend_id: str, epoch: int, outbound_bytes: int = OUTBOUND_BYTES):
        self.sock = sock
        self.frontend_id = frontend_id
        self.closed = False
        self.failure: str | None = None
        self.inbound = self.outbound = None
        self.in_bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # frontend rings the engine
        self.out_bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # engine rings the frontend
        fds = []
        try:
            self.inbound, in_fd = Ring.create("tickserve-ring-in", max(1 << 12, outbound_bytes // 4), epoch)
            fds.append(in_fd)
            self.outbound, out_fd = Ring.create("tickserve-ring-out", outbound_bytes, epoch)
            fds.append(out_fd)
            socket.send_fds(sock, [WELCOME], [in_fd, out_fd, self.in_bell, self.out_bell], socket.MSG_DONTWAIT)
        except BaseException:
            self.close()
            raise
        finally:
            close_all(fds)  # the mappings keep the memory; the frontend holds its own fds
        self._socket = SocketFrames(sock)
        self.counters = Counters()
        self._seq = {OWN: 0, BROADCAST: 0}

    @property
    def fds(self) -> tuple[int, int]:
        """What the I/O thread polls: the inbound doorbell and the socket (EOF, overflow frames)."""
        return self.in_bell, self.sock.fileno()

    def publish(self, broadcast: bool, payload: bytes) -> bool:
        """Send one frame to this frontend; ``False`` if it was dropped (ring or socket
        full) or the peer has failed. Never blocks, never raises."""
        if self.failure is not None or self.closed:
            return False
        topic = BROADCAST if broadcast else OWN
        seq = self._seq[topic]
        self._seq[topic] = seq + 1
        ok = False
        try:
            if self.outbound.fits(len(payload)):
                ok = self.outbound.try_write(DATA_KIND, topic, seq, payload)
            elif self.outbound.has_room(0):  # the marker's room first: once the frame is sent, it must follow
                send_frame_fd(self.sock, payload)
                ok = self.outbound.try_write(OVERFLOW_KIND, topic, seq, b"")
                self.counters.overflow_out += 1
        except PeerFault as exc:
            self.failure = str(exc)
        except OSError:  # the socket's buffer is full (the frontend is not reading), or no memfd: drop
            ok = False
        except Exception as exc:  # noqa: BLE001 - anything else about this peer is this peer's failure
            self.failure = f"{type(exc).__name__}: {exc}"
        if not ok:
            self.counters.dropped += 1
            return False
        self.counters.frames_out += 1
        ring_doorbell(self.out_bell)
        return True

    def receive(self, deadline: float, max_frames: int = 256) -> list[bytes]:
        """Frames from the inbound ring (with their overflow frames) until it is empty,
        ``max_frames`` were read or ``deadline`` (monotonic) passes. Raises
        :class:`PeerGone` when the frontend left, :class:`PeerFault` when it broke the
        protocol."""
        drain_doorbell(self.in_bell)
        frames = []
        while len(frames) < max_frames and time.monotonic() < deadline:
            rec = self.inbound.read()
            if rec is None:
                break
            kind, _, _, payload = rec
            if kind == OVERFLOW_KIND:
                payload = self._socket.claim()
                self.counters.overflow_in += 1
            frames.append(payload)
        self.counters.frames_in += len(frames)
        if self.inbound.pending():
            ring_doorbell(self.in_bell)  # cut short: come back for the rest after the heartbeat check
        return frames

    def check_socket(self) -> None:
        """The socket is readable: take the frames waiting there. Raises
        :class:`PeerGone` at end of file, :class:`PeerFault` for anything but frames."""
        self._socket.drain()

    def stats(self) -> dict:
        return {"carrier": "shm", "dropped": self.counters.dropped, "overflow_in": self.counters.overflow_in,
                "overflow_out": self.counters.overflow_out,
                "bad_records": self.inbound.bad_records if self.inbound is not None else 0,
                "frames_in": self.counters.frames_in, "frames_out": self.counters.frames_out}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        closers = [ring.close for ring in (self.inbound, self.outbound) if ring is not None]
        for closer in closers + [self.sock.close, lambda: os.close(self.in_bell), lambda: os.close(self.out_bell)]:
            try:
                closer()
            except OSError:
                pass


class ShmListener:
    """The engine's unix socket in its run directory (I/O thread): accepts connections,
    without blocking; the handshake that follows is the caller's (it reads the hello
    with :func:`recv_message` and :func:`parse_hello`, then makes a :class:`ShmPeer`)."""

    def __init__(self, run_dir: str, epoch: int, ring_bytes: int = OUTBOUND_BYTES):
        self.path = socket_path(run_dir)
        self.epoch = epoch
        self.ring_bytes = ring_bytes
        if os.path.exists(self.path):  # left by a dead engine: the caller holds the run directory's lock
            os.unlink(self.path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self.sock.listen(64)
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> socket.socket | None:
        """One new connection, non-blocking, or ``None`` if none is waiting. Raises
        ``OSError`` (out of fds, ...)."""
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        conn.setblocking(False)
        return conn

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


__all__ = ["Ring", "ShmListener", "ShmPeer", "RingFull", "PeerGone", "PeerFault", "available",
           "fence", "socket_path", "parse_hello", "refuse", "recv_message", "send_frame_fd", "DATA", "HEAD",
           "TAIL", "REC_SIZE", "WRAP_KIND"]
