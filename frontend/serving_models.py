"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model this server serves."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.http_errors import HTTPError
from frontend.serving import Serving


class ModelsServing(Serving):
    def _model_card(self) -> dict:
        return {"id": self.fe.model_name, "object": "model", "created": 0, "owned_by": "tickserve",
                "max_model_len": self.fe.max_model_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}`` (the openai client's ``models.retrieve``)."""
        model_id = request.path_params["model_id"]
        if model_id != self.fe.model_name:
            raise HTTPError(404, f"the model {model_id!r} does not exist; this server serves "
                                 f"{self.fe.model_name!r}", param="model", code="model_not_found")
        return JSONResponse(self._model_card())
