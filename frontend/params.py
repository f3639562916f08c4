"""OpenAI request fields → the engine's :class:`~shared.protocol.SamplingParams`, and
prompts → token ids (the completions prompt's four shapes, the chat template).

Everything here is checked against what only the frontend knows (the tokenizer's
vocabulary, the engine's context window); a failure is an HTTP 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from frontend import tool_calls
from frontend.context import Frontend
from frontend.http_errors import HTTPError
from frontend.request_work import work_problem
from frontend.schemas import ChatMessage, CompletionRequest
from shared import protocol as p
from shared.constraints import Constraint

PARAM_NAMES = set(p.SamplingParams.__struct_fields__)


@dataclass
class PromptInfo:
    """One prompt as the engine gets it: its token ids, its text (echo), and how many of
    its tokens the engine found in the prefix cache (usage)."""

    token_ids: list[int]
    text: str
    cached_tokens: int = 0


def check_model(fe: Frontend, body) -> None:
    if body.model not in (None, "", fe.model_name):
        raise HTTPError(404, f"the model {body.model!r} does not exist; this server serves "
                             f"{fe.model_name!r}", param="model", code="model_not_found")


def check_ids(fe: Frontend, ids, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < fe.vocab_size]
    if bad:
        raise HTTPError(400, f"token id {bad[0]} is outside the vocabulary [0, {fe.vocab_size})",
                        param=param)


def max_tokens(fe: Frontend, body, prompt_len: int, default: int | None) -> int:
    limit = fe.max_model_len
    if prompt_len >= limit:
        raise HTTPError(400, f"this model's maximum context length is {limit} tokens; the prompt "
                             f"has {prompt_len}", param="messages" if hasattr(body, "messages") else "prompt",
                        code="context_length_exceeded")
    asked = body.max_new_tokens
    if asked is None:  # request > --default-max-tokens > generation config > the endpoint's default
        default = getattr(fe, "default_max_tokens", None) or default
        return min(default, limit - prompt_len) if default else limit - prompt_len
    if prompt_len + asked > limit:
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise HTTPError(400, f"this model's maximum context length is {limit} tokens; the request "
                             f"asks for {prompt_len + asked} ({prompt_len} in the prompt, {asked} to "
                             "generate)", param=param, code="context_length_exceeded")
    return asked


def sampling_params(fe: Frontend, body, prompt: PromptInfo, default_max: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, constraint: Constraint | None = None) -> p.SamplingParams:
    """The engine parameters for one prompt, checked against the vocabulary and
    the context window (HTTP 400 otherwise); ``constraint``: the structured-output
    grammar, already checked (frontend/structured.py)."""
    n_max = max_tokens(fe, body, len(prompt.token_ids), default_max)
    check_ids(fe, body.logit_bias_ids, "logit_bias")
    check_ids(fe, body.stop_token_ids or [], "stop_token_ids")
    params = body.sampling_params(n_max, logprobs, fe.vocab_size)
    if prompt_logprobs is not None:
        params = msgspec.structs.replace(params, prompt_logprobs=prompt_logprobs)
    if constraint is not None:
        params = msgspec.structs.replace(params, constraint=constraint)
    problem = params.validate()
    if problem:
        name = problem.split(" ", 1)[0]
        raise HTTPError(400, problem, param=name if name in PARAM_NAMES else None)
    return params


def check_work(fe: Frontend, plans: list[tuple[PromptInfo, p.SamplingParams]], n: int, logprobs: int | None,
               prompt_logprobs: int | None = None) -> None:
    """HTTP 400 when the request's work exceeds ``--max-request-work`` (frontend/request_work.py)."""
    problem = work_problem([len(pr.token_ids) for pr, _ in plans], [params.max_tokens for _, params in plans],
                           n, logprobs, prompt_logprobs, fe.config.max_request_work)
    if problem:
        raise HTTPError(400, problem, code="request_work_exceeded")


def completion_prompts(fe: Frontend, body: CompletionRequest) -> list[PromptInfo]:
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
            ids = fe.tokenizer.encode(item, add_special_tokens=True)
            text = item
        else:
            ids = list(item)
            check_ids(fe, ids, "prompt")
            text = fe.tokenizer.decode(ids)
        if not ids:
            raise HTTPError(400, "the prompt is empty after tokenization", param="prompt")
        out.append(PromptInfo(ids, text))
    return out


def chat_prompt(fe: Frontend, messages: list[ChatMessage], add_generation_prompt: bool | None = None,
                add_special_tokens: bool = False, tools: list[dict] | None = None,
                tool_template: bool = False) -> PromptInfo:
    """The chat template applied to ``messages`` (with ``tools``, OpenAI's tool
    definitions, for a template that lists them). The template: ``--chat-template``'s if
    given; else, with ``tool_template``, the Hermes-style tool template; else the model's."""
    conversation = tool_calls.conversation(messages)
    template = fe.tool_template if tool_template else fe.chat_template
    extra = {"tools": tools} if tools else {}
    try:
        text = fe.tokenizer.apply_chat_template(
            conversation, tokenize=False, chat_template=template,
            add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt, **extra)
    except Exception as exc:  # template errors are the client's messages
        raise HTTPError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
    ids = fe.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        raise HTTPError(400, "the chat prompt is empty after tokenization", param="messages")
    return PromptInfo(ids, text)
