"""The engine's side of disaggregated prefill and decode (part of
:class:`~engine_proc.engine.EngineServer`): the links between engines; the scheduler's
side is :mod:`engine_proc.handover`, the transport :mod:`shared.handover_transport`.

Prefill role: :class:`DecodeTargets`, driven by the tick thread, holds one
:class:`~shared.handover_transport.HandoverClient` per decode engine (``--decode-engines``)
and is the scheduler's handover sink: it picks a decode engine — by its reported load,
and with ``--policy fair`` by the row's ``session_id`` among those with room, so a
session's rows meet one engine — and sends. Each handover stays *in flight* until the
decode engine acks it: a refusal, or a decode engine lost before its ack, fails the row
to its frontend with an error (nothing is held on this side: the blocks and the
reservation went at the handover). An abort for a row in flight is forwarded. Decode
engines report each ``session_id``'s decode tokens; they are charged to the policy here
(Fair/VTC runs ``_pending`` on this side).

Decode role: a listener thread runs the :class:`~shared.handover_transport.HandoverServer`
(the run directory's socket; ``--handover-addr`` over tcp) and hands each handover to the
tick thread through the inbox; the tick thread validates and queues it
(:meth:`~engine_proc.handover.Handovers.receive_handover`) and acks. Every stats
interval it reports its load and the per-session decode tokens to every prefill engine.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import warnings
from dataclasses import dataclass

import torch

from shared import handover_wire as hw
from shared import protocol as p
from shared.config import PolicyName, parse_decode_engines
from shared.handover_client import Busy, HandoverClient
from shared.handover_transport import HandoverServer, Received

log = logging.getLogger("tickserve.engine")

RECONNECT_S = 0.2


@dataclass
class HandoverArrived:  # tick thread inbox item (decode role)
    received: Received


class _Session:
    """Enough of a request for the policy's ``on_tokens_processed``."""

    __slots__ = ("session_id",)

    def __init__(self, session_id: str):
        self.session_id = session_id


