"""A frontend's engines: one :class:`~frontend.engine_client.EngineClient` per engine,
and the routing between them (:mod:`frontend.router`).

The HTTP layer talks to an :class:`EngineSet` exactly as it would to one engine client
(``submit``, ``abort``, ``stats``, ``is_up``, ``welcome``); with one engine nothing
changes. With several:

* ``submit`` tries the engines in the router's order for the request's affinity key
  and moves on when one refuses for load or is down: 429 only when every engine
  refuses. The ``n`` choices of one request go where the first went (``via``).
* ``abort`` reaches the engine that owns each request.
* an engine that dies fails its own streams at once (its client sees it); routing
  skips it until its client is connected again.
* ``stats`` sums the engines' counters, reports KV usage as used over total blocks of
  all pools, and lists every engine under ``engines``.
* disaggregated prefill and decode (engines whose role is ``prefill`` or ``decode``):
  requests go to prefill engines only; a prefill engine hands each row to a decode
  engine, which streams it on this frontend's topic from its first token — the first
  output for a request another engine accepted moves its stream to that engine's client
  (so a dead prefill engine fails only the prompts it still holds, a dead decode engine
  the rows it streams). An abort goes to the owner and to every decode engine (the row
  may be in flight between them).

Addresses (``--engine ADDR[,ADDR...]``): a run directory, or
``tcp://HOST:PORT`` (input ``PORT``, output ``PORT + 1``), or ``IN_ADDR+OUT_ADDR``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import uuid
from collections.abc import Sequence

from frontend.engine_client import EngineClient, EngineUnavailable, Rejected, RequestStream
from frontend.router import BalancePolicy, choose
from shared import protocol as p
from shared.config import FrontendConfig, parse_engines

log = logging.getLogger("tickserve.frontend")

SUMMED = ("num_pending", "num_prefilling", "num_active", "batch_size", "max_batch_size", "active_kv_reserved",
          "kv_budget_tokens", "kv_admit_blocked", "num_generated_tokens", "num_finished", "num_aborted",
          "num_rejected", "num_ticks", "num_waiting", "bad_frames", "num_awaiting_grammar", "grammars_compiled",
          "grammars_failed")


class Member:
    """One engine as the router sees it."""

    def __init__(self, address: str, client: EngineClient):
        self.address = address
        self.client = client
        self.latest: dict | None = None  # its last stats broadcast
        self.sent_since_stats = 0  # requests this frontend routed here since that broadcast

    @property
    def up(self) -> bool:
        return self.client.is_up

    @property
    def role(self) -> str:
        """The engine's role as its welcome said (``""`` before one, or from an older engine)."""
        w = self.client.welcome
        return (w.runtime.role if w is not None and w.runtime is not None else "") or "monolithic"

    def load(self) -> float:
        s = self.latest or {}
        queued = s.get("num_pending", 0) + s.get("num_prefilling", 0) + s.get("num_active", 0)
        return float(queued + self.sent_since_stats)

    def free_slots(self) -> float:
        """Batch slots left once what it holds and what was sent since its stats are in
        (unknown before its first broadcast: assumed free)."""
        s = self.latest
        if not s:
            return float("inf")
        return float(s.get("max_batch_size", 0) - self.load())


