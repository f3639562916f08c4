"""Typed messages exchanged between frontends (and zmq client scripts) and the engine.

Messages are grouped by the process that *receives* them. Each is a frozen
``msgspec.Struct`` encoded as a msgpack array ``[tag, field_1, field_2, ...]`` (nested
structs without the tag); :mod:`shared.codec` holds the tag table and decodes every
frame into exactly one of these types, checking every field's type and range as it
decodes (the ``Annotated`` constraints below). Token ids always travel as ids, never as
text.

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
from typing import Annotated, Any

from msgspec import Meta, Struct, field

from shared.constraints import Constraint

GREEDY_TEMPERATURE = 1e-5  # below this, temperature sampling is argmax

# Field types with the bounds every decoded frame is checked against (a frame that breaks
# one is not a message: it is counted and dropped, see shared.codec).
MAX_ID_CHARS = 256
MAX_PROMPT_TOKENS = 1 << 20  # far above any context window; the engine checks its own limit
MAX_LIST = 4096  # stop token ids, logit_bias entries, request ids in one Abort, EOS ids
Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
TokenId = Annotated[int, Meta(ge=0, lt=1 << 31)]
Count = Annotated[int, Meta(ge=0, lt=1 << 62)]
Int64 = int  # msgpack integers are int64 (or uint64) by construction
Priority = Annotated[int, Meta(ge=-(1 << 31), lt=1 << 31)]


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


class SamplingParams(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Per-request sampling parameters, applied per row inside one batched step.

    ``None`` always means "not set". Types and ranges are checked when a frame is
    decoded (the annotations); :meth:`validate` repeats the ranges for parameters built
    in-process and checks the combinations.
    """

    max_tokens: Count = 16  # tokens to generate, at most
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0  # 0 → greedy (argmax)
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0  # nucleus mass in (0, 1]
    top_k: Annotated[int, Meta(ge=1, lt=1 << 31)] | None = None  # keep the k most likely; None → all
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0  # drop tokens with p < min_p · p_max
    seed: Int64 | None = None  # per-request generator; output independent of the batch
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0  # OpenAI: once per id seen in the output
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0  # OpenAI: per occurrence in the output
    repetition_penalty: Annotated[float, Meta(ge=1e-6, le=2.0)] = 1.0  # CTRL (Keskar et al. 2019, §4.1)
    logit_bias: Annotated[dict[TokenId, Annotated[float, Meta(ge=-100.0, le=100.0)]],
                          Meta(max_length=MAX_LIST)] | None = None  # token id → bias added to its logit
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_LIST)] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: Count = 0  # EOS and stop token ids are masked until this many tokens
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # None → none; k → sampled + top-k
    # None → none; k → each prompt token's logprob + top-k, computed in the prefill pass
    # (such rows skip the prefix cache: a cached block has no logits). Allows max_tokens 0.
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # Structured output: the grammar the generated text must match, as source text
    # (shared.constraints); None → unconstrained.
    constraint: Constraint | None = None

    def validate(self) -> str | None:
        """Return a human-readable problem with these parameters, or ``None`` if valid."""
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
        if self.logit_bias and not all(math.isfinite(v) and -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            return "logit_bias values must be numbers in [-100, 100]"
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            return "min_tokens must be in [0, max_tokens]"
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            return "logprobs must be in [0, 20]"
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            return "prompt_logprobs must be in [0, 20]"
        if self.constraint is not None:
            return self.constraint.validate()
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
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            return "constraint must be a Constraint or null"
        return None

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 sample greedily (as vLLM): dividing by them would
        overflow float32 logits into inf/NaN."""
        return self.temperature < GREEDY_TEMPERATURE


class RejectReason(Struct, frozen=True, array_like=True):
    """Structured reason attached to a rejected submit: which gate, what was needed,
    what exists (both in the gate's unit: tokens, blocks or requests)."""

    code: RejectCode
    message: Annotated[str, Meta(max_length=4096)]
    needed: Int64 = 0
    available: Int64 = 0
    retryable: bool = True  # False: this request can never be served here (no Retry-After)


class TokenLogprob(Struct, frozen=True, array_like=True):
    """Log-probability of the sampled token and of the top alternatives (natural log)."""

    token_id: TokenId
    logprob: float
    top_token_ids: Annotated[list[TokenId], Meta(max_length=64)] = field(default_factory=list)
    top_logprobs: Annotated[list[float], Meta(max_length=64)] = field(default_factory=list)


# ---------------------------------------------------------------- received by the engine


class Hello(Struct, frozen=True, array_like=True, tag=1):
    """Ready handshake: sent repeatedly until the engine's Welcome arrives on the topic."""

    frontend_id: Id


class Submit(Struct, frozen=True, array_like=True, tag=2):
    request_id: Id
    frontend_id: Id
    prompt_token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    params: SamplingParams
    session_id: Annotated[str, Meta(max_length=MAX_ID_CHARS)] | None = None  # Fair/VTC unit (OpenAI ``user``)
    priority: Priority = 0  # higher drains first


class Abort(Struct, frozen=True, array_like=True, tag=3):
    frontend_id: Id
    request_ids: Annotated[list[Id], Meta(max_length=MAX_LIST)]


class Heartbeat(Struct, frozen=True, array_like=True, tag=4):
    """Frontend liveness; the engine aborts a silent frontend's requests."""

    frontend_id: Id


class Goodbye(Struct, frozen=True, array_like=True, tag=5):
    """A frontend is leaving: abort everything it submitted."""

    frontend_id: Id


class StatsRequest(Struct, frozen=True, array_like=True, tag=6):
    frontend_id: Id
    nonce: Count


# ---------------------------------------------------------------- received by frontends


class RuntimeInfo(Struct, frozen=True, array_like=True):
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
    kernels: str = ""  # paged backend: "c (attention amx-bf16)" (compiled for this CPU) | "torch"; "" for hf
    model_runner: str = ""  # "tickserve llama" | "transformers"
    single_thread_below: int = 0  # passes of fewer tokens run on one thread (0: never)
    lent_threads: int = 0  # at most this many more threads for a low-bit pass while sibling engines idle
    lend_below: int = 0  # ... for passes of fewer tokens than this
    kv_block_size: int = 0  # tokens per KV block (0: not reported)
    kv_num_blocks: int = 0  # blocks in the KV pool
    weights: str = ""  # weights' precision: "bfloat16", or the packed types, e.g. "Q4_1×210 Q8_0×1 (gguf)"
    matmul: str = ""  # which matmul a pass takes, e.g. "low-bit avx512vnni (every pass)"
    role: str = ""  # "monolithic" | "prefill" | "decode" (disaggregated prefill and decode)

    def summary(self) -> str:
        """One line for logs: ``device cpu, dtype float32, 1 thread, backend paged, ...``."""
        threads = f"{self.torch_threads} thread{'s' if self.torch_threads != 1 else ''}"
        if self.single_thread_below and self.torch_threads > 1:
            threads += f" (1 below {self.single_thread_below} tokens a pass)"
        if self.lent_threads:
            when = "every pass" if self.lend_below >= 1 << 30 else f"passes below {self.lend_below} tokens"
            threads += f" (up to {self.torch_threads + self.lent_threads} on idle engines' cores: {when})"
        backend = self.backend + (f" ({self.model_runner}, kernels {self.kernels})" if self.kernels else "")
        weights = f", weights {self.weights}" if self.weights else ""
        return (f"device {self.device}, dtype {self.dtype}{weights}, {threads}, backend {backend}, "
                f"prefill {self.prefill_mode}, policy {self.policy}"
                + (f", role {self.role}" if self.role and self.role != "monolithic" else "")
                + (f", transport {self.transport}" if self.transport else ""))


class Welcome(Struct, frozen=True, array_like=True, tag=20):
    engine_id: Id
    max_model_len: Count  # tokens
    eos_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_LIST)]
    max_queue_size: Count  # requests
    heartbeat_interval_s: Annotated[float, Meta(gt=0.0)]
    runtime: RuntimeInfo | None = None  # what the engine runs


