"""The frontend's end of a shared-memory connection to an engine (the handshake, the
two rings, the doorbells and the socket are described in :mod:`shared.shm`)."""

from __future__ import annotations

import os
import select
import socket
import time

from shared.shm import (HELLO, REFUSED, WELCOME, SocketFrames, close_all, drain_doorbell, ring_doorbell,
                        send_frame_fd, socket_path)
from shared.shm_ring import DATA_KIND, OVERFLOW_KIND, OWN, PeerFault, PeerGone, Ring, RingFull


class ShmChannel:
    """A frontend's (or a script's) end: implements :class:`shared.transport.Client`.

    ``connect()`` runs the handshake; until then, and after the engine is gone, ``send``
    raises :class:`PeerGone` and ``recv`` returns nothing. ``recv`` raises
    :class:`shared.transport.SequenceGap` when frames were lost, :class:`PeerGone` when
    the engine died (at once: its socket closes) and :class:`PeerFault` when the engine's
    end broke the protocol (a ring index out of range, ...): the caller then disconnects
    and connects again. Sends come from one thread, ``poll``/``recv`` from one (possibly
    other) thread; the caller keeps ``connect``/``disconnect`` and sends apart (a lock)."""

    carrier = "shm"

    def __init__(self, run_dir: str, frontend_id: str, topic: bytes, broadcast: bytes | None):
        self.path = socket_path(run_dir)
        self.frontend_id = frontend_id
        self.topic, self.broadcast = topic, broadcast
        self.sock: socket.socket | None = None
        self.inbound: Ring | None = None  # engine → us
        self.outbound: Ring | None = None  # us → engine
        self.in_bell = self.out_bell = -1
        self.refusal: str | None = None  # why the engine refused the last handshake, if it did
        self.connections = 0  # handshakes that succeeded: a new one means a new connection
        self._expected: dict[int, int] = {}
        self._poller = None
        self._socket: SocketFrames | None = None
        self._sock_readable = False

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def connect(self, timeout: float = 2.0) -> bool:
        """Handshake with the engine at the run directory (closing any old connection
        first); ``False`` if none answers or it refused (``refusal`` says why)."""
        self.disconnect()
        self.refusal = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        fds: list[int] = []
        try:
            sock.connect(self.path)
            sock.send(HELLO + self.frontend_id.encode())
            msg, fds, _, _ = socket.recv_fds(sock, 1024, 4)
            if msg.startswith(REFUSED):
                self.refusal = msg[len(REFUSED):].decode("utf-8", "replace")
                raise PeerFault(self.refusal)
            if msg != WELCOME or len(fds) != 4:
                raise PeerFault("not a tickserve engine's handshake")
            out_fd, in_fd, out_bell, in_bell = fds  # the engine's "in" is our "out"
            outbound = Ring(out_fd)
            try:
                inbound = Ring(in_fd)
            except BaseException:
                outbound.close()
                raise
        except (OSError, PeerGone):
            close_all(fds)
            sock.close()
            return False
        close_all([out_fd, in_fd])
        sock.settimeout(None)  # blocking mode; every later call says MSG_DONTWAIT
        self.sock, self.outbound, self.inbound, self.out_bell, self.in_bell = sock, outbound, inbound, out_bell, in_bell
        self._socket = SocketFrames(sock)
        self._expected.clear()
        self._poller = select.poll()
        self._poller.register(self.in_bell, select.POLLIN)
        self._poller.register(sock.fileno(), select.POLLIN)
        self._sock_readable = False
        self.connections += 1
        return True

    def send(self, msg, timeout_ms: int = 1000) -> None:
        """Send one message; waits for room up to ``timeout_ms`` (then :class:`RingFull`)."""
        from shared import codec

        self.send_frame(codec.encode(msg), timeout_ms)

    def send_frame(self, payload: bytes, timeout_ms: int = 1000) -> None:
        """One frame into the ring, or as its own memfd with a marker in the ring when it is
        larger than half the ring. Waits (sleeping) up to ``timeout_ms`` for room, then
        raises :class:`RingFull`; :class:`PeerGone` when not connected, :class:`PeerFault`
        when the engine's head is out of range."""
        if self.sock is None:
            raise PeerGone("not connected to an engine")
        ring = self.outbound
        overflow = not ring.fits(len(payload))
        deadline = time.monotonic() + timeout_ms / 1000
        pause = 0.0002
        while True:
            if overflow:
                if ring.has_room(0):
                    try:
                        send_frame_fd(self.sock, payload)  # the frame first, then its marker
                    except BlockingIOError:
                        pass  # the engine has not drained the socket yet
                    except OSError as exc:
                        raise PeerGone(str(exc)) from None
                    else:
                        ring.try_write(OVERFLOW_KIND, OWN, 0, b"")
                        break
            elif ring.try_write(DATA_KIND, OWN, 0, payload):
                break
            if time.monotonic() >= deadline:
                raise RingFull("the engine is not taking messages")
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        ring_doorbell(self.out_bell)

    def poll(self, timeout_ms: int) -> bool:
        """Wait for the doorbell (or the socket: the engine left, or a frame came) at most
        ``timeout_ms``; at once when records are already waiting. The doorbell is drained
        here, once per wake-up, not per record. Raises :class:`PeerFault`."""
        if self.sock is None:
            time.sleep(timeout_ms / 1000)
            return False
        if self.inbound.pending():
            return True
        events = self._poller.poll(timeout_ms)
        for fd, _ in events:
            if fd == self.in_bell:
                drain_doorbell(fd)
            else:
                self._sock_readable = True
        return bool(events)

    def recv(self):
        """One message, or ``None`` if nothing is waiting (non-blocking)."""
        from shared import codec
        from shared.transport import Received, SequenceGap

        if self.sock is None:
            return None
        if self._sock_readable:
            self._sock_readable = False
            self._socket.drain()
        rec = self.inbound.read()
        if rec is None:
            return None
        kind, topic, seq, payload = rec
        if kind == OVERFLOW_KIND:
            payload = self._socket.claim()
        expected = self._expected.get(topic)
        self._expected[topic] = seq + 1
        name = self.topic if topic == OWN else (self.broadcast or b"")
        if expected is not None and seq != expected:
            raise SequenceGap(name, expected, seq)
        return Received(name, codec.decode(payload, "frontend"))

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
        self._socket = None

    def close(self) -> None:
        self.disconnect()

    @property
    def bad_records(self) -> int:
        return self.inbound.bad_records if self.inbound is not None else 0
