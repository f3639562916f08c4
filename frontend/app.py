"""The HTTP frontend: OpenAI-compatible endpoints on Starlette.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from frontend import dashboard
from frontend.cors import cors_middleware
from frontend.detokenizer import TextStream, token_bytes_of
from frontend.engine_client import EngineUnavailable, Rejected, RequestStream
from frontend.engine_set import EngineSet
from frontend.router import affinity_key
from frontend.metrics import FrontendMetrics, RequestTimer
from frontend.prompt_logprobs import engine_prompt_logprobs, legacy_prompt_part, vllm_prompt_logprobs
from frontend.request_work import work_problem
from frontend.schemas import (DEFAULT_MAX_TOKENS_COMPLETIONS, ChatCompletionRequest, ChatMessage,
                              CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body)
from shared import protocol as p
from shared.config import FrontendConfig

log = logging.getLogger("tickserve.frontend")

VERSION = "0.1.0"

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
                413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable"}
_PARAM_NAMES = set(p.SamplingParams.__struct_fields__)


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


def _unavailable(message: str, code: str = "engine_unavailable") -> HTTPError:
    return HTTPError(503, message, "service_unavailable", code=code, headers={"Retry-After": "1"})


def _reject_error(reason: p.RejectReason) -> HTTPError:
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
        return _unavailable(str(self), "engine_unavailable" if self.unavailable else "engine_error")


class ClientGone(Exception):
    """The HTTP client disconnected."""


@dataclass
class PromptInfo:
    token_ids: list[int]
    text: str
    cached_tokens: int = 0


@dataclass
class ChoiceState:
    """One generated choice: its engine stream, text stream and counters."""

    index: int
    request_id: str
    prompt_index: int
    stream: RequestStream
    text: TextStream
    include_stop: bool  # include_stop_str_in_output: the stop token's text stays too
    stop_token_ids: frozenset[int]
    completion_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM: the stop string or stop token id that matched
    text_offset: int = 0  # characters of logprob tokens sent so far (completions' text_offset)
    prompt_logprobs: list[p.TokenLogprob] | None = None  # scored prompt tokens 1.., when asked
    timer: RequestTimer | None = None


class Frontend:
    """Holds the tokenizer, the engine client and the per-endpoint logic."""

    def __init__(self, config: FrontendConfig, tokenizer, client: EngineSet, model_name: str):
        self.config = config
        self.tokenizer = tokenizer
        self.client = client
        self.model_name = model_name
        self.metrics = FrontendMetrics()
        self.draining = False
        self.vocab_size = len(tokenizer)
        self._token_bytes = token_bytes_of(tokenizer)

    # ------------------------------------------------------------------ request parsing

    @property
    def max_model_len(self) -> int:
        welcome = self.client.welcome
        return welcome.max_model_len if welcome else 2048

    @property
    def block_size(self) -> int:
        welcome = self.client.welcome
        return welcome.runtime.kv_block_size if welcome and welcome.runtime and welcome.runtime.kv_block_size else 16

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed the limit."""
        limit = self.config.max_body_bytes
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
            await asyncio.wait_for(read(), self.config.body_timeout_s)
        except ClientDisconnect:
            raise ClientGone() from None
        except asyncio.TimeoutError:
            raise HTTPError(408, f"the request body did not arrive within {self.config.body_timeout_s:g} s",
                            code="request_timeout") from None
        return b"".join(chunks)

    async def _parse(self, request: Request, schema):
        raw = await self._read_body(request)
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
        problem = body.problem()
        if problem:
            raise HTTPError(400, problem[1], param=problem[0])
        return body

    def _check_model(self, body) -> None:
        if body.model not in (None, "", self.model_name):
            raise HTTPError(404, f"the model {body.model!r} does not exist; this server serves "
                                 f"{self.model_name!r}", param="model", code="model_not_found")

    def _check_ids(self, ids, param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise HTTPError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                            param=param)

    def _max_tokens(self, body, prompt_len: int, default: int | None) -> int:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise HTTPError(400, f"this model's maximum context length is {limit} tokens; the prompt "
                                 f"has {prompt_len}", param="messages" if hasattr(body, "messages") else "prompt",
                            code="context_length_exceeded")
        asked = body.max_new_tokens
        if asked is None:
            return min(default, limit - prompt_len) if default else limit - prompt_len
        if prompt_len + asked > limit:
            param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            raise HTTPError(400, f"this model's maximum context length is {limit} tokens; the request "
                                 f"asks for {prompt_len + asked} ({prompt_len} in the prompt, {asked} to "
                                 "generate)", param=param, code="context_length_exceeded")
        return asked

    def _params(self, body, prompt: PromptInfo, default_max: int | None, logprobs: int | None,
                prompt_logprobs: int | None = None) -> p.SamplingParams:
        """The engine parameters for one prompt, checked against the vocabulary and
        the context window (HTTP 400 otherwise)."""
        max_tokens = self._max_tokens(body, len(prompt.token_ids), default_max)
        self._check_ids(body.logit_bias_ids, "logit_bias")
        self._check_ids(body.stop_token_ids or [], "stop_token_ids")
        params = body.sampling_params(max_tokens, logprobs, self.vocab_size)
        if prompt_logprobs is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=prompt_logprobs)
        problem = params.validate()
        if problem:
            name = problem.split(" ", 1)[0]
            raise HTTPError(400, problem, param=name if name in _PARAM_NAMES else None)
        return params

    def _check_work(self, plans: list[tuple[PromptInfo, p.SamplingParams]], n: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> None:
        """HTTP 400 when the request's work exceeds ``--max-request-work`` (frontend/request_work.py)."""
        problem = work_problem([len(pr.token_ids) for pr, _ in plans], [params.max_tokens for _, params in plans],
                               n, logprobs, prompt_logprobs, self.config.max_request_work)
        if problem:
            raise HTTPError(400, problem, code="request_work_exceeded")

    def _prompts(self, body: CompletionRequest) -> list[PromptInfo]:
        prompt = body.prompt
        if isinstance(prompt, str):
            items: list = [prompt]
        elif isinstance(prompt[0], int):
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

    def _chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool | None = None,
                     add_special_tokens: bool = False) -> PromptInfo:
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False,
                add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt)
        except Exception as exc:  # template errors are the client's messages
            raise HTTPError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise HTTPError(400, "the chat prompt is empty after tokenization", param="messages")
        return PromptInfo(ids, text)

    # ------------------------------------------------------------------ generation

    async def _start_choices(self, request: Request, body, plans: list[tuple[PromptInfo, p.SamplingParams]],
                             n: int) -> list[ChoiceState]:
        """Submit every (prompt, sample) pair; all-or-nothing: a rejection aborts the rest.

        Sample ``j`` of a seeded request runs with ``seed + j``: the choices differ, and
        the same request gives the same choices again.
        """
        if self.draining:
            raise _unavailable("the server is shutting down", "shutting_down")
        choices: list[ChoiceState] = []
        skip_special = True if body.skip_special_tokens is None else body.skip_special_tokens
        include_stop = bool(body.include_stop_str_in_output)
        # Fair/VTC accounting unit: explicit session_id, the X-Session-Id header, or OpenAI's `user`.
        session = body.session_id or request.headers.get("x-session-id") or body.user
        if session is not None and len(session) > p.MAX_ID_CHARS:
            raise HTTPError(400, f"a session id (X-Session-Id) is at most {p.MAX_ID_CHARS} characters",
                            param="user")
        block = self.block_size
        try:
            for pi, (prompt, params) in enumerate(plans):
                key, via = affinity_key(session, prompt.token_ids, block), None
                for j in range(n):
                    params_j = params
                    if params.seed is not None and j:
                        params_j = msgspec.structs.replace(params, seed=params.seed + j)
                    rid = self.client.new_request_id()
                    # the n samples of a prompt go where its first went: they share its blocks
                    stream, via = await self.client.submit(rid, prompt.token_ids, params_j, session_id=session,
                                                           priority=body.priority or 0, key=key, via=via)
                    text = TextStream(self.tokenizer, stop=body.stop_strings, prompt_token_ids=prompt.token_ids,
                                      include_stop_str_in_output=include_stop,
                                      skip_special_tokens=skip_special, min_tokens=params.min_tokens)
                    choices.append(ChoiceState(len(choices), rid, pi, stream, text, include_stop,
                                               frozenset(params.stop_token_ids), timer=RequestTimer(self.metrics)))
                self.metrics.prompt_tokens.inc(len(prompt.token_ids))
        except Rejected as exc:
            self.metrics.rejected.labels(exc.reason.code.value).inc()
            self._abort(choices)
            raise _reject_error(exc.reason) from None
        except EngineUnavailable as exc:
            self._abort(choices)
            raise _unavailable(str(exc)) from None
        except BaseException:
            self._abort(choices)
            raise
        return choices

    def _abort(self, choices: list[ChoiceState]) -> None:
        """Abort these choices' engine rows. Skipped when there are none, or no engine
        is up (its rows died with it): a send nobody takes blocks the event loop for
        the send timeout."""
        if choices and self.client.is_up:
            self.client.abort([c.request_id for c in choices])

    def _engine_error(self, message: str) -> EngineError:
        gone = not self.client.is_up or message.startswith(("engine unavailable", "lost messages"))
        return EngineError(message, unavailable=gone)

    async def _events(self, choices: list[ChoiceState], prompts: list[PromptInfo]
                      ) -> AsyncIterator[tuple[ChoiceState, str, list[p.TokenLogprob]]]:
        """Merge the choices' engine streams into ``(choice, text_delta, logprobs)``
        events; the final event of a choice has ``choice.finish_reason`` set.

        Raises :class:`EngineError` when the engine fails a choice. Leaving early (an
        error, a cancelled client) aborts every choice not finished yet.
        """
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
                if out.prompt_logprobs is not None:
                    choice.prompt_logprobs = out.prompt_logprobs
                if out.error or out.finish_reason is p.FinishReason.ERROR:
                    choice.finish_reason = "error"
                    choice.timer.finished("error")
                    raise self._engine_error(out.error or "the engine failed the request")
                ids = out.token_ids
                stop_token = out.finish_reason is p.FinishReason.STOP and bool(ids)
                # As vLLM: the EOS / stop token that ended the row is not text, unless
                # include_stop_str_in_output asks for it.
                delta, stopped = choice.text.push(ids[:-1] if stop_token and not choice.include_stop else ids)
                choice.completion_tokens += len(ids)
                choice.timer.tokens(len(ids))
                lps = list(out.logprobs or [])
                if stopped:
                    choice.finish_reason = "stop"
                    choice.stop_reason = choice.text.matched_stop
                    self._abort([choice])
                elif out.finish_reason is not None:
                    delta += choice.text.flush()
                    if choice.text.stopped:  # a stop string that only matched at the end
                        choice.finish_reason = "stop"
                        choice.stop_reason = choice.text.matched_stop
                    elif out.finish_reason is p.FinishReason.ABORT:
                        choice.finish_reason = "abort"
                    else:
                        choice.finish_reason = out.finish_reason.value
                        if stop_token and ids[-1] in choice.stop_token_ids:
                            choice.stop_reason = ids[-1]
                if choice.finish_reason is not None:
                    remaining -= 1
                    choice.timer.finished(choice.finish_reason)
                if delta or lps or choice.finish_reason is not None:
                    yield choice, delta, lps
        finally:
            for t in tasks:
                t.cancel()
            unfinished = [c for c in choices if c.finish_reason is None]
            for c in unfinished:  # the client left (or an error ended the others): abort, and count it
                c.timer.finished("abort")
            self._abort(unfinished)

    def _usage(self, prompts: list[PromptInfo], choices: list[ChoiceState]) -> dict:
        """Prompt tokens once per prompt (not per sample); completion tokens summed."""
        prompt_tokens = sum(len(pr.token_ids) for pr in prompts)
        completion = sum(c.completion_tokens for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(pr.cached_tokens for pr in prompts)}}

    # ------------------------------------------------------------------ logprob formats

    def _token_str(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.tokenizer.decode([token_id])

    def _completion_logprobs(self, choice: ChoiceState, lps: list[p.TokenLogprob], as_ids: bool) -> dict:
        """OpenAI's legacy shape; ``text_offset`` continues across stream chunks."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            s = self._token_str(lp.token_id, as_ids)
            tokens.append(s)
            token_lps.append(lp.logprob)
            tops.append({self._token_str(t, as_ids): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
            offsets.append(choice.text_offset)
            choice.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, lps: list[p.TokenLogprob], as_ids: bool) -> list[dict]:
        """OpenAI's ``logprobs.content``; ``bytes`` are the token's own bytes (a piece
        of a UTF-8 character where the tokenizer split one)."""
        def entry(tid: int, v: float) -> dict:
            s = self._token_str(tid, as_ids)
            raw = self._token_bytes(tid) if self._token_bytes and not as_ids else s.encode()
            return {"token": s, "logprob": v, "bytes": list(raw)}

        return [{**entry(lp.token_id, lp.logprob),
                 "top_logprobs": [entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]}
                for lp in lps]

    # ------------------------------------------------------------------ endpoints

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        self._check_model(body)
        prompts = self._prompts(body)
        scoring = engine_prompt_logprobs(bool(body.echo), body.logprobs, body.prompt_logprobs, body.max_tokens)
        plans = [(pr, self._params(body, pr, DEFAULT_MAX_TOKENS_COMPLETIONS, body.logprobs, scoring))
                 for pr in prompts]
        self._check_work(plans, body.n or 1, body.logprobs, body.prompt_logprobs)
        choices = await self._start_choices(request, body, plans, body.n or 1)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        echo = bool(body.echo)
        as_ids = bool(body.return_tokens_as_token_ids)
        usage_chunks = bool(body.stream and body.stream_options and body.stream_options.include_usage)

        def choice_body(choice: ChoiceState, text: str, lps: list, first: bool) -> dict:
            out = {"index": choice.index, "text": text, "logprobs": None,
                   "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
            if body.logprobs is not None:
                prompt_part = None
                if echo and first:  # the echoed prompt's tokens come first, the first one null
                    prompt_part = legacy_prompt_part(prompts[choice.prompt_index].token_ids, choice.prompt_logprobs,
                                                     body.logprobs, lambda t: self._token_str(t, as_ids))
                    choice.text_offset = sum(len(t) for t in prompt_part["tokens"])
                out["logprobs"] = self._completion_logprobs(choice, lps, as_ids)
                if prompt_part:
                    out["logprobs"] = {key: prompt_part[key] + out["logprobs"][key] for key in prompt_part}
            if body.prompt_logprobs is not None and first:
                out["prompt_logprobs"] = vllm_prompt_logprobs(choice.prompt_logprobs, body.prompt_logprobs,
                                                              lambda t: self._token_str(t, as_ids))
            return out

        if body.stream:
            async def sse():
                started: set[int] = set()
                async for choice, delta, lps in self._events(choices, prompts):
                    if echo and choice.index not in started:
                        delta = prompts[choice.prompt_index].text + delta
                    first = choice.index not in started
                    started.add(choice.index)
                    chunk = {**base, "choices": [choice_body(choice, delta, lps, first)]}
                    yield _sse({**chunk, "usage": None} if usage_chunks else chunk)
                if usage_chunks:
                    yield _sse({**base, "choices": [], "usage": self._usage(prompts, choices)})
            return self._sse_response(sse())

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
            out.append(choice_body(c, text, all_lps[c.index], True))
        return JSONResponse({**base, "choices": out, "usage": self._usage(prompts, choices)})

    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        self._check_model(body)
        prompt = self._chat_prompt(body.messages, body.add_generation_prompt)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        plans = [(prompt, self._params(body, prompt, None, logprobs))]
        self._check_work(plans, body.n or 1, logprobs)
        choices = await self._start_choices(request, body, plans, body.n or 1)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.model_name}
        as_ids = bool(body.return_tokens_as_token_ids)
        usage_chunks = bool(body.stream and body.stream_options and body.stream_options.include_usage)

        if body.stream:
            def chunk(choice_body: dict) -> str:
                c = {**base, "choices": [choice_body]}
                return _sse({**c, "usage": None} if usage_chunks else c)

            async def sse():
                for c in choices:  # OpenAI sends the role first
                    yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})
                async for choice, delta, lps in self._events(choices, [prompt]):
                    yield chunk({"index": choice.index, "delta": {"content": delta} if delta else {},
                                 "logprobs": {"content": self._chat_logprobs(lps, as_ids)}
                                 if logprobs is not None else None,
                                 "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})
                if usage_chunks:
                    yield _sse({**base, "choices": [], "usage": self._usage([prompt], choices)})
            return self._sse_response(sse())

        texts: dict[int, list[str]] = {c.index: [] for c in choices}
        all_lps: dict[int, list] = {c.index: [] for c in choices}
        async for choice, delta, lps in self._watch_disconnect(request, self._events(choices, [prompt])):
            texts[choice.index].append(delta)
            all_lps[choice.index].extend(lps)
        return JSONResponse({
            **base, "object": "chat.completion",
            "choices": [{"index": c.index,
                         "message": {"role": "assistant", "content": "".join(texts[c.index])},
                         "logprobs": {"content": self._chat_logprobs(all_lps[c.index], as_ids)}
                         if logprobs is not None else None,
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices],
            "usage": self._usage([prompt], choices)})

    def _sse_response(self, events: AsyncIterator[str]) -> StreamingResponse:
        """Stream ``events``; whatever goes wrong after the headers ends the stream
        with an error event, and every stream ends with ``data: [DONE]``."""
        async def body():
            try:
                async for event in events:
                    yield event
            except EngineError as exc:
                err = exc.http_error()
                yield _sse(error_body(err.message, err.type, code=err.code))
            except Exception:
                log.exception("stream failed")
                yield _sse(error_body("internal error while streaming", "server_error", code="internal_error"))
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _watch_disconnect(self, request: Request, events: AsyncIterator):
        """Iterate ``events``; if the client goes away, stop (the generator's cleanup
        aborts the engine rows). An engine failure becomes HTTP 503."""
        disconnected = asyncio.Event()

        async def watch():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    return

        watcher = asyncio.create_task(watch())
        it = events.__aiter__()
        try:
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
                    raise ClientGone()
        except EngineError as exc:
            raise exc.http_error() from None
        finally:
            watcher.cancel()
            await it.aclose()

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tickserve",
                "max_model_len": self.max_model_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}`` (the openai client's ``models.retrieve``)."""
        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            raise HTTPError(404, f"the model {model_id!r} does not exist; this server serves "
                                 f"{self.model_name!r}", param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not self.client.is_up:
            return JSONResponse({"status": "engine unavailable"}, status_code=503)
        return JSONResponse({"status": "ok", "engine_id": self.client.engine_id})

    async def version(self, request: Request) -> Response:
        welcome = self.client.welcome
        runtime = msgspec.structs.asdict(welcome.runtime) if welcome and welcome.runtime else None
        members = getattr(self.client, "members", None) or []
        return JSONResponse({"version": VERSION, "runtime": runtime, "transport": self.client.transport_name,
                             "num_engines": max(1, len(members)),
                             "num_engines_up": sum(1 for m in members if m.up) if members else int(self.client.is_up)})

    async def scheduler_stats(self, request: Request) -> Response:
        try:
            data = await self.client.stats()
        except EngineUnavailable as exc:
            raise _unavailable(str(exc)) from None
        return JSONResponse({**data, "frontend": {"frontend_id": self.client.frontend_id,
                                                  "in_flight": self.client.num_in_flight,
                                                  "transport": self.client.transport_name}})

    async def prometheus(self, request: Request) -> Response:
        """Counters of every frontend, gauges from each engine's latest broadcast: no round
        trip to an engine, so a scrape costs the same 20 times a second."""
        latest = getattr(self.client, "latest_stats", None)
        engines = [stats for _, stats in latest()] if latest is not None else []
        if not any(engines):  # no broadcast yet (or --stats-interval-s 0): ask
            try:
                engines = [await self.client.stats(timeout=1.0)]
            except EngineUnavailable:
                engines = [None]
        return Response(self.metrics.render(engines), media_type="text/plain; version=0.0.4")

    async def tokenize(self, request: Request) -> Response:
        body: TokenizeRequest = await self._parse(request, TokenizeRequest)
        self._check_model(body)
        if body.messages is not None:
            ids = self._chat_prompt(body.messages, body.add_generation_prompt,
                                    add_special_tokens=bool(body.add_special_tokens)).token_ids
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=add)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        body: DetokenizeRequest = await self._parse(request, DetokenizeRequest)
        self._check_model(body)
        self._check_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(body.tokens)})


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


