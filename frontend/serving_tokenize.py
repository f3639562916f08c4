"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): text or chat messages to token
ids with the server's own tokenizer and chat template, and back."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.params import chat_prompt, check_ids
from frontend.schemas import DetokenizeRequest, TokenizeRequest
from frontend.serving import Serving


class TokenizeServing(Serving):
    async def tokenize(self, request: Request) -> Response:
        fe = self.fe
        body: TokenizeRequest = await self.parse(request, TokenizeRequest)
        if body.messages is not None:
            ids = chat_prompt(fe, body.messages, body.add_generation_prompt,
                              add_special_tokens=bool(body.add_special_tokens)).token_ids
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = fe.tokenizer.encode(body.prompt, add_special_tokens=add)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": fe.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        fe = self.fe
        body: DetokenizeRequest = await self.parse(request, DetokenizeRequest)
        check_ids(fe, body.tokens, "tokens")
        return JSONResponse({"prompt": fe.tokenizer.decode(body.tokens)})
