"""Dashboard streams have a connection cap of their own: open dashboards never make API
calls (``/health``) a 429, and streams beyond their cap are refused with a 429."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from frontend.http_guard import ConnectionLimits, guarded_protocol
from tests.procs import free_port, wait_for


async def _stream(request):
    async def forever():
        yield "retry: 1000\n\n"
        while True:
            await asyncio.sleep(0.05)
            yield ": keep-alive\n\n"
    return StreamingResponse(forever(), media_type="text/event-stream")


async def _health(request):
    return JSONResponse({"status": "ok"})


def _get(sock: socket.socket, path: str) -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    sock.settimeout(5)
    return sock.recv(4096)


def test_open_dashboards_do_not_count_against_the_api_cap():
    app = Starlette(routes=[Route("/scheduler/stats/stream", _stream), Route("/health", _health)])
    limits = ConnectionLimits(header_timeout_s=5, max_connections_per_client=2, max_dashboard_streams_per_client=3)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=guarded_protocol(limits),
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    socks: list[socket.socket] = []
    try:
        wait_for(lambda: server.started, 10, what="the server")
        for _ in range(3):  # three dashboards, more than the API cap
            s = socket.create_connection(("127.0.0.1", port))
            socks.append(s)
            assert b"200 OK" in _get(s, "/scheduler/stats/stream")
        wait_for(lambda: limits.streams_by_address.get("127.0.0.1") == 3, 5, what="three streams counted")
        assert limits.open_by_address.get("127.0.0.1", 0) == 0
        for _ in range(2):  # the API's two connections are still there
            s = socket.create_connection(("127.0.0.1", port))
            socks.append(s)
            assert b"200 OK" in _get(s, "/health")
        extra = socket.create_connection(("127.0.0.1", port))  # a third API connection: over its cap
        socks.append(extra)
        assert b"429" in extra.recv(4096)
        socks[3].close()  # one API connection goes: the next connection is let in, then shown a stream
        wait_for(lambda: limits.open_by_address.get("127.0.0.1", 0) <= 1, 5, what="the API slot freed")
        fourth = socket.create_connection(("127.0.0.1", port))  # a fourth stream: over the streams' cap
        socks.append(fourth)
        reply = _get(fourth, "/scheduler/stats/stream")
        assert b"429" in reply and b"dashboard streams" in reply
    finally:
        for s in socks:
            s.close()
        server.should_exit = True
        thread.join(10)
