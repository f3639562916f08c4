"""``POST /v1/completions``: OpenAI's (legacy) text completions, with vLLM's extensions
(echo with prompt logprobs, ``prompt_logprobs``, token ids as strings)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.lifecycle import ChoiceState, choice_events, start_choices, watch_disconnect
from frontend.params import PromptInfo, check_work, completion_prompts, sampling_params
from frontend.prompt_logprobs import engine_prompt_logprobs, legacy_prompt_part, vllm_prompt_logprobs
from frontend.render import completion_logprobs, sse, sse_response, token_str, usage
from frontend.schemas import DEFAULT_MAX_TOKENS_COMPLETIONS, CompletionRequest
from frontend.serving import Serving
from frontend.structured import request_constraint


class CompletionsServing(Serving):
    """One per app; :meth:`create` is the endpoint."""

    async def create(self, request: Request) -> Response:
        fe = self.fe
        body: CompletionRequest = await self.parse(request, CompletionRequest)
        constraint = await request_constraint(body)
        prompts = completion_prompts(fe, body)
        scoring = engine_prompt_logprobs(bool(body.echo), body.logprobs, body.prompt_logprobs, body.max_tokens)
        plans = [(pr, sampling_params(fe, body, pr, DEFAULT_MAX_TOKENS_COMPLETIONS, body.logprobs, scoring,
                                      constraint=constraint)) for pr in prompts]
        check_work(fe, plans, body.n or 1, body.logprobs, body.prompt_logprobs)
        choices = await start_choices(fe, request, body, plans, body.n or 1)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": fe.model_name}
        if body.stream:
            return sse_response(self._stream(body, prompts, choices, base))
        return await self._full(request, body, prompts, choices, base)

    def _choice_body(self, body: CompletionRequest, prompts: list[PromptInfo], choice: ChoiceState, text: str,
                     lps: list, first: bool) -> dict:
        """One choice of a response or a stream chunk; ``first``: its first, which carries
        the echoed prompt's logprobs and ``prompt_logprobs``."""
        as_ids = bool(body.return_tokens_as_token_ids)
        out = {"index": choice.index, "text": text, "logprobs": None,
               "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
        if body.logprobs is not None:
            prompt_part = None
            if body.echo and first:  # the echoed prompt's tokens come first, the first one null
                prompt_part = legacy_prompt_part(prompts[choice.prompt_index].token_ids, choice.prompt_logprobs,
                                                 body.logprobs, lambda t: token_str(self.fe, t, as_ids))
                choice.text_offset = sum(len(t) for t in prompt_part["tokens"])
            out["logprobs"] = completion_logprobs(self.fe, choice, lps, as_ids)
            if prompt_part:
                out["logprobs"] = {key: prompt_part[key] + out["logprobs"][key] for key in prompt_part}
        if body.prompt_logprobs is not None and first:
            out["prompt_logprobs"] = vllm_prompt_logprobs(choice.prompt_logprobs, body.prompt_logprobs,
                                                          lambda t: token_str(self.fe, t, as_ids))
        return out

    async def _stream(self, body: CompletionRequest, prompts: list[PromptInfo], choices: list[ChoiceState],
                      base: dict) -> AsyncIterator[str]:
        usage_chunks = bool(body.stream_options and body.stream_options.include_usage)
        started: set[int] = set()
        async for choice, delta, lps in choice_events(self.fe, choices, prompts):
            if body.echo and choice.index not in started:
                delta = prompts[choice.prompt_index].text + delta
            first = choice.index not in started
            started.add(choice.index)
            chunk = {**base, "choices": [self._choice_body(body, prompts, choice, delta, lps, first)]}
            yield sse({**chunk, "usage": None} if usage_chunks else chunk)
        if usage_chunks:
            yield sse({**base, "choices": [], "usage": usage(prompts, choices)})

    async def _full(self, request: Request, body: CompletionRequest, prompts: list[PromptInfo],
                    choices: list[ChoiceState], base: dict) -> Response:
        texts: dict[int, list[str]] = {c.index: [] for c in choices}
        all_lps: dict[int, list] = {c.index: [] for c in choices}
        async for choice, delta, lps in watch_disconnect(request, choice_events(self.fe, choices, prompts)):
            texts[choice.index].append(delta)
            all_lps[choice.index].extend(lps)
        out = []
        for c in choices:
            text = "".join(texts[c.index])
            if body.echo:
                text = prompts[c.prompt_index].text + text
            out.append(self._choice_body(body, prompts, c, text, all_lps[c.index], True))
        return JSONResponse({**base, "choices": out, "usage": usage(prompts, choices)})
