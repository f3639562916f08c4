"""A generation request's life in the frontend: submit every choice and wait for the
acks (all or nothing), merge the choices' engine streams into text deltas (stop strings
matched here, the engine's row aborted at once), abort what is left when the client or
the engine goes away, and watch for the client's disconnection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from starlette.requests import Request

from frontend import request_log
from frontend.context import Frontend
from frontend.text_stream import TextStream
from frontend.engine_client import EngineUnavailable, Rejected, RequestStream
from frontend.http_errors import ClientGone, EngineError, HTTPError, reject_error, unavailable
from frontend.metrics import RequestTimer
from frontend.params import PromptInfo
from frontend.router import affinity_key
from shared import protocol as p


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


async def start_choices(fe: Frontend, request: Request, body, plans: list[tuple[PromptInfo, p.SamplingParams]],
                        n: int) -> list[ChoiceState]:
    """Submit every (prompt, sample) pair; all-or-nothing: a rejection aborts the rest.

    Sample ``j`` of a seeded request runs with ``seed + j``: the choices differ, and
    the same request gives the same choices again.
    """
    if fe.draining:
        raise unavailable("the server is shutting down", "shutting_down")
    choices: list[ChoiceState] = []
    skip_special = True if body.skip_special_tokens is None else body.skip_special_tokens
    include_stop = bool(body.include_stop_str_in_output)
    # Fair/VTC accounting unit: explicit session_id, the X-Session-Id header, or OpenAI's `user`.
    session = body.session_id or request.headers.get("x-session-id") or body.user
    if session is not None and len(session) > p.MAX_ID_CHARS:
        raise HTTPError(400, f"a session id (X-Session-Id) is at most {p.MAX_ID_CHARS} characters",
                        param="user")
    block = fe.block_size
    try:
        for pi, (prompt, params) in enumerate(plans):
            key, via = affinity_key(session, prompt.token_ids, block), None
            for j in range(n):
                params_j = params
                if params.seed is not None and j:
                    params_j = msgspec.structs.replace(params, seed=params.seed + j)
                rid = fe.client.new_request_id()
                # the n samples of a prompt go where its first went: they share its blocks
                stream, via = await fe.client.submit(rid, prompt.token_ids, params_j, session_id=session,
                                                     priority=body.priority or 0, key=key, via=via)
                text = TextStream(fe.tokenizer, stop=body.stop_strings, prompt_token_ids=prompt.token_ids,
                                  include_stop_str_in_output=include_stop,
                                  skip_special_tokens=skip_special, min_tokens=params.min_tokens)
                choices.append(ChoiceState(len(choices), rid, pi, stream, text, include_stop,
                                           frozenset(params.stop_token_ids), timer=RequestTimer(fe.metrics)))
            fe.metrics.prompt_tokens.inc(len(prompt.token_ids))
        request_log.attach(request, choices, sum(len(prompt.token_ids) for prompt, _ in plans))
    except Rejected as exc:
        fe.metrics.rejected.labels(exc.reason.code.value).inc()
        abort(fe, choices)
        raise reject_error(exc.reason) from None
    except EngineUnavailable as exc:
        abort(fe, choices)
        raise unavailable(str(exc)) from None
    except BaseException:
        abort(fe, choices)
        raise
    return choices


def abort(fe: Frontend, choices: list[ChoiceState]) -> None:
    """Abort these choices' engine rows. Skipped when there are none, or no engine
    is up (its rows died with it): a send nobody takes blocks the event loop for
    the send timeout."""
    if choices and fe.client.is_up:
        fe.client.abort([c.request_id for c in choices])


def engine_error(fe: Frontend, message: str) -> EngineError:
    gone = not fe.client.is_up or message.startswith(("engine unavailable", "lost messages"))
    return EngineError(message, unavailable=gone)


def _eos_ids(fe: Frontend) -> tuple[int, ...]:
    welcome = fe.client.welcome
    return tuple(welcome.eos_token_ids) if welcome else ()


async def choice_events(fe: Frontend, choices: list[ChoiceState], prompts: list[PromptInfo]
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
                raise engine_error(fe, out.error or "the engine failed the request")
            ids = out.token_ids
            # As vLLM: the EOS / stop token that ended the row is not text, unless
            # include_stop_str_in_output asks for it. (A constrained row also stops on the
            # token that completes its grammar: that one is text.)
            stop_token = (out.finish_reason is p.FinishReason.STOP and bool(ids)
                          and (ids[-1] in choice.stop_token_ids or ids[-1] in _eos_ids(fe)))
            delta, stopped = choice.text.push(ids[:-1] if stop_token and not choice.include_stop else ids)
            choice.completion_tokens += len(ids)
            choice.timer.tokens(len(ids))
            lps = list(out.logprobs or [])
            if stopped:
                choice.finish_reason = "stop"
                choice.stop_reason = choice.text.matched_stop
                abort(fe, [choice])
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
        abort(fe, unfinished)


async def watch_disconnect(request: Request, events: AsyncIterator):
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
