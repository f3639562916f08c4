"""``POST /v1/chat/completions``: the chat template, then a stream of deltas (role
first) or one message per choice.

A message's content is built in one place for each shape (:meth:`ChatServing._delta`
for a stream chunk, :meth:`ChatServing._message` for a whole response), so what a
message can carry besides text is added there. With tools in play
(:mod:`frontend.tool_calls`) the text goes through the tool-call parser, and a choice
that made calls carries ``tool_calls`` and ends with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend import tool_calls
from frontend.http_errors import HTTPError
from frontend.lifecycle import ChoiceState, choice_events, start_choices, watch_disconnect
from frontend.params import PromptInfo, chat_prompt, check_work, sampling_params
from frontend.render import chat_logprobs, sse, sse_response, usage
from frontend.schemas import ChatCompletionRequest
from frontend.serving import Serving
from frontend.structured import checked, constraints_of, one_constraint
from shared import protocol as p

AUTO_NEEDS_FLAG = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                   '(or send tool_choice "required", a named function, or "none")')


class ChatServing(Serving):
    """One per app; :meth:`create` is the endpoint."""

    async def create(self, request: Request) -> Response:
        fe = self.fe
        body: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        mode = tool_calls.mode_of(body)
        if mode == "auto" and not fe.config.enable_auto_tool_choice:
            raise HTTPError(400, AUTO_NEEDS_FLAG, param="tool_choice")
        found = constraints_of(body)
        if mode in ("required", "named"):
            found.append(("tool_choice", tool_calls.forced_constraint(body)))
        one = one_constraint(found)
        constraint = await checked(*one) if one else None
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if mode else None
        prompt = chat_prompt(fe, body.messages, body.add_generation_prompt, tools=tools,
                             tool_template=tool_calls.uses_tools(body))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        plans = [(prompt, sampling_params(fe, body, prompt, None, logprobs, constraint=constraint))]
        check_work(fe, plans, body.n or 1, logprobs)
        choices = await start_choices(fe, request, body, plans, body.n or 1)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": fe.model_name}
        if body.stream:
            return sse_response(self._stream(body, prompt, choices, base, mode))
        return await self._full(request, body, prompt, choices, base, mode)

    def _logprobs(self, body: ChatCompletionRequest, lps: list[p.TokenLogprob]) -> dict | None:
        if not body.logprobs:
            return None
        return {"content": chat_logprobs(self.fe, lps, bool(body.return_tokens_as_token_ids))}

    @staticmethod
    def _delta(text: str) -> dict:
        """A stream chunk's ``delta`` for ``text`` (empty: nothing new)."""
        return {"content": text} if text else {}

    @staticmethod
    def _message(text: str, mode: str | None = None) -> tuple[dict, bool]:
        """A whole response's ``message``, and whether it calls tools."""
        if mode is not None:
            parsed = tool_calls.parse(text)
            if parsed.calls:
                return {"role": "assistant", "content": parsed.text,
                        "tool_calls": [c.as_openai() for c in parsed.calls]}, True
        return {"role": "assistant", "content": text}, False

    @staticmethod
    def _tool_deltas(parser: tool_calls.ToolCallParser, events: list[tuple]) -> list[dict]:
        """Parser events as stream ``delta`` objects: content, a call's id and name, its
        arguments in pieces (OpenAI's ``delta.tool_calls`` with ``index``)."""
        out: list[dict] = []
        for event in events:
            if event[0] == "content":
                if out and set(out[-1]) == {"content"}:
                    out[-1]["content"] += event[1]
                else:
                    out.append({"content": event[1]})
            elif event[0] == "call":
                call = parser.calls[event[1]]
                out.append({"tool_calls": [{"index": event[1], "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]})
        return out

    async def _stream(self, body: ChatCompletionRequest, prompt: PromptInfo, choices: list[ChoiceState],
                      base: dict, mode: str | None = None) -> AsyncIterator[str]:
        usage_chunks = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choice_body: dict) -> str:
            c = {**base, "choices": [choice_body]}
            return sse({**c, "usage": None} if usage_chunks else c)

        for c in choices:  # OpenAI sends the role first
            yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None})
        parsers = {c.index: tool_calls.ToolCallParser() for c in choices} if mode else {}
        async for choice, delta, lps in choice_events(self.fe, choices, [prompt]):
            finish = choice.finish_reason
            if not parsers:
                yield chunk({"index": choice.index, "delta": self._delta(delta), "logprobs": self._logprobs(body, lps),
                             "finish_reason": finish, "stop_reason": choice.stop_reason})
                continue
            parser = parsers[choice.index]
            events = parser.push(delta) + (parser.finish() if finish is not None else [])
            if finish == "stop" and parser.calls:
                finish = "tool_calls"
            deltas = self._tool_deltas(parser, events) or [{}]
            for i, d in enumerate(deltas):
                last = i == len(deltas) - 1
                if last and not d and not lps and finish is None:
                    continue  # nothing to say yet (text held back)
                yield chunk({"index": choice.index, "delta": d, "logprobs": self._logprobs(body, lps) if last else None,
                             "finish_reason": finish if last else None,
                             "stop_reason": choice.stop_reason if last else None})
        if usage_chunks:
            yield sse({**base, "choices": [], "usage": usage([prompt], choices)})

    async def _full(self, request: Request, body: ChatCompletionRequest, prompt: PromptInfo,
                    choices: list[ChoiceState], base: dict, mode: str | None = None) -> Response:
        texts: dict[int, list[str]] = {c.index: [] for c in choices}
        all_lps: dict[int, list] = {c.index: [] for c in choices}
        async for choice, delta, lps in watch_disconnect(request, choice_events(self.fe, choices, [prompt])):
            texts[choice.index].append(delta)
            all_lps[choice.index].extend(lps)
        out = []
        for c in choices:
            message, calls = self._message("".join(texts[c.index]), mode)
            out.append({"index": c.index, "message": message, "logprobs": self._logprobs(body, all_lps[c.index]),
                        "finish_reason": "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason,
                        "stop_reason": c.stop_reason})
        return JSONResponse({**base, "object": "chat.completion", "choices": out, "usage": usage([prompt], choices)})
