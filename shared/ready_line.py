"""``tickserve serve``'s ready line: once every engine is warm and a frontend answers,
one line on stdout with the server's URL and its dashboard's::

    tickserve ready: http://127.0.0.1:8000 (dashboard http://127.0.0.1:8000/dashboard)

An engine binds its sockets only after its warm-up pass, and a frontend counts it up
after their handshake; the line waits for ``GET /health`` to say 200 and count every
engine up (it answers without an API key), asked through the port the supervisor bound. A restarted engine does not print it again.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Callable

PROBE_AGENT = "tickserve-ready-line"  # the frontend's request log leaves these probes out


def public_url(host: str, port: int) -> str:
    """``http://HOST:PORT`` as a user types it (IPv6 in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def ready_line(host: str, port: int) -> str:
    url = public_url(host, port)
    return f"tickserve ready: {url} (dashboard {url}/dashboard)"


def _local(host: str) -> str:
    """Where to connect to reach a server bound on ``host`` (a wildcard → loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def is_ready(host: str, port: int, num_engines: int, timeout_s: float = 1.0) -> bool:
    """``/health`` is 200 and counts all ``num_engines`` engines up."""
    base = public_url(_local(host), port)
    try:
        probe = urllib.request.Request(f"{base}/health", headers={"User-Agent": PROBE_AGENT})
        with urllib.request.urlopen(probe, timeout=timeout_s) as r:
            return r.status == 200 and int(json.loads(r.read()).get("num_engines_up", 0)) >= num_engines
    except (OSError, ValueError, urllib.error.URLError, AttributeError, TypeError):
        return False  # not listening yet, or 503 (HTTPError is an OSError)


def announce_when_ready(host: str, port: int, num_engines: int, stopping: Callable[[], bool],
                        interval_s: float = 0.2) -> bool:
    """Poll :func:`is_ready` every ``interval_s`` seconds until it holds (then print
    :func:`ready_line`, flushed, and return ``True``) or ``stopping()`` (``False``)."""
    while not stopping():
        if is_ready(host, port, num_engines):
            print(ready_line(host, port), flush=True)
            return True
        time.sleep(interval_s)
    return False
