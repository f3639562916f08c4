"""The engine's shared-memory frontends: the listener in the run directory, handshakes in
progress, and one :class:`shared.shm.ShmPeer` per connected frontend, driven from the
engine's I/O thread.

The I/O thread polls, in one ``zmq.Poller``, its ZeroMQ sockets and every file
descriptor registered here: the listener (a frontend connecting), each handshake's socket,
each peer's inbound doorbell (frames waiting in its ring) and each peer's socket (end of
file: the frontend is gone, noticed at once; or a large frame's memfd). Outbound frames
reach a peer through :class:`shared.transport.RoutedOutbound`, which holds the same peers
by topic.

One peer's failure is that peer's alone
---------------------------------------
Nothing here waits on a peer: connections are accepted, handshakes read and frames taken
without blocking. Whatever one peer does — an exception anywhere in its handling (an
index out of range, a memfd that is not sealed, an overflow marker with no frame, a
message that is not one), a handshake not finished within
:data:`shared.shm.HANDSHAKE_TIMEOUT_S` — closes that peer's connection (its requests are
aborted, as for a frontend that died) and touches no other. Admission: a handshake that
claims the id of a frontend whose socket is still open is refused, as is any beyond
``max_peers`` connected (or handshaking) at once; the refused peer is told why.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

import zmq

from shared import shm
from shared.transport import RoutedOutbound, topic_for

log = logging.getLogger("tickserve.engine")

MAX_SHM_PEERS = 64


class _Handshake:
    def __init__(self, sock: socket.socket, now: float):
        self.sock = sock
        self.deadline = now + shm.HANDSHAKE_TIMEOUT_S


class ShmFrontends:
    """Accept, read and retire shared-memory frontends (I/O thread only; ``stats`` and
    ``summary`` may be read from another thread)."""

    def __init__(self, run_dir: str, epoch: int, outbound: RoutedOutbound, ring_bytes: int = shm.OUTBOUND_BYTES,
                 max_peers: int = MAX_SHM_PEERS):
        self.listener = shm.ShmListener(run_dir, epoch, ring_bytes)
        self.outbound = outbound
        self.max_peers = max_peers
        self._peers: dict[str, shm.ShmPeer] = {}
        self._by_fd: dict[int, tuple[shm.ShmPeer, str]] = {}  # fd → (peer, "bell" | "sock")
        self._handshakes: dict[int, _Handshake] = {}  # fd → connection not yet said hello
        self._poller: zmq.Poller | None = None
        self.accepted = 0
        self.retired = 0
        self.refused = 0
        self._warnings = 0

    @property
    def peers(self) -> dict[str, shm.ShmPeer]:
        return dict(self._peers)

    def owns(self, frontend_id: str) -> bool:
        """Whether a shared-memory connection speaks for this frontend id (then no other
        carrier may)."""
        return frontend_id in self._peers

    def register(self, poller: zmq.Poller) -> None:
        self._poller = poller
        poller.register(self.listener.fileno(), zmq.POLLIN)

    def handle(self, events: dict, deadline: float, on_frame: Callable[[bytes, str], None],
               on_gone: Callable[[str, str], None]) -> None:
        """React to this poll's events (call it after every poll, events or not): accept,
        run handshakes, read frames (``on_frame(frame, frontend_id)`` until ``deadline``),
        retire peers that left or failed (``on_gone(frontend_id, why)``), close handshakes
        past their deadline."""
        now = time.monotonic()
        if self.listener.fileno() in events:
            self._accept(now)
        for fd in [fd for fd in events if isinstance(fd, int) and fd in self._handshakes]:
            self._handshake(self._handshakes[fd], on_gone)
        for fd, pending in list(self._handshakes.items()):
            if now >= pending.deadline:
                self._end_handshake(pending)
                self._warn(f"shared-memory handshake refused: nothing said within {shm.HANDSHAKE_TIMEOUT_S}s")
        for fd in [fd for fd in events if isinstance(fd, int) and fd in self._by_fd]:
            if fd not in self._by_fd:  # retired earlier in this loop
                continue
            peer, kind = self._by_fd[fd]
            try:
                if kind == "bell":
                    for frame in peer.receive(deadline):
                        on_frame(frame, peer.frontend_id)
                else:
                    self._on_socket(peer, deadline, on_frame)
            except Exception as exc:  # noqa: BLE001 - whatever it was, it ends this peer only
                self._fail(peer, exc, on_gone)
        for peer in list(self._peers.values()):  # failures met while publishing to it
            if peer.failure is not None:
                self._fail(peer, shm.PeerFault(peer.failure), on_gone)

    def _on_socket(self, peer: shm.ShmPeer, deadline: float, on_frame) -> None:
        try:
            peer.check_socket()
        except shm.PeerFault:
            raise
        except shm.PeerGone:  # end of file: first what it wrote before it closed (a goodbye)
            for frame in peer.receive(deadline):
                on_frame(frame, peer.frontend_id)
            raise

    def _fail(self, peer: shm.ShmPeer, exc: BaseException, on_gone) -> None:
        if isinstance(exc, shm.PeerFault) or not isinstance(exc, shm.PeerGone):
            self._warn(f"frontend {peer.frontend_id} broke the shared-memory protocol, its connection is "
                       f"closed: {type(exc).__name__}: {exc}")
        self._retire(peer)
        on_gone(peer.frontend_id, f"shared memory: {exc}")

    # ------------------------------------------------------------------ admission

    def _accept(self, now: float) -> None:
        for _ in range(64):
            try:
                conn = self.listener.accept()
            except OSError as exc:  # out of fds, say: try again at the next poll
                self._warn(f"shared-memory listener: {exc}")
                return
            if conn is None:
                return
            if len(self._handshakes) >= self.max_peers:
                self._refuse(conn, f"the engine has {len(self._handshakes)} shared-memory handshakes in progress")
                continue
            self._handshakes[conn.fileno()] = _Handshake(conn, now)
            self._poller.register(conn.fileno(), zmq.POLLIN)

    def _handshake(self, pending: _Handshake, on_gone) -> None:
        """The hello is waiting (or the connection closed): admit or refuse, never wait."""
        try:
            got = shm.recv_message(pending.sock)
        except shm.PeerGone:
            self._end_handshake(pending)
            return
        if got is None:
            return
        msg, fds = got
        shm.close_all(fds)
        self._end_handshake(pending, close=False)
        try:
            frontend_id = shm.parse_hello(msg)
        except ValueError as exc:
            self._refuse(pending.sock, str(exc))
            return
        old = self._peers.get(frontend_id)
        if old is not None:
            try:
                old.check_socket()  # a frontend that reconnects closed its old socket first
            except Exception as exc:  # noqa: BLE001 - the old connection is over: retire it
                self._retire(old)
                on_gone(old.frontend_id, f"shared memory: connected again ({exc})")
            else:
                self._refuse(pending.sock, f"frontend id {frontend_id!r} is held by a live connection")
                return
        if len(self._peers) >= self.max_peers:
            self._refuse(pending.sock, f"the engine serves its maximum of {self.max_peers} shared-memory "
                                       "frontends (--max-shm-peers)")
            return
        try:
            peer = shm.ShmPeer(pending.sock, frontend_id, self.listener.epoch, self.listener.ring_bytes)
        except (OSError, shm.PeerGone) as exc:
            self._refuse(pending.sock, f"no rings for it: {exc}")
            return
        self._admit(peer)

    def _admit(self, peer: shm.ShmPeer) -> None:
        bell, sock = peer.fds
        self._by_fd[bell] = (peer, "bell")
        self._by_fd[sock] = (peer, "sock")
        self._poller.register(bell, zmq.POLLIN)
        self._poller.register(sock, zmq.POLLIN)
        self._peers[peer.frontend_id] = peer
        self.outbound.shm_peers[topic_for(peer.frontend_id)] = peer
        self.accepted += 1
        log.info("frontend %s connected over shared memory", peer.frontend_id)

    def _end_handshake(self, pending: _Handshake, close: bool = True) -> None:
        fd = pending.sock.fileno()
        if self._handshakes.pop(fd, None) is not None and self._poller is not None:
            self._poller.unregister(fd)
        if close:
            pending.sock.close()

    def _refuse(self, sock: socket.socket, reason: str) -> None:
        self.refused += 1
        self._warn(f"shared-memory handshake refused: {reason}")
        shm.refuse(sock, reason)

    def _warn(self, message: str) -> None:
        """A warning, but only the first 100 and then every 1000th: a peer that loops on a
        refused handshake cannot flood the log."""
        self._warnings += 1
        if self._warnings <= 100 or self._warnings % 1000 == 0:
            log.warning("%s (%d warnings about shared-memory peers so far)", message, self._warnings)

    def _retire(self, peer: shm.ShmPeer) -> None:
        for fd in peer.fds:
            if self._by_fd.pop(fd, None) is not None and self._poller is not None:
                self._poller.unregister(fd)
        if self._peers.get(peer.frontend_id) is peer:
            del self._peers[peer.frontend_id]
        if self.outbound.shm_peers.get(topic_for(peer.frontend_id)) is peer:
            del self.outbound.shm_peers[topic_for(peer.frontend_id)]
        peer.close()
        self.retired += 1

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        """Per connected frontend: its carrier and the carrier's counters (on request only:
        it grows with the peers)."""
        return {fid: peer.stats() for fid, peer in list(self._peers.items())}

    def summary(self) -> dict:
        """A few counts, whatever the number of peers (for the stats broadcast)."""
        peers = list(self._peers.values())
        return {"peers": len(peers), "max_peers": self.max_peers, "handshakes": len(self._handshakes),
                "accepted": self.accepted, "retired": self.retired, "refused": self.refused,
                "dropped": sum(peer.counters.dropped for peer in peers)}

    def close(self) -> None:
        for peer in list(self._peers.values()):
            self._retire(peer)
        for pending in list(self._handshakes.values()):
            self._end_handshake(pending)
        self.listener.close()
