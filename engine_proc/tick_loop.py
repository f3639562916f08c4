"""The engine's tick thread (part of :class:`~engine_proc.engine.EngineServer`): it
holds the backend lock for the whole tick.

Each turn: drain the inbox (submits, aborts, departed frontends, stats requests, all
put there by the I/O thread) → ``scheduler.step()`` → one ``StepOutput`` per frontend,
pushed to the I/O thread over an inproc socket; between ticks, the periodic stats
broadcast. A tick that raises fails every request and stops the engine.
"""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass

import msgspec
import zmq

from engine_proc.handover_link import HandoverArrived
from engine_proc.request import Request
from shared import codec
from shared import protocol as p
from shared.protocol import BROADCAST_TOPIC
from shared.transport import topic_for

log = logging.getLogger("tickserve.engine")

TICK_OUT_ADDR = "inproc://tick-out"


# The tick thread's inbox: what the I/O thread hands it (besides p.StatsRequest).

@dataclass
class NewRequest:
    request: Request


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class FrontendGone:
    frontend_id: str


class TickLoop:
    """Mixed into :class:`~engine_proc.engine.EngineServer`: the tick thread."""

    def _tick_loop(self) -> None:
        out = self.ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 1000)  # let the I/O thread collect the last frames
        out.connect(TICK_OUT_ADDR + self.engine_id)
        # engines of one host lend idle cores (engine_proc/core_lending.py): say whether this one is busy
        board = getattr(getattr(self.scheduler.backend, "threads", None), "board", None)
        # a core whose KV pool is still being mapped is not idle: lent out, the borrowed threads
        # waited on the walk there (one stream 7x slower while a sibling engine's walk ran)
        prefaulter = getattr(self.scheduler.backend, "kv_prefaulter", None)
        try:
            while not self._stop.is_set():
                with self.backend_lock:
                    self._drain_inbox(out)
                    busy = self.scheduler.has_work()
                    if board is not None:
                        board.publish(busy or (prefaulter is not None and prefaulter.running))
                    if busy:
                        outputs = self.scheduler.step(stream=lambda early: self._send_outputs(out, early))
                    else:
                        outputs = self.scheduler.drain_outputs()
                self._send_outputs(out, outputs)
                self._service_handovers(lambda items: self._send_outputs(out, items))
                if self.stats_window.due():
                    self._publish_stats(out)
                    self._report_decode_load()
                if not self.scheduler.has_work() or self.scheduler.only_compiling():
                    self._wake.wait(0.1)  # a submit, an abort or a finished compile wakes it
                    self._wake.clear()
                elif self.scheduler.only_waiting_for_decode:  # no decode engine has room: do not spin
                    self._wake.wait(0.005)
                    self._wake.clear()
        except Exception as exc:
            log.exception("tick failed; failing every request and exiting")
            self.fatal = exc
            self._fail_all(out, f"engine error: {exc}")
            self.stop()
        finally:
            if board is not None:
                board.close()
            out.close(0)
            self._ticks_done.set()

    def _drain_inbox(self, out: zmq.Socket) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, NewRequest):
                req = item.request
                try:
                    self.scheduler.add_request(req)
                except ValueError as exc:  # acked already: end it with an error, keep serving
                    log.warning("request %s refused after its ack: %s", req.request_id, exc)
                    self._send_outputs(out, [(req.frontend_id, p.RequestOutput(
                        req.request_id, [], p.FinishReason.ERROR, error=str(exc)))])
                    self._left_pending += 1
                    continue
                self.stats_window.on_arrival(req.request_id, req.session_id, req.arrival_time)
            elif isinstance(item, AbortRequests):
                missed = [rid for rid in item.request_ids if not self.scheduler.abort_request(rid)]
                if missed and self.decode_targets is not None:  # handed over, maybe not acked yet
                    self.decode_targets.forward_abort(missed)
            elif isinstance(item, HandoverArrived):
                self._on_handover_arrived(item)
            elif isinstance(item, FrontendGone):
                self.scheduler.abort_frontend(item.frontend_id)
            elif isinstance(item, p.StatsRequest):
                out.send_multipart([topic_for(item.frontend_id),
                                    codec.encode(p.Stats(item.nonce, self._stats_data(per_frontend=True)))])

    def _stats_data(self, scheduler_stats: dict | None = None, per_frontend: bool = False) -> dict:
        """``/scheduler/stats``: the scheduler's counters, the engine's, and the last
        published window (rates and latency percentiles, see :mod:`stats_window`). The map
        of every frontend (``per_frontend``) only in an answer to a request: in the broadcast,
        which every frontend gets, it would grow with the square of the frontends."""
        sched = scheduler_stats or self.scheduler.stats()
        rejected = dict(self.rejected)  # before the ack (gate 1, invalid, never fits, draining)
        for code, n in sched.get("rejected_by_code", {}).items():  # at admission (hard-reject)
            rejected[code] = rejected.get(code, 0) + n
        frontends = {"num_frontends": len(self._frontends)}
        if self.shm is not None:
            frontends["shm"] = self.shm.summary()
        if per_frontend:
            carriers = {fid: {"carrier": "zmq"} for fid in list(self._frontends)}
            carriers.update(self.shm.stats() if self.shm is not None else {})
            frontends["frontends"] = carriers
        if self.decode_targets is not None:
            sched = dict(sched, **self.decode_targets.stats())
        return dict(sched, num_waiting=self.num_waiting, num_rejected=sum(rejected.values()),
                    rejected_by_code=rejected, bad_frames=self.bad_frames, **frontends,
                    engine_id=self.engine_id, runtime=msgspec.structs.asdict(self.runtime),
                    window=self.stats_window.latest)

    def _publish_stats(self, out: zmq.Socket) -> None:
        """Between ticks, at most every ``stats_interval_s``: one ``Stats`` (nonce 0) on the
        broadcast topic, shared by every frontend and every dashboard behind it."""
        sched = self.scheduler.stats()
        self.stats_window.publish(sched)
        out.send_multipart([BROADCAST_TOPIC, codec.encode(p.Stats(0, self._stats_data(sched)))])

    def _send_outputs(self, sock: zmq.Socket, outputs: list[tuple[str, p.RequestOutput]]) -> None:
        if not outputs:
            return
        self.stats_window.on_outputs(output for _, output in outputs)
        by_frontend: dict[str, list[p.RequestOutput]] = {}
        for fid, output in outputs:
            by_frontend.setdefault(fid, []).append(output)
            if output.finish_reason is not None:
                self._live_ids.discard(output.request_id)
        for fid, items in by_frontend.items():
            sock.send_multipart([topic_for(fid), codec.encode(p.StepOutput(items))])

    def _fail_all(self, sock: zmq.Socket, error: str) -> None:
        outputs = []
        for req in self.scheduler.requests():
            outputs.append((req.frontend_id, p.RequestOutput(req.request_id, [], p.FinishReason.ERROR,
                                                              error=error)))
        try:
            self._send_outputs(sock, outputs)
        except Exception:  # best effort on the way down
            pass
