"""What the server says about itself: ``/health`` (readiness), ``/version`` (what runs),
``/scheduler/stats`` (every engine's queues and gates) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.engine_client import EngineUnavailable
from frontend.http_errors import unavailable
from frontend.serving import Serving

VERSION = "0.1.0"


class StatusServing(Serving):
    async def health(self, request: Request) -> Response:
        if self.fe.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not self.fe.client.is_up:
            return JSONResponse({"status": "engine unavailable"}, status_code=503)
        members = getattr(self.fe.client, "members", None) or []
        return JSONResponse({"status": "ok", "engine_id": self.fe.client.engine_id,
                             "num_engines": max(1, len(members)),
                             "num_engines_up": sum(1 for m in members if m.up) if members else 1})

    async def version(self, request: Request) -> Response:
        client = self.fe.client
        welcome = client.welcome
        runtime = msgspec.structs.asdict(welcome.runtime) if welcome and welcome.runtime else None
        members = getattr(client, "members", None) or []
        return JSONResponse({"version": VERSION, "runtime": runtime, "transport": client.transport_name,
                             "num_engines": max(1, len(members)),
                             "num_engines_up": sum(1 for m in members if m.up) if members else int(client.is_up)})

    async def scheduler_stats(self, request: Request) -> Response:
        client = self.fe.client
        try:
            data = await client.stats()
        except EngineUnavailable as exc:
            raise unavailable(str(exc)) from None
        return JSONResponse({**data, "frontend": {"frontend_id": client.frontend_id,
                                                  "in_flight": client.num_in_flight,
                                                  "transport": client.transport_name}})

    async def prometheus(self, request: Request) -> Response:
        """Counters of every frontend, gauges from each engine's latest broadcast: no round
        trip to an engine, so a scrape costs the same 20 times a second."""
        client = self.fe.client
        latest = getattr(client, "latest_stats", None)
        engines = [stats for _, stats in latest()] if latest is not None else []
        if not any(engines):  # no broadcast yet (or --stats-interval-s 0): ask
            try:
                engines = [await client.stats(timeout=1.0)]
            except EngineUnavailable:
                engines = [None]
        return Response(self.fe.metrics.render(engines), media_type="text/plain; version=0.0.4")
