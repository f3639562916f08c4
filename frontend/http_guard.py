"""Connection guards under uvicorn's HTTP/1.1 protocol: stalled clients are dropped and
no client address holds more than its share of connections.

uvicorn closes idle keep-alive connections, but a connection that sends half a request
head and stops (slowloris) stays open for good, and nothing limits how many one client
opens. :class:`GuardedH11Protocol` adds, per connection:

* a **header deadline** (``header_timeout_s``): from the connection's first byte (or the
  end of its previous response) to a complete request head; past it the connection is
  closed without an answer;
* a **per-address cap** (``max_connections_per_client``): a connection beyond it gets
  ``429`` in OpenAI's error shape and is closed at once;
* a **cap of its own for dashboard streams** (``max_dashboard_streams_per_client``): once
  a request head shows ``GET /scheduler/stats/stream``, its connection moves from the cap
  above to this one (a stream beyond it gets the same ``429``), so open dashboards never
  crowd out API calls and ``/health``.

The request *body* is bounded by time in the app (:func:`frontend.request_body.read_body`),
which can answer it with a proper error.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from uvicorn.protocols.http.h11_impl import H11Protocol


STREAM_PATHS = ("/scheduler/stats/stream",)  # dashboards' long-lived streams: their own cap


@dataclass
class ConnectionLimits:
    header_timeout_s: float = 10.0
    max_connections_per_client: int = 512
    max_dashboard_streams_per_client: int = 64
    open_by_address: dict[str, int] = field(default_factory=dict)  # shared by every connection
    streams_by_address: dict[str, int] = field(default_factory=dict)  # of those, moved to the streams' cap
    refused: int = 0  # connections refused by the cap
    timed_out: int = 0  # connections closed by the header deadline


def guarded_protocol(limits: ConnectionLimits) -> type:
    """An ``H11Protocol`` subclass bound to ``limits`` (pass it as uvicorn's ``http``)."""

    class GuardedH11Protocol(H11Protocol):
        _limits = limits

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._address = self.client[0] if self.client else ""
            open_now = self._limits.open_by_address.get(self._address, 0)
            if open_now >= self._limits.max_connections_per_client:
                self._counted = False
                self._limits.refused += 1
                _refuse(transport, self._limits.max_connections_per_client)
                return
            self._counted = True
            self._limits.open_by_address[self._address] = open_now + 1
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            if getattr(self, "_counted", False):
                self._counted = False
                counts = self._limits.streams_by_address if self._stream else self._limits.open_by_address
                left = counts.get(self._address, 1) - 1
                if left > 0:
                    counts[self._address] = left
                else:
                    counts.pop(self._address, None)
            super().connection_lost(exc)

        _stream = False  # counted under the dashboard streams' cap, not the API's

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_header_timer()  # the start of the next request head on a kept-alive connection
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm_header_timer()  # the head is complete: the app owns the request now
                if not self._stream and self._counted and self.cycle.scope.get("path") in STREAM_PATHS:
                    self._to_stream_cap()

        def _to_stream_cap(self) -> None:
            """A dashboard's stream stays open for as long as the page: it leaves the API
            connections' cap for its own, so open dashboards never make ``/health`` a 429."""
            limits, addr = self._limits, self._address
            limits.open_by_address[addr] = limits.open_by_address.get(addr, 1) - 1
            if limits.open_by_address[addr] <= 0:
                limits.open_by_address.pop(addr, None)
            self._stream = True
            streams = limits.streams_by_address.get(addr, 0)
            limits.streams_by_address[addr] = streams + 1
            if streams >= limits.max_dashboard_streams_per_client:
                limits.refused += 1
                self.cycle.disconnected = True  # the app's writes to this connection are dropped
                _refuse(self.transport, limits.max_dashboard_streams_per_client, "dashboard streams")

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm_header_timer()  # idle until the next byte: uvicorn's keep-alive timeout applies

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(self._limits.header_timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self._limits.timed_out += 1
                self.transport.close()

    return GuardedH11Protocol


def _refuse(transport: asyncio.Transport, cap: int, what: str = "connections") -> None:
    body = json.dumps({"error": {"message": f"too many open {what} from this address (at most {cap})",
                                 "type": "rate_limit_error", "param": None,
                                 "code": "too_many_connections"}}).encode()
    transport.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    transport.close()
