"""``GET /dashboard``: a live page of the scheduler, served from files in this package.

The page (``frontend/static/dashboard/``) is plain HTML and JavaScript with uPlot
(MIT, vendored as ``uPlot.iife.min.js`` with its licence): nothing is fetched from
anywhere but this server. It reads ``GET /scheduler/stats/stream``
(:mod:`frontend.stats_stream`) with ``EventSource``, which reconnects by itself.

Routes added to the app by :func:`routes`:

- ``GET /dashboard`` — the page;
- ``GET /dashboard/static/<file>`` — its script, styles and the charting library;
- ``GET /scheduler/stats/stream`` — the event stream. Behind ``--api-key`` it takes the
  key as ``Authorization: Bearer`` or, since ``EventSource`` cannot send headers, as
  ``?api_key=`` (the page forwards its own ``?api_key=``).
"""

from __future__ import annotations

import hmac
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from frontend.stats_stream import DEFAULT_MAX_HZ, StatsHub

STATIC_DIR = Path(__file__).resolve().parent / "static" / "dashboard"


def make_hub(frontend) -> StatsHub:
    """A hub fed by the stats broadcasts of ``frontend.client`` (every engine of an
    :class:`~frontend.engine_set.EngineSet`, one row each)."""
    from frontend.engine_set import aggregate

    client = frontend.client
    members = getattr(client, "members", None)
    info = lambda: {"frontend_id": client.frontend_id, "in_flight": client.num_in_flight,  # noqa: E731
                    "transport": client.transport_name}
    if members and len(members) > 1:
        hub = StatsHub(status=lambda: [(m.up, m.client.engine_id) for m in members], frontend=info,
                       addresses=[m.address for m in members],
                       merge=lambda stats: merge_windows(aggregate(stats, len(members)), stats))
        client.on_stats_broadcast = lambda index, data: hub.update(data, index)
        return hub
    hub = StatsHub(status=lambda: (client.is_up, client.engine_id), frontend=info)
    client.on_stats_broadcast = lambda *args: hub.update(args[-1])
    return hub


def merge_windows(merged: dict, stats: list[dict]) -> dict:
    """The dashboard's ``window`` of several engines: rates summed; latency percentiles
    the worst engine's (percentiles of parts do not combine into the whole's); sessions
    the busiest across engines."""
    windows = [s.get("window") or {} for s in stats]
    window: dict = {}
    for name in ("output_tokens_per_s", "kv_admit_blocked_per_s"):
        window[name] = sum(w.get(name) or 0.0 for w in windows)
    window["rejects_per_s"] = {}
    for w in windows:
        for code, v in (w.get("rejects_per_s") or {}).items():
            window["rejects_per_s"][code] = window["rejects_per_s"].get(code, 0.0) + (v or 0.0)
    for name in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
        values = [w.get(name) for w in windows if w.get(name) is not None]
        window[name] = max(values) if values else None
    rates = [w.get("prefix_cache_hit_rate") for w in windows if w.get("prefix_cache_hit_rate") is not None]
    window["prefix_cache_hit_rate"] = sum(rates) / len(rates) if rates else None
    window["sessions"] = merge_sessions([s for w in windows for s in (w.get("sessions") or [])])
    return {**merged, "window": window}


def merge_sessions(sessions: list[dict], top: int = 8) -> list[dict]:
    """Several engines' busiest sessions as one list: a session served by several engines
    (requests without a session id are one, ``None``) is one row, its rates and VTC
    counters summed; the ``top`` busiest first."""
    merged: dict = {}
    for s in sessions:
        key = s.get("session") or None
        row = merged.setdefault(key, {"session": key, "tokens_per_s": 0.0, "vtc_counter": None})
        row["tokens_per_s"] += s.get("tokens_per_s") or 0.0
        if s.get("vtc_counter") is not None:
            row["vtc_counter"] = (row["vtc_counter"] or 0.0) + s["vtc_counter"]
    return sorted(merged.values(), key=lambda s: -s["tokens_per_s"])[:top]


def routes(frontend, hub: StatsHub) -> list:
    api_key = frontend.config.api_key

    async def page(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    async def stream(request: Request) -> Response:
        if api_key:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            given = token.strip() if scheme.lower() == "bearer" else request.query_params.get("api_key", "")
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                return JSONResponse({"error": {"message": "invalid or missing API key", "type": "invalid_request_error",
                                               "param": None, "code": "invalid_api_key"}}, status_code=401)
        return StreamingResponse(hub.events(DEFAULT_MAX_HZ, lambda: frontend.draining), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return [
        Route("/dashboard", page, methods=["GET"]),
        Mount("/dashboard/static", app=StaticFiles(directory=STATIC_DIR), name="dashboard-static"),
        Route("/scheduler/stats/stream", stream, methods=["GET"]),
    ]