class Ack(Struct, frozen=True, array_like=True, tag=21):
    request_id: Id
    accepted: bool
    reason: RejectReason | None = None


class RequestOutput(Struct, frozen=True, array_like=True):
    """New tokens of one request in one tick; ``finish_reason`` set on its last output."""

    request_id: Id
    token_ids: list[TokenId]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: Count = 0
    num_cached_tokens: Count = 0  # prompt tokens served from the prefix cache
    error: Annotated[str, Meta(max_length=4096)] | None = None
    # With SamplingParams.prompt_logprobs: prompt tokens 1 .. prompt_len-1 (the first has
    # no context), sent once, with the request's first output.
    prompt_logprobs: list[TokenLogprob] | None = None


class StepOutput(Struct, frozen=True, array_like=True, tag=22):
    """Everything one tick produced for one frontend."""

    outputs: list[RequestOutput]


class Stats(Struct, frozen=True, array_like=True, tag=23):
    """The engine's stats: the answer to ``StatsRequest(nonce)`` on the asker's topic, or,
    with ``nonce`` 0, the periodic publication on the broadcast topic (every
    ``stats_interval_s``) that feeds ``/scheduler/stats/stream``."""

    nonce: Count
    data: dict[str, Any]


class EngineHeartbeat(Struct, frozen=True, array_like=True, tag=24):
    """Published on the broadcast topic every ``heartbeat_interval_s`` seconds."""

    engine_id: Id
    time: float


BROADCAST_TOPIC = b"*"

ENGINE_INBOUND = (Hello, Submit, Abort, Heartbeat, Goodbye, StatsRequest)
FRONTEND_INBOUND = (Welcome, Ack, StepOutput, Stats, EngineHeartbeat)
