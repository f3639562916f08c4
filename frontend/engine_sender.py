"""The sender thread of :class:`~frontend.engine_client.EngineClient`: every message to the
engine goes through its queue (``post``), so no send ever blocks the event loop. A
message not sent by its deadline fails its caller; aborts have no deadline: they are
retried until the engine has them, or until the connection they concerned is gone.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import zmq

from shared import protocol as p
from shared import shm


@dataclass
class Outgoing:
    """One message for the sender thread: sent by ``deadline`` (monotonic) or ``on_fail``
    (called on the event loop with the exception) is called."""

    msg: object
    deadline: float
    on_fail: object = None


STOP = object()  # put in the outbox: the sender thread ends
MAX_PENDING_ABORTS = 100_000  # request ids waiting for room in the engine's ring


class SenderThread:
    """Mixed into :class:`~frontend.engine_client.EngineClient`: the sender thread and the
    queue it drains (``_outbox``, ``_channel_lock``, ``channel`` are the client's)."""

    def post(self, msg, timeout_s: float = 1.0, on_fail=None) -> None:
        """Queue ``msg`` for the sender thread (never blocks): sent within ``timeout_s``, or
        ``on_fail(exc)`` is called on the event loop."""
        self._outbox.put(Outgoing(msg, time.monotonic() + timeout_s, on_fail))

    def _send_loop(self) -> None:
        aborts: list[str] = []  # undelivered aborted request ids, oldest first
        connection = self._connection()
        while True:
            try:
                item = self._outbox.get(timeout=0.005 if aborts else 0.5)
            except queue.Empty:
                item = None
            if item is STOP:
                return
            if self._connection() != connection:  # those requests ended with the connection
                aborts.clear()
                connection = self._connection()
            if isinstance(item, p.Abort):
                aborts.extend(item.request_ids)
                del aborts[:-MAX_PENDING_ABORTS]
            elif item is not None:
                self._deliver(item)
            while aborts and not self._stop.is_set():  # retried each pass until the engine has them
                batch = aborts[:p.MAX_LIST]
                if not self._try_send(p.Abort(self.frontend_id, batch)):
                    break
                del aborts[:len(batch)]
            self.aborts_pending = len(aborts)

    def _connection(self) -> int:
        return getattr(self.channel, "connections", 0)

    def _deliver(self, item: Outgoing) -> None:
        """Send ``item``, retrying while the ring (or ZeroMQ queue) is full, until its deadline."""
        pause = 0.0005
        while True:
            try:
                if self._try_send(item.msg, raise_errors=True):
                    return
                if time.monotonic() >= item.deadline or self._stop.is_set():
                    raise shm.RingFull("the engine is not taking messages")
            except Exception as exc:  # noqa: BLE001 - the caller hears of it, the thread goes on
                if item.on_fail is not None:
                    self._call(item.on_fail, exc)
                return
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def _try_send(self, msg, raise_errors: bool = False) -> bool:
        """One attempt, without waiting: ``True`` if sent, ``False`` if there is no room now.
        With ``raise_errors`` an engine that is not connected raises; else it is "no room"."""
        with self._channel_lock:
            try:
                self.channel.send(msg, 0)
                return True
            except (shm.RingFull, zmq.Again):
                return False
            except (shm.PeerGone, zmq.ZMQError):
                if raise_errors:
                    raise
                return False
