"""OpenAI-compatible request bodies, validated with pydantic.

Explicit ``null`` means "not set" everywhere. Unknown fields are ignored (clients
send vendor extensions). Ranges follow the OpenAI API; tickserve's extensions
(``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``,
``min_tokens``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``priority``, ``session_id``) follow vLLM's names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.protocol import SamplingParams

DEFAULT_MAX_TOKENS_COMPLETIONS = 16  # OpenAI's default for /v1/completions


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = None


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    session_id: str | None = None
    priority: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list):
            if len(v) > 16:
                raise ValueError("at most 16 stop strings")
            if any(not s for s in v):
                raise ValueError("stop strings must be non-empty")
        elif v == "":
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        if v is not None:
            for key in v:
                if not key.lstrip("-").isdigit():
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return v

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=None if self.top_k in (None, 0, -1) else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(k): float(b) for k, b in self.logit_bias.items()} if self.logit_bias else None,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            min_tokens=self.min_tokens or 0,
            logprobs=logprobs,
        )


Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: Any = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