class EngineSet:
    """Every engine of one frontend (used from the event loop, like EngineClient)."""

    def __init__(self, config: FrontendConfig, clients: Sequence[EngineClient] | None = None,
                 addresses: Sequence[str] | None = None, policy: BalancePolicy = BalancePolicy()):
        if clients is None:
            clients, addresses = self._clients_for(config)
        self.config = config
        self.policy = policy
        self.members = [Member(a, c) for a, c in zip(addresses or [c.config.run_dir for c in clients], clients)]
        self.frontend_id = self.members[0].client.frontend_id
        self._owners: dict[str, Member] = {}
        self._ids = itertools.count()
        self._turn = itertools.count()
        self.on_stats_broadcast = None  # called with (member index, stats) on the event loop
        for i, m in enumerate(self.members):
            m.client.on_stats_broadcast = lambda data, i=i: self._on_broadcast(i, data)
            if len(self.members) > 1:
                m.client.adopt = self._adopt

    @staticmethod
    def _clients_for(config: FrontendConfig) -> tuple[list[EngineClient], list[str]]:
        if not config.engine:
            client = EngineClient(config)
            return [client], [config.run_dir or config.resolved_input_addr]
        fid = config.frontend_id or f"fe-{uuid.uuid4().hex[:12]}"
        clients, addresses = [], []
        for label, run_dir, addrs in parse_engines(config.engine):
            inp, _, outp = addrs.partition("+")
            sub = dataclasses.replace(config, run_dir=run_dir, input_addr=inp, output_addr=outp, frontend_id=fid,
                                      engine="")
            clients.append(EngineClient(sub))
            addresses.append(label)
        return clients, addresses

    # ------------------------------------------------------------------ the one-engine face

    @property
    def is_up(self) -> bool:
        return any(m.up for m in self.members)

    @property
    def welcome(self) -> p.Welcome | None:
        for m in self.members:
            if m.up and m.client.welcome is not None:
                return m.client.welcome
        return None

    @property
    def engine_id(self) -> str | None:
        ids = [m.client.engine_id for m in self.members if m.up and m.client.engine_id]
        return ids[0] if len(ids) == 1 else (",".join(ids) or None)

    @property
    def transport_name(self) -> str:
        return "+".join(sorted({m.client.transport_name for m in self.members}))

    @property
    def num_in_flight(self) -> int:
        return sum(m.client.num_in_flight for m in self.members)

    @property
    def refused(self) -> str | None:
        return next((m.client.refused for m in self.members if m.client.refused), None)

    @property
    def expected_fingerprint(self) -> str:
        return self.members[0].client.expected_fingerprint

    @expected_fingerprint.setter
    def expected_fingerprint(self, value: str) -> None:
        for m in self.members:
            m.client.expected_fingerprint = value

    @property
    def on_refused(self):
        return self.members[0].client.on_refused

    @on_refused.setter
    def on_refused(self, fn) -> None:
        for m in self.members:
            m.client.on_refused = fn

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        for m in self.members:
            m.client.start(loop)

    def close(self) -> None:
        for m in self.members:
            m.client.close()

    def new_request_id(self) -> str:
        return f"{self.frontend_id}-{next(self._ids)}"

    # ------------------------------------------------------------------ routing

    def route(self, key: bytes) -> list[Member]:
        """The engines to try for ``key``, best first (healthy ones only); with
        ``routing round_robin``, the next healthy engine in turn, then the others."""
        members = [m for m in self.members if m.role != "decode"]  # decode engines take handovers only
        if self.config.routing == "round_robin":
            healthy = [m for m in members if m.up]
            if not healthy:
                return []
            start = next(self._turn) % len(healthy)
            return healthy[start:] + healthy[:start]
        return choose(key, members, self.policy)

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: p.SamplingParams,
                     session_id: str | None = None, priority: int = 0, key: bytes = b"",
                     via: Member | None = None) -> tuple[RequestStream, Member]:
        """Submit to the first engine of the route that accepts. Returns the stream and
        the engine. Raises :class:`Rejected` (the last refusal) when every engine refused,
        :class:`EngineUnavailable` when none is up."""
        order = [via] if via is not None else self.route(key)
        if not order:
            raise EngineUnavailable("no engine is available")
        last: Exception | None = None
        for member in order:
            member.sent_since_stats += 1  # counted now: concurrent submits see each other's choice
            try:
                stream = await member.client.submit(request_id, prompt_token_ids, params, session_id, priority)
            except Rejected as exc:
                member.sent_since_stats -= 1
                last = exc
                if exc.reason.code in (p.RejectCode.INVALID, p.RejectCode.CONTEXT_LENGTH):
                    raise  # the request's own fault: the same everywhere
                continue
            except EngineUnavailable as exc:
                member.sent_since_stats -= 1
                last = exc
                continue
            self._remember(request_id, member, stream)
            return stream, member
        raise last

    def _remember(self, request_id: str, member: Member, stream: RequestStream) -> None:
        self._owners[request_id] = member
        if len(self._owners) > 2 * self.num_in_flight + 1024:  # forget finished requests now and then
            live = set().union(*(m.client.in_flight_ids() for m in self.members))
            self._owners = {rid: m for rid, m in self._owners.items() if rid in live}

    def _adopt(self, request_id: str, client: EngineClient) -> RequestStream | None:
        """Event loop: an output for ``request_id`` came from ``client``'s engine, which
        another engine handed the row to: move its stream there."""
        for m in self.members:
            if m.client is not client:
                stream = m.client.take_stream(request_id)
                if stream is not None:
                    client.put_stream(stream)
                    self._owners[request_id] = next(x for x in self.members if x.client is client)
                    return stream
        return None

    def abort(self, request_ids: list[str]) -> None:
        """Abort each request at the engine that owns it, and at every decode engine, where
        a row on its way from its prefill engine may arrive (idempotent, never raises)."""
        by_member: dict[int, list[str]] = {}
        decoders = [m for m in self.members if m.role == "decode"]
        for rid in request_ids:
            member = self._owners.pop(rid, None)
            if member is not None:
                by_member.setdefault(id(member), []).append(rid)
                for d in decoders:
                    if d is not member:
                        by_member.setdefault(id(d), []).append(rid)
                continue
            for m in self.members:  # not routed by us (or forgotten): tell everyone
                by_member.setdefault(id(m), []).append(rid)
        for m in self.members:
            ids = by_member.get(id(m))
            if ids and m.up:
                m.client.abort(ids)

    # ------------------------------------------------------------------ stats

    def _on_broadcast(self, index: int, data: dict) -> None:
        member = self.members[index]
        member.latest = data
        member.sent_since_stats = 0  # the engine's own counts include them now (or they finished)
        if self.on_stats_broadcast is not None:
            self.on_stats_broadcast(index, data)

    async def stats(self, timeout: float = 2.0) -> dict:
        """The engines' ``/scheduler/stats``: one engine's as it is; several summed, with
        each under ``engines``. Raises :class:`EngineUnavailable` when none answers."""
        up = [m for m in self.members if m.up]
        if len(self.members) == 1:
            return await self.members[0].client.stats(timeout)
        results = await asyncio.gather(*(m.client.stats(timeout) for m in up), return_exceptions=True)
        per_engine = [{"address": m.address, **r} for m, r in zip(up, results) if isinstance(r, dict)]
        if not per_engine:
            raise EngineUnavailable("no engine answered the stats request")
        return aggregate(per_engine, len(self.members))

    def latest_stats(self) -> list[tuple[Member, dict | None]]:
        """Every engine with its last broadcast (no round trip: what ``/metrics`` reads)."""
        return [(m, m.latest if m.up else None) for m in self.members]


