"""How a handover travels from a prefill engine to a decode engine
(``PREFILL_MODE=disaggregated``; the frames are :mod:`shared.handover_wire`).

On one host: a unix ``SOCK_SEQPACKET`` socket, ``<run_dir>/handover.sock``, in the
decode engine's run directory. Each handover is **one sealed memfd** holding the
metadata frame then, at the next 4 KiB boundary, the raw KV bytes; the socket message
is ``H`` + u64 metadata length + u64 KV length, with the fd by ``SCM_RIGHTS``. The
sender writes the memfd once (the KV straight from the cache blocks into its mapping),
seals it (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL``) and closes its
copy; the receiver checks the seals and the size before it maps it read-only, so the
bytes it validates are the bytes it copies in, whatever the sender does afterwards.
Nothing is pickled and nothing has a name: ``kill -9`` of either side leaves nothing
behind. Every other message (both ways) is ``M`` + one msgpack frame.

A fresh memfd costs a page fault per 4 KiB on both sides (on a loaded 2-core host, a
1,000-token row's 23 MB took 0.1–0.3 s), so each connection also has a **staging area**:
one memfd the prefill engine creates at connect (sealed against shrinking and growing,
so the decode engine's read-only mapping can never fault past its end) and passes once
(``S`` + u64 size, with the fd). A handover that fits is written there (``P`` + u64
offset + u64 metadata length + u64 KV length); the decode engine copies the metadata
out before it decodes it, and frees the room with ``KVReleased`` once the KV is in its
blocks (or the row was refused). The pages stay mapped, so later handovers pay no
faults. The KV bytes there are not write-sealed: a prefill engine that scribbled on
them could only spoil its own row's tokens, never the decode engine's bookkeeping
(every size and offset is checked against the area). A handover that does not fit
takes a sealed memfd of its own.

Across hosts: ZeroMQ, the decode engine's ROUTER at ``--handover-addr tcp://…`` and a
DEALER per prefill engine; a handover is the multipart ``[b"H", metadata, kv]``, any
other message ``[b"M", frame]``. The same validation applies.

Both ends are driven by one thread each: the prefill side by the engine's tick thread
(:class:`~shared.handover_client.HandoverClient`, never blocking), the decode side by a
listener thread (:class:`HandoverServer`, whose replies other threads queue with
:meth:`HandoverServer.reply`).
"""

from __future__ import annotations

import array
import fcntl
import mmap
import os
import queue
import socket
import struct
from dataclasses import dataclass
import zmq

from shared import handover_wire as hw
from shared.codec import DecodeError
from shared.shm_ring import FRAME_SEALS, PeerFault, fds_of, require_seals

SOCKET_NAME = "handover.sock"
HEADER = struct.Struct("<cQQ")  # b"H", metadata bytes, KV bytes
STAGED = struct.Struct("<cQQQ")  # b"P", offset in the staging area, metadata bytes, KV bytes
STAGING = struct.Struct("<cQ")  # b"S", the staging area's size (its fd beside)
STAGING_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
ALIGN = 4096
_FDS_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)
MAX_SMALL = 1 << 20  # an "M" message on the socket


def socket_path(run_dir: str) -> str:
    return os.path.join(run_dir, SOCKET_NAME)


