"""Reading and validating a request body: size- and time-limited, strict UTF-8, JSON,
no lone surrogates, then the endpoint's pydantic schema and its ``problem()``; every
failure a 400 (413 too large, 408 too slow) that names the field."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import Any

from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request

from frontend.http_errors import ClientGone, HTTPError
from shared.config import FrontendConfig

log = logging.getLogger("tickserve.frontend")


async def read_body(request: Request, config: FrontendConfig) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed the limit."""
    limit = config.max_body_bytes
    too_large = HTTPError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), config.body_timeout_s)
    except ClientDisconnect:
        raise ClientGone() from None
    except asyncio.TimeoutError:
        raise HTTPError(408, f"the request body did not arrive within {config.body_timeout_s:g} s",
                        code="request_timeout") from None
    return b"".join(chunks)


async def parse_body(request: Request, schema, config: FrontendConfig):
    """The body as ``schema`` (a pydantic model with a ``problem()`` check). Raises
    :class:`~frontend.http_errors.HTTPError` (400, 408, 413) or ClientGone."""
    raw = await read_body(request, config)
    try:  # strictly: json.loads(bytes) would let encoded lone surrogates (ED A0 80) through
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HTTPError(400, f"the request body is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # bad JSON, huge integers, deep nesting
        raise HTTPError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    if b"\\u" in raw:
        _check_unicode(data)
    try:
        body = schema.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    ignored = set(data) - known_fields(schema)
    if ignored:  # as vLLM: once per request, so a misspelt or unsupported field is not silently dropped
        log.warning("The following fields were present in the request but ignored: %s", sorted(ignored))
    problem = body.problem()
    if problem:
        raise HTTPError(400, problem[1], param=problem[0])
    return body


@functools.cache
def known_fields(schema) -> frozenset[str]:
    """The top-level field names (and aliases) ``schema`` reads."""
    return frozenset(name for key, f in schema.model_fields.items() for name in (key, f.alias) if name)


def _check_unicode(data: Any) -> None:
    """JSON ``\\ud800`` escapes decode to lone surrogates, which are not text: no
    tokenizer or UTF-8 encoder accepts them. Refuse them here (HTTP 400)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise HTTPError(400, "the request body contains a lone UTF-16 surrogate (\\ud800-\\udfff "
                             "escape); strings must be valid Unicode") from None
    except RecursionError:
        raise HTTPError(400, "the request body is nested too deeply") from None


# Fields that accept several shapes: pydantic's per-shape errors ("prompt.str: Input
# should be a valid string") would name one shape the client never meant.
_UNION_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids (integers >= 0) or a list of such lists",
    "stop": "a non-empty string or a list of up to 16 non-empty strings",
    "content": "a string or a list of text parts",
}


def _validation_error(exc: ValidationError) -> HTTPError:
    """Pydantic's first error as a 400 naming the top-level field (``param``)."""
    err = exc.errors(include_url=False, include_input=False, include_context=False)[0]
    loc = [str(x) for x in err["loc"]]
    for i, part in enumerate(loc):
        if part in _UNION_SHAPES and len(loc) > i + 1:
            return HTTPError(400, f"{'.'.join(loc[:i + 1])} must be {_UNION_SHAPES[part]}", param=loc[0])
    path = ".".join(loc)
    msg = err["msg"].removeprefix("Value error, ")
    message = f"{path}: {msg}" if path else msg
    more = len(exc.errors()) - 1
    if more:
        message += f" (and {more} more error{'s' if more > 1 else ''})"
    return HTTPError(400, message, param=loc[0] if loc else None)
