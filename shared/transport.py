"""The engine ⇄ frontend transport, behind one small interface.

Two channels, whatever the carrier:

* inbound to the engine: many writers (frontends, client scripts) → one reader.
  ZeroMQ PUSH (connect) → PULL (bind).
* outbound from the engine: one writer → many readers, each reading its own topic
  (its frontend id) and the broadcast topic. ZeroMQ PUB (bind) → SUB (connect).

Outbound frames are ``[topic, seq (8 bytes, big endian), payload]``; ``seq`` counts
per topic from 0, so a reader detects a lost frame (PUB drops when a subscriber's
high-water mark is full) as a gap and fails the affected requests loudly.
Addresses are ``ipc://path`` (default) or ``tcp://host:port``: same code path.

The seam is three small protocols — :class:`Inbound`, :class:`Outbound`,
:class:`Client` — implemented here over ZeroMQ and in :mod:`shared.shm` over shared
memory (one ring pair per frontend on the engine's host). One engine serves both at
once: :class:`RoutedOutbound` sends a frontend's frames by the carrier it connected
with, and broadcast frames by both. Sockets are not thread-safe: each object here is
used from one thread.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from shared import codec

log = logging.getLogger(__name__)

# High-water marks, in messages. The engine's PUB must never block the tick loop:
# it drops instead, which the per-topic sequence numbers turn into a loud failure.
PUB_SNDHWM = 100_000
SUB_RCVHWM = 100_000
PUSH_SNDHWM = 10_000
PULL_RCVHWM = 100_000


def topic_for(frontend_id: str) -> bytes:
    """PUB topic of a frontend: its id plus a terminator, so no id is a prefix of another's."""
    return frontend_id.encode() + b"\x00"


class SequenceGap(Exception):
    """Frames were lost on a topic: ``expected`` was due, ``got`` arrived."""

    def __init__(self, topic: bytes, expected: int, got: int):
        super().__init__(f"topic {topic!r}: expected seq {expected}, got {got}")
        self.topic, self.expected, self.got = topic, expected, got


def ipc_path(addr: str) -> str | None:
    return addr[len("ipc://"):] if addr.startswith("ipc://") else None


def bind_address(addr: str) -> str:
    """Where to bind: ``tcp://:PORT`` (no host) means loopback, ``tcp://127.0.0.1:PORT``;
    reaching other hosts takes an explicit host (``tcp://0.0.0.0:PORT``)."""
    if addr.startswith("tcp://:"):
        return "tcp://127.0.0.1:" + addr[len("tcp://:"):]
    return addr


class AddressInUse(RuntimeError):
    """Another engine already serves this address (or run directory)."""


class AddressLock:
    """An exclusive ``flock(2)`` on ``<socket path>.lock`` beside an ``ipc://`` socket,
    held for the engine's lifetime: a second engine on the same run directory fails at
    start instead of taking over the socket files (ZeroMQ would unlink and rebind them,
    cutting the first engine off). The kernel drops the lock when the holder dies, even
    by ``kill -9``. ``tcp://`` needs none: a second bind fails by itself."""

    def __init__(self, addr: str):
        self.addr = addr
        self.path = ipc_path(addr) + ".lock" if ipc_path(addr) else None
        self._fd: int | None = None
        if self.path is None:
            return
        import fcntl

        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AddressInUse(f"another engine is serving {addr} (its lock {self.path} is held)") from None
        self._fd = fd

    def release(self) -> None:
        """Remove the socket file and the lock file, then drop the lock (idempotent)."""
        if self._fd is None:
            return
        for path in (ipc_path(self.addr), self.path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        os.close(self._fd)
        self._fd = None


def _bind(sock: zmq.Socket, addr: str) -> None:
    path = ipc_path(addr)
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    addr = bind_address(addr)
    host = addr[len("tcp://"):].rsplit(":", 1)[0] if addr.startswith("tcp://") else ""
    if host and host not in ("127.0.0.1", "localhost", "[::1]"):
        log.warning("binding %s: reachable from other hosts (the engine has no authentication)", addr)
    try:
        sock.bind(addr)
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EADDRINUSE:
            raise AddressInUse(f"{addr} is already in use (another engine?)") from None
        raise


class Inbound(Protocol):
    """Engine side of the inbound channel: many writers, one reader."""

    sock: zmq.Socket  # what the engine's I/O thread polls (a ZeroMQ socket or a wake-up socket)

    def recv_frame(self) -> bytes | None: ...

    def close(self) -> None: ...


class Outbound(Protocol):
    """Engine side of the outbound channel: one writer, a topic per reader."""

    def publish(self, topic: bytes, msg: Any) -> None: ...

    def publish_frame(self, topic: bytes, payload: bytes) -> None: ...

    def forget(self, topic: bytes) -> None: ...

    def close(self) -> None: ...


class Client(Protocol):
    """Frontend / client-script side of both channels. ``carrier`` names it ("zmq",
    "shm"); ``connect`` (re)establishes a connection where the carrier needs one."""

    carrier: str
    connected: bool

    def connect(self, timeout: float = 2.0) -> bool: ...

    def disconnect(self) -> None: ...

    def send(self, msg: Any, timeout_ms: int = 1000) -> None: ...

    def poll(self, timeout_ms: int) -> bool: ...

    def recv(self) -> "Received | None": ...

    def reset_sequence(self) -> None: ...

    def close(self) -> None: ...


class EngineInbound:
    """Engine side of the inbound channel (PULL, bound)."""

    def __init__(self, ctx: zmq.Context, addr: str):
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, PULL_RCVHWM)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, codec.MAX_FRAME_BYTES)
        _bind(self.sock, addr)
        self.addr = addr

    def recv_frame(self) -> bytes | None:
        """One raw frame, or ``None`` if nothing is waiting (non-blocking)."""
        try:
            parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return None
        return parts[-1] if len(parts) == 1 else b"".join(parts)  # multipart → garbage

    def close(self) -> None:
        self.sock.close(0)


