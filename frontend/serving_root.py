"""What a browser or a new user finds at the server's top: ``GET /`` (where to go next),
``GET /openapi.json`` (the API described from the request models) and ``GET /docs`` (that
description to read and try, with Swagger UI).

``/`` answers JSON (the model, the version, and the paths of the dashboard, the docs,
the OpenAI API under ``/v1`` and the status endpoints), or a small HTML page with the same
links when a browser asks for HTML. ``/openapi.json`` is OpenAPI 3.1 generated from the
pydantic models of :mod:`frontend.schemas`, so it always says what the server validates.
``/docs`` loads Swagger UI 5.35.0 (Apache-2.0, vendored in ``frontend/static/docs/`` with
its ``LICENSE``, ``NOTICE`` and the bundle's third-party licences): nothing is fetched from
anywhere but this server. None of the three needs the API key: they describe the server,
they do not use it.
"""

from __future__ import annotations

import html
from functools import lru_cache
from pathlib import Path

from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from frontend.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from frontend.serving import Serving
from frontend.serving_status import VERSION

DOCS_DIR = Path(__file__).resolve().parent / "static" / "docs"

LINKS = {
    "dashboard": "/dashboard",
    "docs": "/docs",
    "openapi": "/openapi.json",
    "api": "/v1",
    "models": "/v1/models",
    "health": "/health",
    "version": "/version",
    "scheduler_stats": "/scheduler/stats",
    "metrics": "/metrics",
}

# (method, path, request model or None, summary)
OPERATIONS = [
    ("post", "/v1/completions", CompletionRequest, "Text completion (OpenAI's legacy completions, vLLM's extensions)"),
    ("post", "/v1/chat/completions", ChatCompletionRequest, "Chat completion, streamed (SSE) or whole"),
    ("get", "/v1/models", None, "The served model"),
    ("get", "/v1/models/{model_id}", None, "One model by id"),
    ("post", "/tokenize", TokenizeRequest, "Token ids of a prompt or of chat messages"),
    ("post", "/detokenize", DetokenizeRequest, "Text of token ids"),
    ("get", "/health", None, "200 when every engine is up and the server is not draining, else 503"),
    ("get", "/version", None, "What runs: model, device, dtype, threads, backend, prefill mode, policy, transport"),
    ("get", "/scheduler/stats", None, "Every engine's queues, gates and blocks"),
    ("get", "/scheduler/stats/stream", None, "The same as server-sent events (the dashboard's feed)"),
    ("get", "/metrics", None, "Prometheus metrics"),
]

ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {}}, "required": ["message", "type"]}}}


@lru_cache(maxsize=1)
def openapi_document() -> dict:
    """The OpenAPI 3.1 description of the routes in :data:`OPERATIONS`; request bodies
    are the pydantic models' JSON Schemas (validation mode)."""
    models = sorted({m for _, _, m, _ in OPERATIONS if m is not None}, key=lambda m: m.__name__)
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    paths: dict = {}
    for method, path, model, summary in OPERATIONS:
        op: dict = {"summary": summary, "responses": {
            "200": {"description": "OK"},
            "400": {"description": "A client mistake", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            "429": {"description": "Overloaded or too large for this server (see Retry-After)"},
            "503": {"description": "No engine is up, or the server is draining"}}}
        if model is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": refs[(model, "validation")]}}}
        if "{model_id}" in path:
            op["parameters"] = [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths.setdefault(path, {})[method] = op
    schemas = {**defs.get("$defs", {}), "Error": ERROR}
    return {"openapi": "3.1.0",
            "info": {"title": "tickserve", "version": VERSION,
                     "description": "OpenAI-compatible completions and chat, with the scheduler's own endpoints."},
            "paths": paths, "components": {"schemas": schemas,
                                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


DOCS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tickserve API</title>
<link rel="stylesheet" href="/docs/static/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="/docs/static/swagger-ui-bundle.js"></script>
<script>window.ui = SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui"});</script>
</body></html>
"""


class RootServing(Serving):
    """``/``, ``/openapi.json`` and ``/docs`` (one per app)."""

    async def root(self, request: Request) -> Response:
        body = {"name": "tickserve", "version": VERSION, "model": self.fe.model_name, "links": LINKS}
        if "text/html" not in request.headers.get("accept", ""):
            return JSONResponse(body)
        items = "".join(f'<li><a href="{html.escape(path)}">{html.escape(path)}</a> ({html.escape(name)})</li>'
                        for name, path in LINKS.items())
        return HTMLResponse(f"<!doctype html><html lang=en><head><meta charset=utf-8><title>tickserve</title></head>"
                            f"<body><h1>tickserve {VERSION}</h1><p>Serving <code>{html.escape(self.fe.model_name)}"
                            f"</code>. The OpenAI API is under <code>/v1</code>.</p><ul>{items}</ul></body></html>")

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())

    async def docs(self, request: Request) -> Response:
        return HTMLResponse(DOCS_PAGE)

    def routes(self) -> list:
        return [Route("/", self.root, methods=["GET"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),
                Route("/docs", self.docs, methods=["GET"]),
                Mount("/docs/static", app=StaticFiles(directory=DOCS_DIR), name="docs-static")]
