"""``POST /v1/chat/completions``: the chat template, then a stream of deltas (role
first) or one message per choice.

A message's content is built in one place for each shape (:meth:`ChatServing._delta`
for a stream chunk, :meth:`ChatServing._message` for a whole response), so what a
message can carry besides text is added there.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.lifecycle import ChoiceState, choice_events, start_choices, watch_disconnect
from frontend.params import PromptInfo, chat_prompt, check_work, sampling_params
from frontend.render import chat_logprobs, sse, sse_response, usage
from frontend.schemas import ChatCompletionRequest
from frontend.serving import Serving
from shared import protocol as p


class ChatServing(Serving):
    """One per app; :meth:`create` is the endpoint."""

    async def create(self, request: Request) -> Response:
        fe = self.fe
        body: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        prompt = chat_prompt(fe, body.messages, body.add_generation_prompt)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        plans = [(prompt, sampling_params(fe, body, prompt, None, logprobs))]
        check_work(fe, plans, body.n or 1, logprobs)
        choices = await start_choices(fe, request, body, plans, body.n or 1)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": fe.model_name}
        if body.stream:
            return sse_response(self._stream(body, prompt, choices, base))
        return await self._full(request, body, prompt, choices, base)

    def _logprobs(self, body: ChatCompletionRequest, lps: list[p.TokenLogprob]) -> dict | None:
        if not body.logprobs:
            return None
        return {"content": chat_logprobs(self.fe, lps, bool(body.return_tokens_as_token_ids))}

    @staticmethod
    def _delta(text: str) -> dict:
        """A stream chunk's ``delta`` for ``text`` (empty: nothing new)."""
        return {"content": text} if text else {}

    @staticmethod
    def _message(text: str) -> dict:
        """A whole response's ``message``."""
        return {"role": "assistant", "content": text}

    async def _stream(self, body: ChatCompletionRequest, prompt: PromptInfo, choices: list[ChoiceState],
                      base: dict) -> AsyncIterator[str]:
        usage_chunks = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choice_body: dict) -> str:
            c = {**base, "choices": [choice_body]}
            return sse({**c, "usage": None} if usage_chunks else c)

        for c in choices:  # OpenAI sends the role first
            yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None})
        async for choice, delta, lps in choice_events(self.fe, choices, [prompt]):
            yield chunk({"index": choice.index, "delta": self._delta(delta), "logprobs": self._logprobs(body, lps),
                         "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})
        if usage_chunks:
            yield sse({**base, "choices": [], "usage": usage([prompt], choices)})

    async def _full(self, request: Request, body: ChatCompletionRequest, prompt: PromptInfo,
                    choices: list[ChoiceState], base: dict) -> Response:
        texts: dict[int, list[str]] = {c.index: [] for c in choices}
        all_lps: dict[int, list] = {c.index: [] for c in choices}
        async for choice, delta, lps in watch_disconnect(request, choice_events(self.fe, choices, [prompt])):
            texts[choice.index].append(delta)
            all_lps[choice.index].extend(lps)
        return JSONResponse({
            **base, "object": "chat.completion",
            "choices": [{"index": c.index, "message": self._message("".join(texts[c.index])),
                         "logprobs": self._logprobs(body, all_lps[c.index]),
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices],
            "usage": usage([prompt], choices)})