def aggregate(per_engine: list[dict], num_engines: int) -> dict:
    """Several engines' stats as one: counters summed, KV usage as used over total blocks,
    every engine under ``engines``."""
    out: dict = {name: sum(s.get(name, 0) or 0 for s in per_engine) for name in SUMMED}
    used = sum(s.get("blocks", {}).get("num_used_blocks", 0) for s in per_engine)
    total = sum(s.get("blocks", {}).get("num_blocks", 0) for s in per_engine)
    out["kv_pressure"] = used / total if total else 0.0
    out["blocks"] = {"num_used_blocks": used, "num_blocks": total}
    block_size = per_engine[0].get("blocks", {}).get("block_size")
    if block_size is not None:  # one server's engines share it (/metrics' cache_config_info reads it)
        out["blocks"]["block_size"] = block_size
    rejected: dict[str, int] = {}
    for s in per_engine:
        for code, n in (s.get("rejected_by_code") or {}).items():
            rejected[code] = rejected.get(code, 0) + n
    out["rejected_by_code"] = rejected
    out["runtime"] = per_engine[0].get("runtime")
    out["prefill_mode"] = per_engine[0].get("prefill_mode")
    roles = [s.get("role", "monolithic") for s in per_engine]
    if any(r != "monolithic" for r in roles):
        out["roles"] = {r: roles.count(r) for r in sorted(set(roles))}
        decoders = [s for s in per_engine if s.get("role") == "decode"]
        out["handovers"] = {"count": sum(s.get("handovers", {}).get("count", 0) for s in decoders),
                            "bytes": sum(s.get("handovers", {}).get("bytes", 0) for s in decoders),
                            "time_p50_ms": max((s["handovers"].get("time_p50_ms") or 0 for s in decoders), default=0),
                            "time_p99_ms": max((s["handovers"].get("time_p99_ms") or 0 for s in decoders), default=0)}
    out["num_engines"] = num_engines
    out["num_engines_up"] = len(per_engine)
    out["engines"] = per_engine
    return out