def as_tensor(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``view`` without a copy (read-only views warn in torch; they
    are only read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)


class DecodeTargets:
    """The prefill engine's decode engines (tick thread only)."""

    def __init__(self, spec: str, scheduler):
        self.scheduler = scheduler
        bs = scheduler.block_pool.block_size
        row = -(-scheduler.limits.max_model_len // bs) * scheduler.kv_layout.block_nbytes  # the largest row's KV
        staging = max(64 << 20, 2 * row + (16 << 20))  # two of them at once, and their metadata
        self.clients = [HandoverClient(t, staging_bytes=staging) for t in parse_decode_engines(spec)]
        self._in_flight: dict[str, tuple[HandoverClient, str]] = {}  # request id → (client, frontend id)
        self._sent_since_report: dict[int, int] = {}
        self._next_connect = 0.0
        self.num_failed = 0
        scheduler.handover_sink = self.sink

    # -------------------------------------------------------------- the sink

    def sink(self, h: hw.Handover, fill) -> bool:
        for client in self._order(h):
            try:
                client.send_handover(h, lambda view: fill(as_tensor(view)))
            except Busy:
                continue  # the next one, or the row waits a tick
            except ConnectionError as exc:
                log.warning("decode engine %s: handover failed (%s); trying another", client.target, exc)
                self._lost(client, str(exc))
                continue
            self._in_flight[h.request_id] = (client, h.frontend_id)
            self._sent_since_report[id(client)] = self._sent_since_report.get(id(client), 0) + 1
            return True
        return False

    def _order(self, h: hw.Handover) -> list[HandoverClient]:
        # a decode engine holding a batch's worth of handovers it cannot admit yet takes no
        # more: the row waits here, in its place, and _pending keeps the policy's order
        ready = [c for c in self.clients if c.ready and c.layout == h.layout and not (
            c.report is not None and c.report.num_held + self._sent_since_report.get(id(c), 0)
            >= max(1, c.report.max_batch_size))]
        loads = {id(c): self._load(c) for c in ready}
        ranked = sorted(ready, key=lambda c: loads[id(c)])
        if self.scheduler.config.policy == PolicyName.FAIR.value and h.session_id and len(ready) > 1:
            with_room = [c for c in ready if loads[id(c)] < 1.0] or ready
            home = max(with_room, key=lambda c: hashlib.blake2b(
                h.session_id.encode("utf-8", "surrogatepass") + c.target.encode(), digest_size=8).digest())
            ranked = [home] + [c for c in ranked if c is not home]
        return ranked

    def _load(self, c: HandoverClient) -> float:
        r = c.report
        sent = self._sent_since_report.get(id(c), 0)
        if r is None:
            return sent / 256
        return (r.num_rows + sent) / max(1, r.max_batch_size)

    # -------------------------------------------------------------- each turn of the tick loop

    def service(self) -> list[tuple[str, p.RequestOutput]]:
        """Connect, read acks and reports; returns the failures to stream."""
        failures: list[tuple[str, p.RequestOutput]] = []
        now = time.monotonic()
        if now >= self._next_connect:
            self._next_connect = now + RECONNECT_S
            for c in self.clients:
                c.connect()
        for c in self.clients:
            try:
                msgs = c.receive()
            except ConnectionError as exc:
                failures += self._lost(c, str(exc))
                continue
            for msg in msgs:
                if isinstance(msg, hw.HandoverAck):
                    failures += self._acked(msg)
                elif isinstance(msg, hw.DecodeReport):
                    self._sent_since_report[id(c)] = 0
                    for session, n in msg.session_tokens.items():
                        self.scheduler.policy.on_tokens_processed(_Session(session), 0, n)
                elif isinstance(msg, hw.DecodeHello):
                    log.info("decode engine %s (%s) ready for handovers", msg.engine_id, c.target)
        return failures

    def _acked(self, ack: hw.HandoverAck) -> list[tuple[str, p.RequestOutput]]:
        entry = self._in_flight.pop(ack.request_id, None)
        if entry is None or ack.accepted:
            return []
        self.num_failed += 1
        return [(entry[1], p.RequestOutput(ack.request_id, [], p.FinishReason.ERROR,
                                           error=f"the decode engine refused the row: {ack.error}"))]

    def _lost(self, client: HandoverClient, why: str) -> list[tuple[str, p.RequestOutput]]:
        client.disconnect()
        lost = [rid for rid, (c, _) in self._in_flight.items() if c is client]
        out = []
        for rid in lost:
            _, fid = self._in_flight.pop(rid)
            self.num_failed += 1
            out.append((fid, p.RequestOutput(rid, [], p.FinishReason.ERROR,
                                             error=f"the decode engine was lost during the handover ({why})")))
        return out

    def forward_abort(self, request_ids: list[str]) -> None:
        by_client: dict[int, tuple[HandoverClient, list[str]]] = {}
        for rid in request_ids:
            entry = self._in_flight.get(rid)
            if entry is not None:
                by_client.setdefault(id(entry[0]), (entry[0], []))[1].append(rid)
        for client, ids in by_client.values():
            try:
                client.send(hw.HandoverAbort(ids))
            except ConnectionError:
                pass

    def stats(self) -> dict:
        return {"decode_engines": [{"target": c.target, "engine_id": c.engine_id, "ready": c.ready,
                                    "num_rows": c.report.num_rows if c.report else None,
                                    "staged": c.num_staged, "own_memfd": c.num_memfd}
                                   for c in self.clients],
                "handovers_in_flight": len(self._in_flight), "handovers_failed": self.num_failed}

    def close(self) -> None:
        for c in self.clients:
            c.disconnect()


class HandoverLink:
    """Mixed into :class:`~engine_proc.engine.EngineServer`: both roles' links."""

    def _init_handover_link(self) -> None:
        self.decode_targets: DecodeTargets | None = None
        self.handover_server: HandoverServer | None = None
        role = self.config.role
        if role == "prefill":
            self.decode_targets = DecodeTargets(self.config.decode_engines, self.scheduler)
        elif role == "decode":
            self.handover_server = HandoverServer(
                hw.DecodeHello(self.engine_id, self.scheduler.kv_layout), run_dir=self.config.run_dir,
                tcp_addr=self.config.handover_addr, max_kv_bytes=self.config.max_handover_bytes, ctx=self.ctx)
            self._threads.append(threading.Thread(target=self._handover_loop, name="engine-handover", daemon=True))

    def _handover_loop(self) -> None:
        server = self.handover_server
        while not self._stop.is_set():
            try:
                for item in server.poll(5):
                    if isinstance(item.msg, hw.Handover):
                        self._inbox.put(HandoverArrived(item))
                    elif isinstance(item.msg, hw.HandoverAbort):
                        from engine_proc.tick_loop import AbortRequests

                        self._inbox.put(AbortRequests(list(item.msg.request_ids)))
                    self._wake.set()
            except Exception:  # never let one bad peer end the listener
                log.exception("handover listener failed a turn")
                time.sleep(0.05)

    def _on_handover_arrived(self, item: HandoverArrived) -> None:
        """Tick thread: validate and queue a handover, then ack it."""
        received = item.received
        h = received.msg
        server, peer, rid = self.handover_server, received.peer, h.request_id
        problem = self.scheduler.receive_handover(
            h, as_tensor(received.payload), release=lambda: server.reply(peer, hw.KVReleased(rid)))
        if problem is None:
            self._live_ids.add(h.request_id)
            self.stats_window.on_taken_over(h.request_id, h.session_id)
            self._frontends.setdefault(h.frontend_id, time.monotonic())
        else:
            log.warning("refused the handover of %s: %s", h.request_id, problem)
        self.handover_server.reply(received.peer, hw.HandoverAck(h.request_id, problem is None, problem or ""))

    def _service_handovers(self, send) -> None:
        """Tick thread, each turn: the prefill role's acks, reports and failures; the ids
        handed over leave this engine's view."""
        if self.decode_targets is None:
            return
        for rid in self.scheduler.take_handed_ids():
            self._live_ids.discard(rid)
            self.stats_window.on_handed_over(rid)
        failures = self.decode_targets.service()
        if failures:
            send(failures)

    def _report_decode_load(self) -> None:
        """Decode role, every stats interval: load and per-session tokens to the prefill engines."""
        if self.handover_server is None:
            return
        s = self.scheduler
        self.handover_server.reply_all(hw.DecodeReport(
            num_rows=len(s._active) + len(s._held), num_held=len(s._held), free_blocks=s.block_pool.num_free_blocks,
            max_batch_size=s.max_batch_size, session_tokens=s.take_session_tokens()))

    def _close_handover_link(self) -> None:
        if self.decode_targets is not None:
            self.decode_targets.close()
        if self.handover_server is not None:
            self.handover_server.close()
