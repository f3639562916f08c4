"""The engine's I/O thread (part of :class:`~engine_proc.engine.EngineServer`); it never
takes the backend lock.

PULL (and each shared-memory ring): decode frames (bad ones are counted, logged,
dropped), validate submits, gate 1 (queue capacity) and the configuration-only hard
rejects, publish the ack, then hand the request to the tick thread through its inbox.
PUB: acks, welcomes, heartbeats, and every frame the tick thread produced (forwarded
from an inproc socket, so only this thread touches PUB). Tracks frontend heartbeats and
disconnections, and aborts the requests of a frontend that left.
"""

from __future__ import annotations

import logging
import time

import zmq

from engine_proc.gates import never_fits
from engine_proc.request import Request
from engine_proc.tick_loop import AbortRequests, FrontendGone, NewRequest
from shared import codec
from shared import protocol as p
from shared.protocol import BROADCAST_TOPIC
from shared.transport import topic_for

log = logging.getLogger("tickserve.engine")


class IOLoop:
    """Mixed into :class:`~engine_proc.engine.EngineServer`: the I/O thread."""

    IO_SLICE_S = 0.005
    """Longest the I/O thread works through inbound frames before it looks at its clock
    again (heartbeats, reaping): input, however large, never delays a heartbeat."""

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbound.sock, zmq.POLLIN)
        poller.register(self._tick_out_pull, zmq.POLLIN)
        monitor = self._monitor_disconnects()
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        if self.shm is not None:
            self.shm.register(poller)
        interval = self.config.heartbeat_interval_s
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    self.outbound.publish(BROADCAST_TOPIC, p.EngineHeartbeat(self.engine_id, time.time()))
                    self._sync_topics()
                    self._reap_frontends(now)
                    next_beat = now + interval
                if self._disconnect_check and now >= self._disconnect_check[0]:
                    self._reap_after_disconnect(self._disconnect_check.pop(0) - 3 * interval)
                wake = min([next_beat] + self._disconnect_check[:1])
                events = dict(poller.poll(max(1, int((wake - now) * 1000))))
                if self._tick_out_pull in events:
                    self._forward_tick_frames()
                if monitor is not None and monitor in events:
                    self._on_monitor_event(monitor, interval)
                if self.inbound.sock in events:
                    deadline = time.monotonic() + self.IO_SLICE_S
                    while time.monotonic() < deadline:
                        frame = self.inbound.recv_frame()
                        if frame is None:
                            break
                        self._on_frame(frame)
                if self.shm is not None:  # also with no events: handshake deadlines, peers that failed
                    self.shm.handle(events, time.monotonic() + self.IO_SLICE_S, self._on_frame, self._frontend_gone)
        except Exception as exc:  # the engine cannot serve without its I/O thread
            log.exception("I/O thread failed")
            self.fatal = exc
            self.stop()
        else:  # deliver what the tick loop said last (finishes, failures); it may run on the
            # main thread (run_ticks), so wait for it to end, not for the tick thread object
            self._ticks_done.wait(timeout=2)
            self._forward_tick_frames()
        finally:
            if monitor is not None:
                self.inbound.sock.disable_monitor()
                monitor.close(0)

    def _sync_topics(self) -> None:
        """An empty StepOutput on every frontend's own topic, each heartbeat: its sequence
        number shows a frontend whose last frames were dropped (a full ring, a PUB queue at
        its high-water mark) the gap, even when those frames were the last its requests
        would ever get."""
        for fid in list(self._frontends):
            self.outbound.publish_frame(topic_for(fid), self._empty_step)

    def _monitor_disconnects(self) -> zmq.Socket | None:
        """A monitor of the inbound socket's disconnections: a frontend whose process
        died closes its connection at once, long before its heartbeats are missed."""
        try:
            return self.inbound.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except (zmq.ZMQError, AttributeError):
            return None

    def _on_monitor_event(self, monitor: zmq.Socket, interval: float) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            # Some peer went away; which one is not said. Every live frontend sends a
            # heartbeat each interval: after three intervals, those not heard since the
            # disconnection are the ones that left.
            self._disconnect_check.append(time.monotonic() + 3 * interval)

    def _frontend_gone(self, frontend_id: str, why: str = "") -> None:
        """A frontend left (its connection closed): abort everything it submitted. Logged as
        a warning unless it said goodbye first (a clean stop)."""
        if why and frontend_id in self._frontends:
            log.warning("frontend %s disconnected (%s): aborting its requests", frontend_id, why)
        elif why:
            log.info("frontend %s closed its connection after its goodbye", frontend_id)
        self._frontends.pop(frontend_id, None)
        self._inbox.put(FrontendGone(frontend_id))
        self._wake.set()

    def _reap_after_disconnect(self, since: float) -> None:
        for fid, seen in list(self._frontends.items()):
            if seen < since and (self.shm is None or fid not in self.shm.peers):
                log.warning("frontend %s disconnected: aborting its requests", fid)
                self._frontend_gone(fid)

    def _forward_tick_frames(self) -> None:
        while True:
            try:
                topic, payload = self._tick_out_pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.outbound.publish_frame(topic, payload)

    def _on_frame(self, frame: bytes, carrier_frontend: str | None = None) -> None:
        """One inbound frame; ``carrier_frontend``: the frontend whose shared-memory ring it
        came from (it may speak only for itself)."""
        try:
            msg = codec.decode(frame, "engine")
        except codec.DecodeError as exc:
            self._drop(f"bad frame: {exc}")
            return
        if carrier_frontend is not None and msg.frontend_id != carrier_frontend:
            self._drop(f"frontend {carrier_frontend} sent a message for {msg.frontend_id!r}")
            return
        if carrier_frontend is None and self.shm is not None and self.shm.owns(msg.frontend_id):
            self._drop(f"a ZeroMQ message for {msg.frontend_id!r}, a frontend connected over shared memory")
            return
        try:
            self._on_message(msg)
        except Exception as exc:  # a well-formed frame with nonsense inside: drop, keep serving
            self._drop(f"{type(msg).__name__} could not be handled: {exc!r}")

    def _drop(self, why: str) -> None:
        self.bad_frames += 1
        if self.bad_frames <= 100 or self.bad_frames % 1000 == 0:
            log.warning("dropped a message (%d so far): %s", self.bad_frames, why)

    def _on_message(self, msg) -> None:
        """A decoded, well-typed message (``codec.decode(..., "engine")`` checked every field)."""
        self._frontends[msg.frontend_id] = time.monotonic()
        if isinstance(msg, p.Submit):
            self._on_submit(msg)
        elif isinstance(msg, p.Abort):
            self._inbox.put(AbortRequests(list(msg.request_ids)))
            self._wake.set()
        elif isinstance(msg, p.Hello):
            self.outbound.publish(topic_for(msg.frontend_id), p.Welcome(
                self.engine_id, self.limits.max_model_len, self.scheduler.eos_token_ids,
                self.config.max_queue_size, self.config.heartbeat_interval_s, self.runtime))
        elif isinstance(msg, p.StatsRequest):  # answered by the tick thread, between ticks
            self._inbox.put(msg)
            self._wake.set()
        elif isinstance(msg, p.Goodbye):
            self._frontends.pop(msg.frontend_id, None)
            self._inbox.put(FrontendGone(msg.frontend_id))
            self._wake.set()
        # p.Heartbeat: hearing from the frontend (above) is all it is for

    def _validate(self, msg: p.Submit) -> p.RejectReason | None:
        """What the decoder cannot know: the vocabulary, combinations of parameters,
        duplicates, the configuration's limits, draining, gate 1."""
        ids = msg.prompt_token_ids
        vocab = self.limits.vocab_size
        if max(ids) >= vocab:
            return p.RejectReason(p.RejectCode.INVALID, f"prompt token ids must be integers in [0, {vocab})",
                                  retryable=False)
        problem = msg.params.validate()
        if problem:
            return p.RejectReason(p.RejectCode.INVALID, problem, retryable=False)
        if msg.request_id in self._live_ids:
            return p.RejectReason(p.RejectCode.INVALID, f"duplicate request id {msg.request_id!r}",
                                  retryable=False)
        reason = never_fits(self.limits, len(ids), msg.params.max_tokens)
        if reason is not None:
            return reason
        if self._draining:
            return p.RejectReason(p.RejectCode.SHUTTING_DOWN, "the engine is shutting down")
        if self.config.role == "decode":
            return p.RejectReason(p.RejectCode.QUEUE_FULL, "this engine decodes rows handed over by prefill "
                                  "engines; submit to a prefill engine")
        if self.num_waiting >= self.config.max_queue_size:
            return p.RejectReason(p.RejectCode.QUEUE_FULL,
                                  f"the queue is full ({self.config.max_queue_size} requests waiting)",
                                  1, 0)
        return None

    def _on_submit(self, msg: p.Submit) -> None:
        """Validate, then build the engine's request, then count it and ack: nothing is
        counted or acked for a submit that cannot become a request."""
        topic = topic_for(msg.frontend_id)
        reason = self._validate(msg)
        req = None
        if reason is None:
            try:
                req = Request(request_id=msg.request_id, frontend_id=msg.frontend_id,
                              prompt_token_ids=list(msg.prompt_token_ids), params=msg.params,
                              session_id=msg.session_id or "", priority=msg.priority)
            except Exception as exc:  # noqa: BLE001 - refuse, never half-accept
                reason = p.RejectReason(p.RejectCode.INVALID, f"the request could not be built: {exc}",
                                        retryable=False)
        if reason is not None:
            self.stats_window.on_reject(reason.code)
            self.rejected[reason.code.value] = self.rejected.get(reason.code.value, 0) + 1
            self.outbound.publish(topic, p.Ack(msg.request_id, False, reason))
            return
        self._accepted += 1
        self._live_ids.add(msg.request_id)
        self.outbound.publish(topic, p.Ack(msg.request_id, True))
        self._inbox.put(NewRequest(req))
        self._wake.set()

    def _reap_frontends(self, now: float) -> None:
        timeout = self.config.frontend_timeout_s
        for fid, seen in list(self._frontends.items()):
            if now - seen > timeout:
                log.warning("frontend %s silent for %.1fs: aborting its requests", fid, now - seen)
                del self._frontends[fid]
                self._inbox.put(FrontendGone(fid))
                self._wake.set()
