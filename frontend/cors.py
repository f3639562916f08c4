"""Cross-origin requests (CORS) for browser apps on another origin; off by default.

``--allowed-origins`` takes a comma-separated list of origins (``https://app.example``)
or ``*``. When set, Starlette's :class:`~starlette.middleware.cors.CORSMiddleware`
answers preflight ``OPTIONS`` requests and adds ``Access-Control-Allow-Origin`` to
responses for those origins; the ``Authorization`` header may be sent (for
``--api-key``). When empty, no CORS header is ever sent and a preflight is a 405.
"""

from __future__ import annotations

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware


def parse_origins(value: str) -> list[str]:
    """``"https://a, https://b"`` → ``["https://a", "https://b"]``; empty → ``[]``."""
    return [o.strip().rstrip("/") for o in value.split(",") if o.strip()]


def cors_middleware(allowed_origins: str) -> list[Middleware]:
    """The middleware list for :class:`~starlette.applications.Starlette` (empty when off)."""
    origins = parse_origins(allowed_origins)
    if not origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["Authorization", "Content-Type", "X-Session-Id"],
                       expose_headers=["Retry-After"], max_age=600)]