def kv_offset(meta_len: int) -> int:
    """Where the KV bytes start after ``meta_len`` bytes of metadata (the next 4 KiB)."""
    return -(-meta_len // ALIGN) * ALIGN


@dataclass
class Received:
    """One message a decode engine received: ``msg`` (a Handover or HandoverAbort); for a
    handover, ``payload``, a read-only view of its KV bytes (its mapping goes when the
    last reference does). ``peer`` names the connection to reply on."""

    peer: object
    msg: object
    payload: memoryview | None = None


class HandoverServer:
    """The decode engine's end: the run directory's socket and, optionally, a tcp ROUTER.

    :meth:`poll` (one thread) accepts connections (each is greeted with ``hello``),
    receives and validates messages, and sends the replies queued by :meth:`reply`.
    Bad messages are counted in ``bad`` with the last reason in ``last_bad``, never raised.
    """

    def __init__(self, hello: hw.DecodeHello, run_dir: str = "", tcp_addr: str = "",
                 max_kv_bytes: int = 1 << 30, ctx: zmq.Context | None = None):
        self.hello = hw.encode(hello)
        self.max_kv_bytes = max_kv_bytes
        self.bad = 0
        self.last_bad = ""
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._conns: dict[int, socket.socket] = {}
        self._staging: dict[int, memoryview] = {}  # connection → its staging area (read-only)
        self._poller = zmq.Poller()
        self._listener = None
        if run_dir:
            path = socket_path(run_dir)
            if os.path.exists(path):
                os.unlink(path)
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._listener.bind(path)
            self._listener.listen(64)
            self._listener.setblocking(False)
            self._poller.register(self._listener.fileno(), zmq.POLLIN)
        self._router = None
        if tcp_addr:
            self._router = (ctx or zmq.Context.instance()).socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.MAXMSGSIZE, max_kv_bytes + hw.MAX_META_BYTES)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self._router.bind(tcp_addr)
            self._poller.register(self._router, zmq.POLLIN)
        self._tcp_peers: set[bytes] = set()

    def reply(self, peer, msg) -> None:
        """Queue ``msg`` for ``peer`` (thread-safe; sent by the next :meth:`poll`)."""
        self._replies.put((peer, hw.encode(msg)))

    def reply_all(self, msg) -> None:
        """Queue ``msg`` for every connected prefill engine (thread-safe)."""
        self._replies.put((None, hw.encode(msg)))

    def poll(self, timeout_ms: int = 5) -> list[Received]:
        self._flush_replies()
        out: list[Received] = []
        for item, _ in self._poller.poll(timeout_ms):
            if self._listener is not None and item == self._listener.fileno():
                self._accept()
            elif item is self._router:
                self._recv_tcp(out)
            else:
                self._recv_unix(item, out)
        return out

    def _bad(self, why: str) -> None:
        self.bad += 1
        self.last_bad = why

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(False)
        try:
            conn.send(b"M" + self.hello)
        except OSError:
            conn.close()
            return
        self._conns[conn.fileno()] = conn
        self._poller.register(conn.fileno(), zmq.POLLIN)

    def _drop(self, fd: int) -> None:
        self._staging.pop(fd, None)  # held rows keep their views; the mapping goes with the last
        conn = self._conns.pop(fd, None)
        if conn is not None:
            self._poller.unregister(fd)
            conn.close()

    def _recv_unix(self, fd: int, out: list[Received]) -> None:
        conn = self._conns.get(fd)
        if conn is None:
            return
        for _ in range(64):
            try:
                data, ancdata, flags, _ = conn.recvmsg(MAX_SMALL, _FDS_SPACE, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(fd)
                return
            fds = fds_of(ancdata)
            if not data and not fds:  # end of file: the prefill engine went away
                self._drop(fd)
                return
            try:
                if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    raise PeerFault("a socket message larger than the protocol sends")
                if data[:1] == b"H":
                    taken, fds = fds, []
                    out.append(self._handover_fd(fd, data, taken))
                elif data[:1] == b"P" and not fds:
                    out.append(self._handover_staged(fd, data))
                elif data[:1] == b"S":
                    taken, fds = fds, []
                    self._map_staging(fd, data, taken)
                elif data[:1] == b"M" and not fds:
                    out.append(Received(fd, hw.decode(data[1:], "decode")))
                else:
                    raise PeerFault(f"a socket message that is no handover message ({len(data)} bytes, "
                                    f"{len(fds)} fds)")
            except (PeerFault, DecodeError) as exc:
                self._bad(str(exc))
            finally:
                for f in fds:
                    os.close(f)

    def _handover_fd(self, peer, data: bytes, fds: list[int]) -> Received:
        """The handover an ``H`` message's memfd holds; closes ``fds``. Raises PeerFault, DecodeError."""
        if len(data) != HEADER.size or len(fds) != 1:
            for f in fds:
                os.close(f)
            raise PeerFault(f"a handover message of {len(data)} bytes with {len(fds)} fds")
        fd = fds[0]
        try:
            _, meta_len, kv_len = HEADER.unpack(data)
            if meta_len > hw.MAX_META_BYTES or kv_len > self.max_kv_bytes:
                raise PeerFault(f"a handover of {meta_len} + {kv_len} bytes exceeds the limits")
            require_seals(fd, FRAME_SEALS, "a handover's memfd")
            size = kv_offset(meta_len) + kv_len
            if os.fstat(fd).st_size != size:
                raise PeerFault("a handover's memfd is not the size announced")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
        if mm is None:
            raise PeerFault("an empty handover")
        view = memoryview(mm)
        msg = hw.decode(view[:meta_len], "decode")
        if not isinstance(msg, hw.Handover):
            raise PeerFault("a memfd that holds no handover")
        return Received(peer, msg, view[kv_offset(meta_len): kv_offset(meta_len) + kv_len])

    def _map_staging(self, peer: int, data: bytes, fds: list[int]) -> None:
        """A connection's staging area (once). Closes ``fds``. Raises PeerFault."""
        try:
            if len(data) != STAGING.size or len(fds) != 1 or peer in self._staging:
                raise PeerFault(f"a staging message of {len(data)} bytes with {len(fds)} fds")
            _, size = STAGING.unpack(data)
            if not 0 < size <= 4 * self.max_kv_bytes:
                raise PeerFault(f"a staging area of {size} bytes")
            require_seals(fds[0], STAGING_SEALS & ~fcntl.F_SEAL_SEAL, "a staging memfd")
            if os.fstat(fds[0]).st_size != size:
                raise PeerFault("a staging memfd is not the size announced")
            self._staging[peer] = memoryview(mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ))
        finally:
            for f in fds:
                os.close(f)

    def _handover_staged(self, peer: int, data: bytes) -> Received:
        area = self._staging.get(peer)
        if area is None or len(data) != STAGED.size:
            raise PeerFault("a staged handover without a staging area")
        _, off, meta_len, kv_len = STAGED.unpack(data)
        end = off + kv_offset(meta_len) + kv_len
        if meta_len > hw.MAX_META_BYTES or kv_len > self.max_kv_bytes or end > len(area):
            raise PeerFault(f"a staged handover at {off} of {meta_len} + {kv_len} bytes outside its area")
        msg = hw.decode(bytes(area[off: off + meta_len]), "decode")  # a copy: the sender can still write there
        if not isinstance(msg, hw.Handover):
            raise PeerFault("a staged message that is no handover")
        return Received(peer, msg, area[off + kv_offset(meta_len): end])

    def _recv_tcp(self, out: list[Received]) -> None:
        for _ in range(64):
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = parts[0].bytes
            if ident not in self._tcp_peers:  # its first message: greet it (it waits for the layout)
                self._tcp_peers.add(ident)
                self._router.send_multipart([ident, b"M", self.hello])
            try:
                kind = parts[1].bytes if len(parts) > 1 else b""
                if kind == b"H" and len(parts) == 4:
                    msg = hw.decode(parts[2].buffer, "decode")
                    if not isinstance(msg, hw.Handover):
                        raise PeerFault("a handover message holds no handover")
                    out.append(Received(ident, msg, parts[3].buffer))
                elif kind == b"M" and len(parts) == 3:
                    if len(parts[2].bytes):
                        out.append(Received(ident, hw.decode(parts[2].buffer, "decode")))
                else:
                    raise PeerFault(f"a message of {len(parts) - 1} parts that is no handover message")
            except (PeerFault, DecodeError) as exc:
                self._bad(str(exc))

    def _flush_replies(self) -> None:
        while True:
            try:
                peer, frame = self._replies.get_nowait()
            except queue.Empty:
                return
            if peer is None:
                for p in list(self._conns) + list(self._tcp_peers):
                    self._send_reply(p, frame)
                continue
            self._send_reply(peer, frame)

    def _send_reply(self, peer, frame: bytes) -> None:
            try:
                if isinstance(peer, bytes):
                    self._router.send_multipart([peer, b"M", frame], zmq.NOBLOCK)
                elif peer in self._conns:
                    self._conns[peer].send(b"M" + frame, socket.MSG_DONTWAIT)
            except (OSError, zmq.ZMQError):
                pass  # it went away: its rows' fate is the prefill engine's to report

    def close(self) -> None:
        for fd in list(self._conns):
            self._drop(fd)
        if self._listener is not None:
            path = self._listener.getsockname()
            self._listener.close()
            try:
                os.unlink(path)
            except OSError:
                pass
        if self._router is not None:
            self._router.close(0)


