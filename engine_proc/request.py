"""A request's state inside the engine and its lifecycle."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from shared.protocol import FinishReason, SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle, ordered so that ``status >= FINISHED_STOPPED`` means "finished".

    WAITING (in ``_pending``) → PREFILLING (in ``_prefilling``) → RUNNING (in
    ``_active``) → one FINISHED_* state, which maps to exactly one finish reason.
    """

    WAITING = 0
    PREFILLING = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False)
class Request:
    """One generation request. Identity is object identity (``eq=False``).

    Token counts are in tokens. ``num_computed_tokens`` counts prompt tokens whose KV
    is in the cache (prefix hits included); once the row decodes it also counts the
    generated tokens fed back through the model.
    """

    request_id: str
    frontend_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    session_id: str = ""
    priority: int = 0
    arrival_seq: int = 0  # monotonic per engine; FCFS tie-break
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    kv_reserved: int = 0  # what admit added to _active_kv_reserved (tokens)
    first_token_time: float | None = None
    error: str | None = None
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob of prompt tokens 1.., as scored
    grammar_template: Any = None  # compiled matcher of params.constraint, once ready (engine_proc.grammar)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Gate 2's reservation unit: prompt_len + max_tokens (tokens)."""
        return self.prompt_len + self.params.max_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