_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(obj: dict) -> str:
    """One SSE event. JSON leaves U+0085, U+2028 and U+2029 unescaped, but clients that
    split a stream with ``str.splitlines`` (httpx's ``iter_lines``, Python's own line
    readers) break an event at them: they are escaped, so every event is one line."""
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


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

    @contextlib.asynccontextmanager
    async def lifespan(app):
        client.start(asyncio.get_running_loop())  # /health is 503 until the handshake completes
        try:
            yield
        finally:
            client.close()

    routes = [
        Route("/v1/completions", _wrap(frontend.completions, frontend), methods=["POST"]),
        Route("/v1/chat/completions", _wrap(frontend.chat_completions, frontend), methods=["POST"]),
        Route("/v1/models", _wrap(frontend.models, frontend), methods=["GET"]),
        Route("/v1/models/{model_id:path}", _wrap(frontend.model, frontend), methods=["GET"]),
        Route("/tokenize", _wrap(frontend.tokenize, frontend), methods=["POST"]),
        Route("/detokenize", _wrap(frontend.detokenize, frontend), methods=["POST"]),
        Route("/health", frontend.health, methods=["GET"]),
        Route("/version", frontend.version, methods=["GET"]),
        Route("/scheduler/stats", _wrap(frontend.scheduler_stats, frontend), methods=["GET"]),
        Route("/metrics", _wrap(frontend.prometheus, frontend), methods=["GET"]),
        *dashboard.routes(frontend, dashboard.make_hub(frontend)),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_exception},
                    middleware=cors_middleware(config.allowed_origins))
    app.state.frontend = frontend
    return app
