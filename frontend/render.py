"""Rendering a response: usage, OpenAI's two logprob shapes, SSE events and the
streaming response that ends every stream with ``data: [DONE]``."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from frontend.context import Frontend
from frontend.http_errors import EngineError
from frontend.lifecycle import ChoiceState
from frontend.params import PromptInfo
from frontend.schemas import error_body
from shared import protocol as p

log = logging.getLogger("tickserve.frontend")


def usage(prompts: list[PromptInfo], choices: list[ChoiceState]) -> dict:
    """Prompt tokens once per prompt (not per sample); completion tokens summed."""
    prompt_tokens = sum(len(pr.token_ids) for pr in prompts)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(pr.cached_tokens for pr in prompts)}}


# ------------------------------------------------------------------ logprob formats

def token_str(fe: Frontend, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else fe.tokenizer.decode([token_id])


def completion_logprobs(fe: Frontend, choice: ChoiceState, lps: list[p.TokenLogprob], as_ids: bool) -> dict:
    """OpenAI's legacy shape; ``text_offset`` continues across stream chunks."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        s = token_str(fe, lp.token_id, as_ids)
        tokens.append(s)
        token_lps.append(lp.logprob)
        tops.append({token_str(fe, t, as_ids): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
        offsets.append(choice.text_offset)
        choice.text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(fe: Frontend, lps: list[p.TokenLogprob], as_ids: bool) -> list[dict]:
    """OpenAI's ``logprobs.content``; ``bytes`` are the token's own bytes (a piece
    of a UTF-8 character where the tokenizer split one)."""
    def entry(tid: int, v: float) -> dict:
        s = token_str(fe, tid, as_ids)
        raw = fe.token_bytes(tid) if fe.token_bytes and not as_ids else s.encode()
        return {"token": s, "logprob": v, "bytes": list(raw)}

    return [{**entry(lp.token_id, lp.logprob),
             "top_logprobs": [entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]}
            for lp in lps]


# ------------------------------------------------------------------ server-sent events

def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """Stream ``events``; whatever goes wrong after the headers ends the stream
    with an error event, and every stream ends with ``data: [DONE]``."""
    async def body():
        try:
            async for event in events:
                yield event
        except EngineError as exc:
            err = exc.http_error()
            yield sse(error_body(err.message, err.type, code=err.code))
        except Exception:
            log.exception("stream failed")
            yield sse(error_body("internal error while streaming", "server_error", code="internal_error"))
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: dict) -> str:
    """One SSE event. JSON leaves U+0085, U+2028 and U+2029 unescaped, but clients that
    split a stream with ``str.splitlines`` (httpx's ``iter_lines``, Python's own line
    readers) break an event at them: they are escaped, so every event is one line."""
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(LINE_BREAKS)}\n\n"
