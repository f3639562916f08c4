"""The HTTP frontend: OpenAI-compatible endpoints on Starlette.

Per request: validate (pydantic) → tokenize / chat template → submit each choice to
the engine and wait for its ack (a rejection becomes 429/400/503 *before* any SSE
byte) → detokenize incrementally, apply stop strings, stream SSE or collect.
A client that disconnects, or a stop string that matches, aborts the engine row.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from frontend.detokenizer import TextStream
from frontend.engine_client import EngineClient, EngineUnavailable, Rejected, RequestStream
from frontend.schemas import (DEFAULT_MAX_TOKENS_COMPLETIONS, ChatCompletionRequest, CompletionRequest,
                              DetokenizeRequest, TokenizeRequest, error_body)
from shared import protocol as p
from shared.config import FrontendConfig

log = logging.getLogger("tickserve.frontend")

VERSION = "0.1.0"


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: Any = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status, headers=self.headers)


def _reject_error(reason: p.RejectReason) -> HTTPError:
    status = reason.code.http_status
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    type_ = {429: "rate_limit_error", 503: "service_unavailable", 400: "invalid_request_error"}[status]
    return HTTPError(status, reason.message, type_, code=reason.code.value, headers=headers)


@dataclass
class ChoiceState:
    """One generated choice: its engine stream, text stream and counters."""

    index: int
    request_id: str
    prompt_index: int
    stream: RequestStream
    text: TextStream
    completion_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[p.TokenLogprob] = field(default_factory=list)


@dataclass
class PromptInfo:
    token_ids: list[int]
    text: str
    cached_tokens: int = 0


class Frontend:
    """Holds the tokenizer, the engine client and the per-endpoint logic."""

    def __init__(self, config: FrontendConfig, tokenizer, client: EngineClient, model_name: str):
        self.config = config
        self.tokenizer = tokenizer
        self.client = client
        self.model_name = model_name
        self.draining = False

    # ------------------------------------------------------------------ helpers

    @property
    def max_model_len(self) -> int:
        welcome = self.client.welcome
        return welcome.max_model_len if welcome else 2048

    async def _parse(self, request: Request, schema):
        body = await request.body()
        if len(body) > self.config.max_body_bytes:
            raise HTTPError(413, f"request body exceeds {self.config.max_body_bytes} bytes")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HTTPError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "request body must be a JSON object")
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(x) for x in err["loc"]) or None
            raise HTTPError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None

    def _check_model(self, body) -> None:
        if body.model not in (None, "", self.model_name):
            raise HTTPError(404, f"the model {body.model!r} does not exist; this server serves "
                                 f"{self.model_name!r}", "not_found_error", "model", "model_not_found")

    def _max_tokens(self, body, prompt_len: int, default: int | None) -> int:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise HTTPError(400, f"this model's maximum context length is {limit} tokens; the prompt "
                                 f"has {prompt_len}", param="prompt", code="context_length_exceeded")
        asked = body.max_new_tokens
        if asked is None:
            return min(default, limit - prompt_len) if default else limit - prompt_len
        if prompt_len + asked > limit:
            raise HTTPError(400, f"this model's maximum context length is {limit} tokens; the request "
                                 f"asks for {prompt_len + asked} ({prompt_len} in the prompt, {asked} to "
                                 "generate)", param="max_tokens", code="context_length_exceeded")
        return asked

    def _check_ids(self, ids: list[int], param: str) -> None:
        vocab = len(self.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise HTTPError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param=param)

    def _prompts(self, body: CompletionRequest) -> list[PromptInfo]:
        prompt = body.prompt
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        out = []
        for item in items:
            if isinstance(item, str):
                ids = self.tokenizer.encode(item, add_special_tokens=True)
                text = item
            else:
                ids = list(item)
                self._check_ids(ids, "prompt")
                text = self.tokenizer.decode(ids)
            if not ids:
                raise HTTPError(400, "the prompt is empty after tokenization", param="prompt")
            out.append(PromptInfo(ids, text))
        return out

    def _chat_prompt(self, body: ChatCompletionRequest) -> PromptInfo:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False,
                add_generation_prompt=True if body.add_generation_prompt is None else body.add_generation_prompt)
        except Exception as exc:  # template errors are the client's messages
            raise HTTPError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return PromptInfo(ids, text)

    async def _start_choices(self, request: Request, body, prompts: list[PromptInfo], n: int,
                             max_tokens_default: int | None, logprobs: int | None) -> list[ChoiceState]:
        """Submit every (prompt, sample) pair; all-or-nothing: a rejection aborts the rest."""
        if self.draining:
            raise HTTPError(503, "the server is shutting down", "service_unavailable",
                            headers={"Retry-After": "1"})
        choices: list[ChoiceState] = []
        skip_special = True if body.skip_special_tokens is None else body.skip_special_tokens
        # Fair/VTC accounting unit: explicit session_id, the X-Session-Id header, or OpenAI's `user`.
        session = body.session_id or request.headers.get("x-session-id") or body.user
        try:
            for pi, prompt in enumerate(prompts):
                max_tokens = self._max_tokens(body, len(prompt.token_ids), max_tokens_default)
                params = body.sampling_params(max_tokens, logprobs)
                problem = params.validate()
                if problem:
                    raise HTTPError(400, problem)
                for j in range(n):
                    if params.seed is not None and n > 1:
                        params_j = p.SamplingParams(**{**params.__dict__, "seed": params.seed + j})
                    else:
                        params_j = params
                    rid = self.client.new_request_id()
                    stream = await self.client.submit(rid, prompt.token_ids, params_j,
                                                      session_id=session,
                                                      priority=body.priority or 0)
                    text = TextStream(self.tokenizer, stop=body.stop_strings,
                                      include_stop_str_in_output=bool(body.include_stop_str_in_output),
                                      skip_special_tokens=skip_special)
                    choices.append(ChoiceState(len(choices), rid, pi, stream, text))
        except Rejected as exc:
            self.client.abort([c.request_id for c in choices])
            raise _reject_error(exc.reason) from None
        except EngineUnavailable as exc:
            self.client.abort([c.request_id for c in choices])
            raise HTTPError(503, str(exc), "service_unavailable", headers={"Retry-After": "1"}) from None
        except BaseException:
            self.client.abort([c.request_id for c in choices])
            raise
        return choices

    async def _events(self, choices: list[ChoiceState], prompts: list[PromptInfo]
                      ) -> AsyncIterator[tuple[ChoiceState, str, list[p.TokenLogprob]]]:
        """Merge the choices' engine streams into ``(choice, text_delta, logprobs)``
        events; the final event of a choice has ``choice.finish_reason`` set."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: ChoiceState) -> None:
            async for out in choice.stream:
                await queue.put((choice, out))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        remaining = len(choices)
        try:
            while remaining:
                choice, out = await queue.get()
                if choice.finish_reason is not None:
                    continue  # stopped by a stop string already; late tokens are dropped
                if out.num_cached_tokens:
                    prompts[choice.prompt_index].cached_tokens = out.num_cached_tokens
                delta, stopped = choice.text.push(out.token_ids)
                choice.completion_tokens += len(out.token_ids)
                lps = list(out.logprobs or [])
                if out.error:
                    choice.finish_reason = "error"
                    raise EngineError(out.error)
                if stopped:
                    choice.finish_reason = "stop"
                    self.client.abort([choice.request_id])
                elif out.finish_reason is not None:
                    delta += choice.text.flush()
                    if choice.text.stopped:  # a stop string that only matched at the end
                        choice.finish_reason = "stop"
                    elif out.finish_reason is p.FinishReason.ABORT:
                        choice.finish_reason = "abort"
                    else:
                        choice.finish_reason = out.finish_reason.value
                if choice.finish_reason is not None:
                    remaining -= 1
                if delta or lps or choice.finish_reason is not None:
                    yield choice, delta, lps
        finally:
            for t in tasks:
                t.cancel()
            unfinished = [c.request_id for c in choices if c.finish_reason is None]
            if unfinished:
                self.client.abort(unfinished)

    def _usage(self, prompts: list[PromptInfo], choices: list[ChoiceState]) -> dict:
        prompt_tokens = sum(len(pr.token_ids) for pr in prompts)
        completion = sum(c.completion_tokens for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(pr.cached_tokens for pr in prompts)}}

    # ------------------------------------------------------------------ logprob formats

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _completion_logprobs(self, lps: list[p.TokenLogprob], offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            s = self._token_str(lp.token_id)
            tokens.append(s)
            token_lps.append(lp.logprob)
            tops.append({self._token_str(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, lps: list[p.TokenLogprob]) -> list[dict]:
        def entry(tid: int, v: float) -> dict:
            s = self._token_str(tid)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        return [{**entry(lp.token_id, lp.logprob),
                 "top_logprobs": [entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]}
                for lp in lps]

    # ------------------------------------------------------------------ endpoints

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        self._check_model(body)
        prompts = self._prompts(body)
        n = body.n or 1
        choices = await self._start_choices(request, body, prompts, n, DEFAULT_MAX_TOKENS_COMPLETIONS,
                                            body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        echo = bool(body.echo)

        def chunk(choice: ChoiceState, text: str, lps: list, finish: str | None) -> dict:
            return {"index": choice.index, "text": text,
                    "logprobs": self._completion_logprobs(lps, 0) if body.logprobs is not None else None,
                    "finish_reason": finish}

        base = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        if body.stream:
            async def sse():
                started = set()
                async for choice, delta, lps in self._events(choices, prompts):
                    if echo and choice.index not in started:
                        delta = prompts[choice.prompt_index].text + delta
                    started.add(choice.index)
                    yield _sse({**base, "choices": [chunk(choice, delta, lps, choice.finish_reason)]})
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse({**base, "choices": [], "usage": self._usage(prompts, choices)})
            return self._sse_response(request, sse(), choices)

        texts: dict[int, list[str]] = {c.index: [] for c in choices}
        all_lps: dict[int, list] = {c.index: [] for c in choices}
        async for choice, delta, lps in self._watch_disconnect(request, self._events(choices, prompts)):
            texts[choice.index].append(delta)
            all_lps[choice.index].extend(lps)
        out = []
        for c in choices:
            text = "".join(texts[c.index])
            if echo:
                text = prompts[c.prompt_index].text + text
            out.append(chunk(c, text, all_lps[c.index], c.finish_reason))
        return JSONResponse({**base, "choices": out, "usage": self._usage(prompts, choices)})

    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        self._check_model(body)
        prompt = self._chat_prompt(body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        choices = await self._start_choices(request, body, [prompt], body.n or 1, None, logprobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}

        if body.stream:
            async def sse():
                for c in choices:  # OpenAI sends the role first
                    yield _sse({**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]})
                async for choice, delta, lps in self._events(choices, [prompt]):
                    d = {"content": delta} if delta else {}
                    yield _sse({**base, "choices": [{
                        "index": choice.index, "delta": d,
                        "logprobs": {"content": self._chat_logprobs(lps)} if logprobs is not None else None,
                        "finish_reason": choice.finish_reason}]})
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse({**base, "choices": [], "usage": self._usage([prompt], choices)})
            return self._sse_response(request, sse(), choices)

        texts: dict[int, list[str]] = {c.index: [] for c in choices}
        all_lps: dict[int, list] = {c.index: [] for c in choices}
        async for choice, delta, lps in self._watch_disconnect(request, self._events(choices, [prompt])):
            texts[choice.index].append(delta)
            all_lps[choice.index].extend(lps)
        return JSONResponse({
            **base, "object": "chat.completion",
            "choices": [{"index": c.index,
                         "message": {"role": "assistant", "content": "".join(texts[c.index])},
                         "logprobs": {"content": self._chat_logprobs(all_lps[c.index])}
                         if logprobs is not None else None,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": self._usage([prompt], choices)})

    def _sse_response(self, request: Request, events: AsyncIterator[str], choices) -> StreamingResponse:
        async def body():
            try:
                async for event in events:
                    yield event
            except EngineError as exc:
                yield _sse(error_body(str(exc), "server_error", code="engine_error"))
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _watch_disconnect(self, request: Request, events: AsyncIterator):
        """Iterate ``events``; if the client goes away, stop (the generator's cleanup
        aborts the engine rows)."""
        disconnected = asyncio.Event()

        async def watch():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    return

        watcher = asyncio.create_task(watch())
        try:
            it = events.__aiter__()
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                done, _ = await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if nxt in done:
                    try:
                        yield nxt.result()
                    except StopAsyncIteration:
                        return
                else:
                    nxt.cancel()
                    with contextlib.suppress(BaseException):
                        await nxt
                    await it.aclose()
                    raise ClientGone()
        except EngineError as exc:
            raise HTTPError(500, str(exc), "server_error", code="engine_error") from None
        finally:
            watcher.cancel()

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "tickserve",
            "max_model_len": self.max_model_len}]})

    async def health(self, request: Request) -> Response:
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not self.client.is_up:
            return JSONResponse({"status": "engine unavailable"}, status_code=503)
        return JSONResponse({"status": "ok", "engine_id": self.client.engine_id})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def scheduler_stats(self, request: Request) -> Response:
        try:
            data = await self.client.stats()
        except EngineUnavailable as exc:
            raise HTTPError(503, str(exc), "service_unavailable") from None
        return JSONResponse({**data, "frontend": {"frontend_id": self.client.frontend_id,
                                                  "in_flight": self.client.num_in_flight}})

    async def tokenize(self, request: Request) -> Response:
        body: TokenizeRequest = await self._parse(request, TokenizeRequest)
        if body.messages is not None:
            ids = self._chat_prompt(ChatCompletionRequest(messages=body.messages)).token_ids
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=add)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        body: DetokenizeRequest = await self._parse(request, DetokenizeRequest)
        self._check_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(body.tokens)})


class EngineError(Exception):
    """The engine failed a request (or died) mid-generation."""


class ClientGone(Exception):
    """The HTTP client disconnected."""


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _wrap(handler, frontend: Frontend):
    async def endpoint(request: Request) -> Response:
        if frontend.config.api_key:
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {frontend.config.api_key}":
                return HTTPError(401, "invalid or missing API key", "authentication_error",
                                 code="invalid_api_key").response()
        try:
            return await handler(request)
        except HTTPError as exc:
            return exc.response()
        except ClientGone:
            return Response(status_code=499)
    return endpoint


def create_app(config: FrontendConfig, tokenizer, model_name: str,
               client: EngineClient | None = None) -> Starlette:
    """The Starlette app. The engine client starts in the lifespan and the app waits
    (bounded) for the engine's handshake; /health says 503 until it completes."""
    client = client or EngineClient(config)
    frontend = Frontend(config, tokenizer, client, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        client.start(asyncio.get_running_loop())
        await client.wait_ready(timeout=30.0)
        try:
            yield
        finally:
            client.close()

    routes = [
        Route("/v1/completions", _wrap(frontend.completions, frontend), methods=["POST"]),
        Route("/v1/chat/completions", _wrap(frontend.chat_completions, frontend), methods=["POST"]),
        Route("/v1/models", _wrap(frontend.models, frontend), methods=["GET"]),
        Route("/tokenize", _wrap(frontend.tokenize, frontend), methods=["POST"]),
        Route("/detokenize", _wrap(frontend.detokenize, frontend), methods=["POST"]),
        Route("/health", frontend.health, methods=["GET"]),
        Route("/version", frontend.version, methods=["GET"]),
        Route("/scheduler/stats", _wrap(frontend.scheduler_stats, frontend), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.frontend = frontend
    return app
