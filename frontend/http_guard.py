"""Connection guards under uvicorn's HTTP/1.1 protocol: stalled clients are dropped and
no client address holds more than its share of connections.

uvicorn closes idle keep-alive connections, but a connection that sends half a request
head and stops (slowloris) stays open for good, and nothing limits how many one client
opens. :class:`GuardedH11Protocol` adds, per connection:

* a **header deadline** (``header_timeout_s``): from the connection's first byte (or the
  end of its previous response) to a complete request head; past it the connection is
  closed without an answer;
* a **per-address cap** (``max_connections_per_client``): a connection beyond it gets
  ``429`` in OpenAI's error shape and is closed at once.

The request *body* is bounded by time in the app (:func:`frontend.request_body.read_body`),
which can answer it with a proper error.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass
class ConnectionLimits:
    header_timeout_s: float = 10.0
    max_connections_per_client: int = 512
    open_by_address: dict[str, int] = field(default_factory=dict)  # shared by every connection
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
                left = self._limits.open_by_address.get(self._address, 1) - 1
                if left > 0:
                    self._limits.open_by_address[self._address] = left
                else:
                    self._limits.open_by_address.pop(self._address, None)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_header_timer()  # the start of the next request head on a kept-alive connection
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm_header_timer()  # the head is complete: the app owns the request now

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


def _refuse(transport: asyncio.Transport, cap: int) -> None:
    body = json.dumps({"error": {"message": f"too many open connections from this address (at most {cap})",
                                 "type": "rate_limit_error", "param": None,
                                 "code": "too_many_connections"}}).encode()
    transport.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    transport.close()
