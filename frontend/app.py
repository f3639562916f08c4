"""The HTTP frontend's router: OpenAI-compatible endpoints on Starlette.

Per request: read the body (size-limited) → validate (pydantic, then the request's
``problem()``, then what needs the tokenizer and the engine's limits) → tokenize /
chat template → submit each choice to the engine and wait for its ack (a rejection
becomes 429/400/503 *before* any SSE byte) → detokenize incrementally, apply stop
strings, stream SSE or collect. Nothing reaches the engine before the whole request
is known to be valid, so a rejected request leaves no trace there.

A client that disconnects, or a stop string that matches, aborts the engine row.
If the engine fails or goes away mid-request, a stream ends with an SSE error event
and ``data: [DONE]``, a non-stream request gets 503, and ``/health`` says 503 until
an engine is back.

Where each step lives::

    request_body.py        reading and validating the body (size, time, UTF-8, JSON, schema)
    schemas.py             the request models (pydantic)
    params.py              OpenAI fields → SamplingParams; prompts → token ids, chat template
    lifecycle.py           submit / ack, the merged token stream, stop strings, abort, disconnect
    render.py              usage, logprobs, SSE
    serving_completions.py, serving_chat.py, serving_models.py, serving_tokenize.py,
    serving_status.py,
    serving_root.py        one module per endpoint family
    http_errors.py         every non-2xx answer, in OpenAI's shape

This module builds the app: the routes, authentication, error rendering and CORS.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend import dashboard
from frontend.context import Frontend
from frontend.cors import cors_middleware
from frontend.engine_set import EngineSet
from frontend.http_errors import ClientGone, HTTPError
from frontend.request_log import RequestLog
from frontend.stats_log import StatsLog
from frontend.serving_chat import ChatServing
from frontend.serving_completions import CompletionsServing
from frontend.serving_models import ModelsServing
from frontend.serving_root import RootServing
from frontend.serving_status import StatusServing
from frontend.serving_tokenize import TokenizeServing
from shared.config import FrontendConfig

log = logging.getLogger("tickserve.frontend")


def _authorized(request: Request, api_key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def _wrap(handler, frontend: Frontend):
    """Auth (when an API key is configured), then the handler; every failure is an
    OpenAI-shaped error, never a bare 500."""
    async def endpoint(request: Request) -> Response:
        if frontend.config.api_key and not _authorized(request, frontend.config.api_key):
            return HTTPError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}).response()
        try:
            return await handler(request)
        except HTTPError as exc:
            return exc.response()
        except ClientGone:
            return Response(status_code=499)
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            return HTTPError(500, "internal server error", "server_error", code="internal_error").response()
    return endpoint


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405 in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    return HTTPError(exc.status_code, exc.detail, headers=dict(exc.headers or {})).response()


def create_app(config: FrontendConfig, tokenizer, model_name: str,
               client: EngineSet | None = None) -> Starlette:
    """The Starlette app. The engine client starts in the lifespan; until its handshake
    with the engine completes, /health and generation endpoints answer 503."""
    client = client or EngineSet(config)
    frontend = Frontend(config, tokenizer, client, model_name)

    hub = dashboard.make_hub(frontend)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        client.start(asyncio.get_running_loop())  # /health is 503 until the handshake completes
        stats_task = None if config.disable_log_stats else \
            asyncio.get_running_loop().create_task(StatsLog(hub.current).run(config.log_stats_interval_s))
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            client.close()

    models, tokens, status = ModelsServing(frontend), TokenizeServing(frontend), StatusServing(frontend)
    routes = [
        Route("/v1/completions", _wrap(CompletionsServing(frontend).create, frontend), methods=["POST"]),
        Route("/v1/chat/completions", _wrap(ChatServing(frontend).create, frontend), methods=["POST"]),
        Route("/v1/models", _wrap(models.models, frontend), methods=["GET"]),
        Route("/v1/models/{model_id:path}", _wrap(models.model, frontend), methods=["GET"]),
        Route("/tokenize", _wrap(tokens.tokenize, frontend), methods=["POST"]),
        Route("/detokenize", _wrap(tokens.detokenize, frontend), methods=["POST"]),
        Route("/health", status.health, methods=["GET"]),
        Route("/version", status.version, methods=["GET"]),
        Route("/scheduler/stats", _wrap(status.scheduler_stats, frontend), methods=["GET"]),
        Route("/metrics", _wrap(status.prometheus, frontend), methods=["GET"]),
        *dashboard.routes(frontend, hub),
        *RootServing(frontend).routes(),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_exception},
                    middleware=[Middleware(RequestLog, enabled=config.log_requests),
                                *cors_middleware(config.allowed_origins)])
    app.state.frontend = frontend
    return app
