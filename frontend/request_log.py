"""One log line per HTTP request, written when its response ends (an SSE stream's too).

::

    2026-12-03 07:01:12,345 tickserve.request INFO 127.0.0.1 "POST /v1/chat/completions" 200
        prompt_tokens=31 completion_tokens=40 ttft=0.081s latency=1.204s request_id=3f2a9c-7

(one line). ``prompt_tokens`` and ``completion_tokens`` are the usage's counts summed
over a request's choices, ``ttft`` is from the request's arrival to its first generated
token, ``latency`` to its last byte, both in seconds; ``request_id`` is the engine's id of
the first choice (the one the engine's own lines name), ``+k`` more for ``n > 1``.
Requests that generate nothing (``/v1/models``, a 400, a 503) have ``-`` for the
counts they lack; a ``/health`` that answers 200 (a probe's) has no line, nor do the
503s ``tickserve serve`` gets while it waits to print its ready line. On by default; ``--disable-log-requests`` (or vLLM's
``--disable-uvicorn-access-log``) turns it off.

:class:`RequestLog` is a pure ASGI middleware; generation endpoints hand it their choices
with :func:`attach` once they are submitted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tickserve.request")

SCOPE_KEY = "request_log"
READY_PROBE_AGENT = b"tickserve-ready-line"  # shared/ready_line.py's PROBE_AGENT


@dataclass
class RequestRecord:
    """What the line of one request reports; ``start`` in monotonic seconds."""

    start: float
    status: int | None = None
    choices: list[Any] = field(default_factory=list)  # lifecycle.ChoiceState
    prompt_tokens: int | None = None

    def line(self, client: str, method: str, path: str, now: float) -> str:
        status = self.status if self.status is not None else "-"
        parts = [f'{client} "{method} {path}" {status}']
        if self.choices:
            firsts = [c.timer.first for c in self.choices if c.timer is not None and c.timer.first is not None]
            ttft = f"{min(firsts) - self.start:.3f}s" if firsts else "-"
            completion = sum(c.completion_tokens for c in self.choices)
            more = f"+{len(self.choices) - 1}" if len(self.choices) > 1 else ""
            parts.append(f"prompt_tokens={self.prompt_tokens} completion_tokens={completion} ttft={ttft} "
                         f"latency={now - self.start:.3f}s request_id={self.choices[0].request_id}{more}")
        else:
            parts.append(f"prompt_tokens=- completion_tokens=- ttft=- latency={now - self.start:.3f}s request_id=-")
        return " ".join(parts)


def attach(request, choices: list, prompt_tokens: int) -> None:
    """Give the request's line its submitted ``choices`` and the prompt tokens they carry
    (summed over prompts, once per prompt as the usage counts them)."""
    record = request.scope.get("state", {}).get(SCOPE_KEY)
    if record is not None:
        record.choices = choices
        record.prompt_tokens = prompt_tokens


def _is_ready_probe(scope) -> bool:
    return any(k == b"user-agent" and v == READY_PROBE_AGENT for k, v in scope.get("headers") or ())


class RequestLog:
    """ASGI middleware: one INFO line on ``tickserve.request`` per HTTP request."""

    def __init__(self, app, enabled: bool = True):
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.enabled:
            await self.app(scope, receive, send)
            return
        record = RequestRecord(time.monotonic())
        scope.setdefault("state", {})[SCOPE_KEY] = record

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            if record.status is None:
                record.status = 500
            raise
        finally:
            client = scope.get("client")
            path = scope.get("path", "")
            # probes (Kubernetes, the ready line) ask /health every few seconds: a 200 has no
            # line, a 503 has one, unless it is tickserve serve's own wait for its ready line
            if path != "/health" or (record.status != 200 and not _is_ready_probe(scope)):
                log.info("%s", record.line(client[0] if client else "-", scope.get("method", ""), path,
                                           time.monotonic()))
