"""The engine's shared-memory frontends: the listener in the run directory and one
:class:`shared.shm.ShmPeer` per connected frontend, driven from the engine's I/O thread.

The I/O thread polls, in one ``zmq.Poller``, its ZeroMQ sockets and every file
descriptor registered here: the listener (a frontend connecting), each peer's inbound
doorbell (frames waiting in its ring) and each peer's socket (end of file: the frontend
is gone, noticed at once). Outbound frames reach a peer through
:class:`shared.transport.RoutedOutbound`, which holds the same peers by topic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from shared import shm
from shared.transport import RoutedOutbound, topic_for

log = logging.getLogger("tickserve.engine")


class ShmFrontends:
    """Accept, read and retire shared-memory frontends (I/O thread only)."""

    def __init__(self, run_dir: str, epoch: int, outbound: RoutedOutbound, ring_bytes: int = shm.OUTBOUND_BYTES):
        self.listener = shm.ShmListener(run_dir, epoch, ring_bytes)
        self.outbound = outbound
        self._by_fd: dict[int, tuple[shm.ShmPeer, str]] = {}  # fd → (peer, "bell" | "sock")
        self._poller: zmq.Poller | None = None
        self.accepted = 0
        self.retired = 0

    @property
    def peers(self) -> dict[str, shm.ShmPeer]:
        return {peer.frontend_id: peer for peer, kind in list(self._by_fd.values()) if kind == "bell"}

    def register(self, poller: zmq.Poller) -> None:
        self._poller = poller
        poller.register(self.listener.fileno(), zmq.POLLIN)

    def handle(self, events: dict, deadline: float, on_frame: Callable[[bytes, str], None],
               on_gone: Callable[[str, str], None]) -> None:
        """React to this poll's events: accept, read frames (``on_frame(frame, frontend_id)``
        until ``deadline``), retire peers whose socket closed (``on_gone(frontend_id, why)``)."""
        if self.listener.fileno() in events:
            self._accept(on_gone)
        for fd in [fd for fd in events if isinstance(fd, int) and fd in self._by_fd]:
            if fd not in self._by_fd:  # retired earlier in this loop
                continue
            peer, kind = self._by_fd[fd]
            try:
                if kind == "bell":
                    for frame in peer.receive(deadline):
                        on_frame(frame, peer.frontend_id)
                else:
                    peer.check_socket()
            except shm.PeerGone as exc:
                self._retire(peer)
                on_gone(peer.frontend_id, f"shared memory: {exc}")

    def _accept(self, on_gone: Callable[[str, str], None]) -> None:
        for _ in range(16):
            peer = self.listener.accept()
            if peer is None:
                return
            old = self.outbound.shm_peers.get(topic_for(peer.frontend_id))
            if old is not None:  # the same frontend again: its old connection is dead
                self._retire(old)
                on_gone(old.frontend_id, "connected again")
            bell, sock = peer.fds
            self._by_fd[bell] = (peer, "bell")
            self._by_fd[sock] = (peer, "sock")
            self._poller.register(bell, zmq.POLLIN)
            self._poller.register(sock, zmq.POLLIN)
            self.outbound.shm_peers[topic_for(peer.frontend_id)] = peer
            self.accepted += 1
            log.info("frontend %s connected over shared memory", peer.frontend_id)

    def _retire(self, peer: shm.ShmPeer) -> None:
        for fd in peer.fds:
            if self._by_fd.pop(fd, None) is not None and self._poller is not None:
                self._poller.unregister(fd)
        if self.outbound.shm_peers.get(topic_for(peer.frontend_id)) is peer:
            del self.outbound.shm_peers[topic_for(peer.frontend_id)]
        peer.close()
        self.retired += 1

    def stats(self) -> dict:
        """Per connected frontend: its carrier and the carrier's counters."""
        return {fid: peer.stats() for fid, peer in self.peers.items()}

    def close(self) -> None:
        for peer in list(self.peers.values()):
            self._retire(peer)
        self.listener.close()