class EngineOutbound:
    """Engine side of the outbound channel (PUB, bound). Assigns per-topic seq."""

    def __init__(self, ctx: zmq.Context, addr: str):
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, PUB_SNDHWM)
        self.sock.setsockopt(zmq.LINGER, 0)
        _bind(self.sock, addr)
        self.addr = addr
        self._seq: dict[bytes, int] = {}

    def publish(self, topic: bytes, msg: Any) -> None:
        self.publish_frame(topic, codec.encode(msg))

    def publish_frame(self, topic: bytes, payload: bytes) -> None:
        seq = self._seq.get(topic, 0)
        self._seq[topic] = seq + 1
        self.sock.send_multipart([topic, seq.to_bytes(8, "big"), payload], copy=False)

    def forget(self, topic: bytes) -> None:
        """Drop a departed frontend's sequence counter."""
        self._seq.pop(topic, None)

    def close(self) -> None:
        self.sock.close(0)


class RoutedOutbound:
    """The engine's outbound side over every carrier: frames for a frontend connected by
    shared memory go to its ring, the rest to the PUB socket; broadcast frames to both.
    Each carrier keeps its own per-topic sequence numbers. A shared-memory peer's
    ``publish`` never blocks or raises: a full ring drops, and a fault is kept on the peer
    for the engine to retire it (``engine_proc/shm_frontends.py``)."""

    def __init__(self, pub: EngineOutbound):
        self.pub = pub
        self.addr = pub.addr
        self.shm_peers: dict[bytes, Any] = {}  # topic → shared.shm.ShmPeer

    def publish(self, topic: bytes, msg: Any) -> None:
        self.publish_frame(topic, codec.encode(msg))

    def publish_frame(self, topic: bytes, payload: bytes) -> None:
        peer = self.shm_peers.get(topic)
        if peer is not None:
            peer.publish(False, payload)
            return
        self.pub.publish_frame(topic, payload)
        if topic == BROADCAST:
            for peer in self.shm_peers.values():
                peer.publish(True, payload)

    def forget(self, topic: bytes) -> None:
        self.pub.forget(topic)

    def close(self) -> None:
        self.pub.close()


BROADCAST = b"*"  # shared.protocol.BROADCAST_TOPIC (kept here so transport imports no protocol)


@dataclass
class Received:
    topic: bytes
    msg: Any


class ClientChannel:
    """Frontend / client-script side: PUSH to the engine, SUB to its own topic and the
    broadcast topic. ``recv`` raises :class:`SequenceGap` when frames were lost."""

    carrier = "zmq"
    connected = True  # ZeroMQ connects (and reconnects) by itself

    def connect(self, timeout: float = 2.0) -> bool:
        return True

    def disconnect(self) -> None:
        """Nothing to drop: ZeroMQ reconnects by itself."""

    def __init__(self, ctx: zmq.Context, input_addr: str, output_addr: str, topic: bytes,
                 broadcast: bytes | None = None):
        self.topic = topic
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, PUSH_SNDHWM)
        self.push.setsockopt(zmq.LINGER, 0)
        # Queue nothing for an engine that is not connected: a submit while the engine
        # is down fails at once instead of reaching the restarted engine much later.
        self.push.setsockopt(zmq.IMMEDIATE, 1)
        self.push.connect(bind_address(input_addr))
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, SUB_RCVHWM)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        if broadcast is not None:
            self.sub.setsockopt(zmq.SUBSCRIBE, broadcast)
        self.sub.connect(bind_address(output_addr))
        self._topics = {topic} if broadcast is None else {topic, broadcast}
        self._expected: dict[bytes, int] = {}

    def send(self, msg: Any, timeout_ms: int = 1000) -> None:
        """Send one message; raises ``zmq.Again`` if the engine has not taken it
        within ``timeout_ms`` (HWM full: engine gone or wedged)."""
        if not self.push.poll(timeout_ms, zmq.POLLOUT):
            raise zmq.Again("engine input is not accepting messages")
        self.push.send(codec.encode(msg), zmq.NOBLOCK)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sub.poll(timeout_ms, zmq.POLLIN))

    def recv(self) -> Received | None:
        """One message, or ``None`` if nothing is waiting (non-blocking).

        Raises :class:`SequenceGap` (after resynchronising) when frames were lost,
        and :class:`codec.DecodeError` for a malformed frame.
        """
        try:
            topic, seq_b, payload = self.sub.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        if topic not in self._topics:
            return None  # SUB filters by prefix: a longer topic that starts with ours
        seq = int.from_bytes(seq_b, "big")
        expected = self._expected.get(topic)
        self._expected[topic] = seq + 1
        if expected is not None and seq != expected:
            raise SequenceGap(topic, expected, seq)
        return Received(topic, codec.decode(payload))

    def reset_sequence(self) -> None:
        """Forget expected sequence numbers (after the engine restarted)."""
        self._expected.clear()

    def close(self) -> None:
        self.push.close(0)
        self.sub.close(0)
