"""Every non-2xx answer of the frontend, in OpenAI's error shape.

:class:`HTTPError` is raised anywhere in a request's handling and rendered by the
router (:mod:`frontend.app`): 400 for a client mistake, 429 for overload, 503 while no
engine can serve, never a 5xx for a client mistake. :class:`EngineError` is the engine
failing a request that was already accepted; :class:`ClientGone`, the HTTP client leaving.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from frontend.schemas import error_body
from shared import protocol as p
from shared.constraints import COMPILE_FAILED

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
                413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable"}


class HTTPError(Exception):
    """An answer other than 2xx, rendered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, type_: str | None = None,
                 param: str | None = None, code: Any = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _ERROR_TYPES.get(status, "server_error")
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status, headers=self.headers)


def unavailable(message: str, code: str = "engine_unavailable") -> HTTPError:
    return HTTPError(503, message, "service_unavailable", code=code, headers={"Retry-After": "1"})


def reject_error(reason: p.RejectReason) -> HTTPError:
    """The engine's refusal as HTTP: 400 for a client mistake, 429 for overload (with
    ``Retry-After`` only when waiting can help: a request that can never fit has none),
    503 while the engine drains."""
    status = reason.code.http_status
    headers = {"Retry-After": "1"} if status in (429, 503) and reason.retryable else {}
    param = "max_tokens" if reason.code is p.RejectCode.CONTEXT_LENGTH else None
    return HTTPError(status, reason.message, param=param, code=reason.code.value, headers=headers)


class EngineError(Exception):
    """The engine failed a request mid-generation, or went away (died, restarted,
    lost messages). Either way the request cannot finish: HTTP 503 before the
    headers, an SSE error event after them."""

    def __init__(self, message: str, unavailable: bool):
        super().__init__(message)
        self.unavailable = unavailable

    def http_error(self) -> HTTPError:
        if not self.unavailable and str(self).startswith(COMPILE_FAILED):  # the client's constraint
            return HTTPError(400, str(self), code="invalid_constraint")
        return unavailable(str(self), "engine_unavailable" if self.unavailable else "engine_error")


class ClientGone(Exception):
    """The HTTP client disconnected."""
