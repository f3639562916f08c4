"""What every endpoint family starts from (as vLLM's ``OpenAIServing``): the frontend's
state, and a request body read, validated and checked to name this server's model."""

from __future__ import annotations

from starlette.requests import Request

from frontend.context import Frontend
from frontend.params import check_model
from frontend.request_body import parse_body


class Serving:
    """The base of the ``serving_*`` classes; one instance per app."""

    def __init__(self, fe: Frontend):
        self.fe = fe

    async def parse(self, request: Request, schema):
        """The body as ``schema``, naming this server's model (or none). Raises
        :class:`~frontend.http_errors.HTTPError` (400, 404, 408, 413) or ClientGone."""
        body = await parse_body(request, schema, self.fe.config)
        check_model(self.fe, body)
        return body
