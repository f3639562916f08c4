"""Typed messages exchanged between frontends (and zmq client scripts) and the engine.

Messages are grouped by the process that *receives* them. Each is a plain frozen
dataclass; :mod:`shared.codec` turns them into msgpack frames through an explicit
tag table. Token ids always travel as ids, never as text.

Flow of one request::

    frontend                              engine
      Hello(frontend_id)          ──►                       (repeated until Welcome)
                                  ◄──   Welcome             (topic = frontend_id)
      Submit(request_id, ids, …)  ──►
                                  ◄──   Ack(accepted | rejected + RejectReason)
                                  ◄──   StepOutput([RequestOutput …])   once per tick
                                        … until a RequestOutput carries finish_reason
      Abort([request_id])         ──►   (disconnect, stop string)
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5  # below this, temperature sampling is argmax


class FinishReason(str, enum.Enum):
    """Why a request stopped producing tokens (OpenAI ``finish_reason`` values)."""

    STOP = "stop"  # EOS or a stop token id (engine) / a stop string (frontend)
    LENGTH = "length"  # max_tokens reached, or the context window is full
    ABORT = "abort"  # client disconnect, frontend abort, frontend death
    ERROR = "error"  # the engine failed this row (see RequestOutput.error)


class RejectCode(str, enum.Enum):
    """Why the engine refused a submit. ``http_status`` maps each to the HTTP answer."""

    QUEUE_FULL = "queue_full"  # gate 1: _pending is at MAX_QUEUE_SIZE
    KV_BUDGET = "kv_budget"  # gate 2 hard-reject: prompt_len + max_tokens > budget
    BLOCK_POOL = "block_pool"  # gate 3 hard-reject: prompt needs more blocks than exist
    CONTEXT_LENGTH = "context_length"  # prompt_len + max_tokens > max_model_len
    INVALID = "invalid"  # malformed parameters
    SHUTTING_DOWN = "shutting_down"  # the engine is draining

    @property
    def http_status(self) -> int:
        if self in (RejectCode.CONTEXT_LENGTH, RejectCode.INVALID):
            return 400
        if self is RejectCode.SHUTTING_DOWN:
            return 503
        return 429


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, applied per row inside one batched step.

    ``None`` always means "not set". Ranges are validated by :meth:`validate`.
    """

    max_tokens: int = 16  # tokens to generate, at most
    temperature: float = 1.0  # 0 → greedy (argmax)
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int | None = None  # keep the k most likely tokens; None → all
    min_p: float = 0.0  # drop tokens with p < min_p · p_max
    seed: int | None = None  # per-request generator; output independent of the batch
    presence_penalty: float = 0.0  # OpenAI: subtract once per token id seen in the output
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output
    repetition_penalty: float = 1.0  # CTRL (Keskar et al. 2019, §4.1): prompt + output ids
    logit_bias: dict[int, float] | None = None  # token id → bias added to its logit
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens
    logprobs: int | None = None  # None → no logprobs; k → sampled token + top-k
    # None → none; k → each prompt token's logprob + top-k, computed in the prefill pass
    # (such rows skip the prefix cache: a cached block has no logits). Allows max_tokens 0.
    prompt_logprobs: int | None = None

    def validate(self) -> str | None:
        """Return a human-readable problem with these parameters, or ``None`` if valid
        (types first: values from the wire are not trusted)."""
        problem = self._type_problem()
        if problem:
            return problem
        if self.max_tokens < 1 and not (self.max_tokens == 0 and self.prompt_logprobs is not None):
            return "max_tokens must be at least 1 (0 only with prompt_logprobs)"
        if not 0.0 <= self.temperature <= 2.0:
            return "temperature must be in [0, 2]"
        if not 0.0 < self.top_p <= 1.0:
            return "top_p must be in (0, 1]"
        if self.top_k is not None and self.top_k < 1:
            return "top_k must be at least 1 (or null)"
        if not 0.0 <= self.min_p <= 1.0:
            return "min_p must be in [0, 1]"
        if not -2.0 <= self.presence_penalty <= 2.0:
            return "presence_penalty must be in [-2, 2]"
        if not -2.0 <= self.frequency_penalty <= 2.0:
            return "frequency_penalty must be in [-2, 2]"
        if not 1e-6 <= self.repetition_penalty <= 2.0:
            return "repetition_penalty must be in [1e-6, 2]"
        if self.logit_bias and not all(math.isfinite(v) for v in self.logit_bias.values()):
            return "logit_bias values must be finite numbers"
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            return "min_tokens must be in [0, max_tokens]"
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            return "logprobs must be in [0, 20]"
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            return "prompt_logprobs must be in [0, 20]"
        return None

    def _type_problem(self) -> str | None:
        def is_int(v) -> bool:
            return type(v) is int

        def is_num(v) -> bool:
            return type(v) in (int, float)

        for name in ("max_tokens", "min_tokens"):
            if not is_int(getattr(self, name)):
                return f"{name} must be an integer"
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not is_num(getattr(self, name)):
                return f"{name} must be a number"
        for name in ("top_k", "seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not is_int(getattr(self, name)):
                return f"{name} must be an integer or null"
        if type(self.ignore_eos) is not bool:
            return "ignore_eos must be a boolean"
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) for t in self.stop_token_ids):
            return "stop_token_ids must be a list of integers"
        if self.logit_bias is not None and (not isinstance(self.logit_bias, dict) or not all(
                is_int(k) and is_num(v) for k, v in self.logit_bias.items())):
            return "logit_bias must map integer token ids to numbers"
        return None

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 sample greedily (as vLLM): dividing by them would
        overflow float32 logits into inf/NaN."""
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class RejectReason:
    """Structured reason attached to a rejected submit: which gate, what was needed,
    what exists (both in the gate's unit: tokens, blocks or requests)."""

    code: RejectCode
    message: str
    needed: int = 0
    available: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of the sampled token and of the top alternatives (natural log)."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


# ---------------------------------------------------------------- received by the engine


@dataclass(frozen=True)
class Hello:
    """Ready handshake: sent repeatedly until the engine's Welcome arrives on the topic."""

    frontend_id: str


@dataclass(frozen=True)
class Submit:
    request_id: str
    frontend_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    session_id: str | None = None  # Fair/VTC accounting unit (OpenAI ``user``)
    priority: int = 0  # higher drains first


@dataclass(frozen=True)
class Abort:
    frontend_id: str
    request_ids: list[str]


@dataclass(frozen=True)
class Heartbeat:
    """Frontend liveness; the engine aborts a silent frontend's requests."""

    frontend_id: str


@dataclass(frozen=True)
class Goodbye:
    """A frontend is leaving: abort everything it submitted."""

    frontend_id: str


@dataclass(frozen=True)
class StatsRequest:
    frontend_id: str
    nonce: int


# ---------------------------------------------------------------- received by frontends


@dataclass(frozen=True)
class RuntimeInfo:
    """What an engine runs: the one record that its start-up line, the frontend's
    ``/version`` and ``/scheduler/stats`` all read (see :meth:`summary`)."""

    model: str  # model directory or file the engine loaded
    device: str  # torch device, e.g. "cpu", "cuda:0"
    dtype: str  # weights and KV cache, e.g. "float32", "bfloat16"
    torch_threads: int  # intra-op threads of the tick thread
    backend: str  # "paged" | "hf"
    prefill_mode: str  # resolved PREFILL_MODE
    policy: str  # "fcfs" | "fair"
    transport: str = ""  # how frontends reach the engine, e.g. "zmq ipc", "zmq tcp"
    model_fingerprint: str = ""  # hex digest of config + tokenizer files; frontends compare theirs

    def summary(self) -> str:
        """One line for logs: ``device cpu, dtype float32, 1 thread, backend paged, ...``."""
        threads = f"{self.torch_threads} thread{'s' if self.torch_threads != 1 else ''}"
        return (f"device {self.device}, dtype {self.dtype}, {threads}, backend {self.backend}, "
                f"prefill {self.prefill_mode}, policy {self.policy}"
                + (f", transport {self.transport}" if self.transport else ""))


@dataclass(frozen=True)
class Welcome:
    engine_id: str
    max_model_len: int  # tokens
    eos_token_ids: list[int]
    max_queue_size: int  # requests
    heartbeat_interval_s: float
    runtime: RuntimeInfo | None = None  # what the engine runs


@dataclass(frozen=True)
class Ack:
    request_id: str
    accepted: bool
    reason: RejectReason | None = None


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one request in one tick; ``finish_reason`` set on its last output."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    # With SamplingParams.prompt_logprobs: prompt tokens 1 .. prompt_len-1 (the first has
    # no context), sent once, with the request's first output.
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class StepOutput:
    """Everything one tick produced for one frontend."""

    outputs: list[RequestOutput]


@dataclass(frozen=True)
class Stats:
    """The engine's stats: the answer to ``StatsRequest(nonce)`` on the asker's topic, or,
    with ``nonce`` 0, the periodic publication on the broadcast topic (every
    ``stats_interval_s``) that feeds ``/scheduler/stats/stream``."""

    nonce: int
    data: dict


@dataclass(frozen=True)
class EngineHeartbeat:
    """Published on the broadcast topic every ``heartbeat_interval_s`` seconds."""

    engine_id: str
    time: float


BROADCAST_TOPIC = b"*"

ENGINE_INBOUND = (Hello, Submit, Abort, Heartbeat, Goodbye, StatsRequest)
FRONTEND_INBOUND = (Welcome, Ack, StepOutput, Stats, EngineHeartbeat)
