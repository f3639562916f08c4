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
    """A hub fed by ``frontend.client``'s stats broadcasts."""
    client = frontend.client
    hub = StatsHub(status=lambda: (client.is_up, client.engine_id),
                   frontend=lambda: {"frontend_id": client.frontend_id, "in_flight": client.num_in_flight,
                                     "transport": client.transport_name})
    client.on_stats_broadcast = hub.update
    return hub


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
