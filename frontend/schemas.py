"""OpenAI-compatible request bodies, validated with pydantic.

Explicit ``null`` means "not set" everywhere. Unknown fields are ignored (clients
send vendor extensions). Types are strict, as OpenAI's schema is: no string for a
boolean (``"stream": "yes"``), no boolean for an integer (``"max_tokens": true``), no
string for a token id (``"prompt": ["1"]``); an integer is a valid number. Ranges follow the OpenAI API; tickserve's extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``,
``min_tokens``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``return_tokens_as_token_ids``, ``priority``, ``session_id``) follow vLLM's names.

Validation happens in three layers, each answering HTTP 400:

1. types and ranges: the pydantic models below;
2. combinations and features that are not supported: ``problem()`` of each request,
   which returns ``(param, message)``;
3. what needs the tokenizer or the engine's limits (token ids inside the vocabulary,
   prompt + max_tokens inside the context): :mod:`frontend.params`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.protocol import MAX_ID_CHARS, MAX_LIST, SamplingParams

DEFAULT_MAX_TOKENS_COMPLETIONS = 16  # OpenAI's default for /v1/completions
# Below this a temperature means greedy (vLLM's _SAMPLING_EPS): logits / 1e-40 in float32
# is a division by zero, and the NaN it makes would fail the engine's batch.
GREEDY_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 1e-6  # likewise: logits / penalty must stay finite in float32
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # stop matching costs O(length²) per delta: keep it bounded
MAX_N = 16

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]  # what travels on the wire (msgpack)
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]  # the vocabulary bound is checked by the app
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
SessionId = Annotated[str, Field(max_length=MAX_ID_CHARS)]  # the engine's bound on a session id
Priority = Annotated[int, Field(ge=-(2**31), lt=2**31)]  # the engine's bound on priority

Choices = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1024)]

_TOKEN_ID_KEY = re.compile(r"[0-9]{1,19}")  # ASCII digits only: str.isdigit() accepts "²"

Problem = tuple[str, str]  # (param, message)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    include_usage: bool | None = None


class JsonSchemaSpec(BaseModel):
    """OpenAI's ``response_format.json_schema``."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, populate_by_name=True)
    name: Annotated[str, Field(max_length=64)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` object (one of its fields at a time)."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Int64 | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=2.0)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LIST)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LIST)] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: SessionId | None = None
    session_id: SessionId | None = None
    priority: Priority | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprob tokens as "token_id:<id>"
    # Structured outputs (frontend/structured.py): OpenAI's response_format, vLLM's guided_* and
    # structured_outputs; at most one per request.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        if v is not None:
            for key in v:
                if not _TOKEN_ID_KEY.fullmatch(key):
                    raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {key[:40]!r}")
        return v

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): float(b) for k, b in (self.logit_bias or {}).items()}

    def problem(self) -> Problem | None:
        """A combination the server does not accept, as ``(param, message)``."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

    def sampling_params(self, max_tokens: int, logprobs: int | None, vocab_size: int) -> SamplingParams:
        """Engine parameters. ``top_k`` of the whole vocabulary or more means "off"; a
        temperature below ``GREEDY_TEMPERATURE`` means greedy."""
        top_k = None if self.top_k in (None, 0, -1) or self.top_k >= vocab_size else self.top_k
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < GREEDY_TEMPERATURE else temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias_ids or None,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            min_tokens=self.min_tokens or 0,
            logprobs=logprobs,
        )


Prompt = Union[str, list[str], list[TokenId], list[list[TokenId]]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: score the prompt only (echo)
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # vLLM's sampling parameter
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def problem(self) -> Problem | None:
        if self.best_of is not None and self.best_of > 1:
            return "best_of", "best_of > 1 is not supported; use n for several samples"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            return "max_tokens", "max_tokens 0 is only valid with echo or prompt_logprobs (to score the prompt)"
        return super().problem()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """An assistant turn's tool call, as a client sends the conversation back."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none → any object
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    type: Literal["function"]
    function: FunctionName


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


Messages = Annotated[list[ChatMessage], Field(min_length=1)]


class ChatCompletionRequest(_SamplingFields):
    messages: Messages
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def problem(self) -> Problem | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            return "tool_choice", "tool_choice \"required\" or a named function needs tools"
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
                t.function.name for t in self.tools}:
            return "tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools"
        return super().problem()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool | None = None  # default: true for prompt, false for messages
    add_generation_prompt: bool | None = None  # messages only; default true

    def problem(self) -> Problem | None:
        if (self.prompt is None) == (self.messages is None):
            return "prompt", "give exactly one of prompt or messages"
        return None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)
    model: str | None = None
    tokens: list[TokenId]

    def problem(self) -> Problem | None:
        return None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: Any = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
