"""Process configuration: one frozen dataclass per process.

Values come from, in order of precedence: CLI flags, environment variables
``TICKSERVE_<FIELD_NAME_UPPER>`` (e.g. ``TICKSERVE_MAX_BATCH_SIZE``), dataclass
defaults. The card's names stay recognisable: ``max_queue_size`` is
``--max-queue-size`` and ``TICKSERVE_MAX_QUEUE_SIZE``. Config is pure data — the
builders take the environment as an argument and do no other I/O.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

ENV_PREFIX = "TICKSERVE_"


class PrefillMode(str, enum.Enum):
    """How prompts reach the decode batch (the card's ``PREFILL_MODE`` seam)."""

    MONOLITHIC = "monolithic"  # whole prompt in one forward on admit
    CHUNKED = "chunked"  # version A: one PREFILL_CHUNK_SIZE chunk per tick, own pass
    MIXED_BATCH = "mixed_batch"  # version B: decode rows + prefill chunks in one pass, one token budget
    DISAGGREGATED = "disaggregated"  # P/D: prefill engines hand finished rows to decode engines


class EngineRole(str, enum.Enum):
    """What one engine does under ``PREFILL_MODE=disaggregated`` (monolithic: everything)."""

    MONOLITHIC = "monolithic"  # admits, prefills and decodes its own requests
    PREFILL = "prefill"  # _pending and _prefilling; hands each row to a decode engine at _promote_to_decode
    DECODE = "decode"  # accepts handovers (gates 2 and 3) and decodes them


class PolicyName(str, enum.Enum):
    FCFS = "fcfs"
    FAIR = "fair"


class BackendName(str, enum.Enum):
    HF = "hf"  # transformers DynamicCache, left-padded batch
    PAGED = "paged"  # KV in the block pool, block tables, no padding


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class EngineConfig:
    model: str = _opt("", "local HF model directory or .gguf file; empty → embedded SmolLM2-135M-Instruct")
    device: str = _opt("auto", "auto | cuda | mps | cpu")
    dtype: str = _opt("auto", "auto (bfloat16 on CUDA and on CPUs with native bfloat16: AVX-512 BF16, AMX, Arm bf16; float32 elsewhere) | float32 | bfloat16 | float16")
    run_dir: str = _opt("", "directory for ipc:// socket files; empty → a fresh directory under /tmp")
    transport: str = _opt("auto", "auto | shm (shared-memory rings for frontends that reach the engine through its run directory, ZeroMQ for the rest) | zmq (ZeroMQ only)")
    shm_ring_bytes: int = _opt(4 << 20, "bytes of each shared-memory frontend's engine → frontend ring, a power of two (the other direction gets a quarter)")
    max_shm_peers: int = _opt(64, "shared-memory frontends one engine serves at once (each costs its rings: 1.25 × shm_ring_bytes); more are refused with the reason, which the frontend logs")
    input_addr: str = _opt("", "engine PULL address (submit/abort); empty → ipc://<run_dir>/input.sock")
    output_addr: str = _opt("", "engine PUB address (acks/tokens); empty → ipc://<run_dir>/output.sock")
    max_queue_size: int = _opt(256, "gate 1: requests allowed to wait before HTTP 429 (MAX_QUEUE_SIZE in docs/scheduler.md)")
    max_batch_size: int = _opt(256, "rows running at once, prefilling plus decoding (MAX_BATCH_SIZE in docs/scheduler.md)")
    prefill_chunk_size: int = _opt(256, "tokens of one prompt per tick in chunked mode (PREFILL_CHUNK_SIZE in docs/scheduler.md)")
    prefill_mode: str = _opt("", "monolithic | chunked | mixed_batch | disaggregated; empty → chunked if prefill_chunk_size > 0")
    max_num_batched_tokens: int = _opt(0, "mixed_batch: tokens in one tick's forward pass, one per decode row first, prompt chunks get the rest; 0 → max_batch_size + prefill_chunk_size (vLLM: max_num_batched_tokens)")
    role: str = _opt("monolithic", "monolithic | prefill | decode: a prefill engine runs _pending and prefill and hands each row to a decode engine; a decode engine accepts those handovers and decodes (either implies prefill_mode disaggregated)")
    decode_engines: str = _opt("", "prefill role: the decode engines to hand rows to, comma-separated: run directories (shared memory, this host) or tcp://HOST:PORT (their --handover-addr)")
    handover_addr: str = _opt("", "decode role: also accept handovers over ZeroMQ at this tcp://HOST:PORT (across hosts); the run directory's handover socket serves this host")
    max_handover_bytes: int = _opt(1 << 30, "decode role: largest KV payload one handover may carry, bytes; larger ones are refused")
    policy: str = _opt("fcfs", "fcfs | fair (Virtual Token Counter)")
    fair_prompt_weight: float = _opt(1.0, "VTC weight w_p of a prompt token (Sheng et al., OSDI'24)")
    fair_output_weight: float = _opt(2.0, "VTC weight w_q of an output token (Sheng et al., OSDI'24)")
    kv_budget_tokens: int = _opt(0, "gate 2: sum of prompt_len + max_tokens over running rows; 0 → kv_block_size · kv_num_blocks (active-KV budget in docs/scheduler.md)")
    kv_block_size: int = _opt(16, "tokens per KV cache block")
    kv_num_blocks: int = _opt(0, "blocks in the pool; 0 → enough for max_batch_size full-context rows, capped by kv_memory_fraction")
    kv_memory_fraction: float = _opt(0.25, "when kv_num_blocks is 0, the pool takes at most this fraction of the accelerator's (or host's) free memory at start, within the process's memory cgroup limit; 0 → no cap")
    kv_prefault: bool = _opt(True, "map the KV pool's pages ahead of use on an idle-priority thread, so K/V writes do not page-fault inside forward passes; the pool is then resident (CPU, Linux 5.14+)")
    backend: str = _opt("paged", "paged (KV in the block pool, prefix caching) | hf (DynamicCache, left-padded)")
    quantization: str = _opt("auto", "weights' precision: auto (a Llama GGUF's own low-bit types on a CPU, as they are; else none) | none (de-quantized, in the model dtype) | int8 | int4 (the projections quantized at start: Q8_0, Q4_1)")
    kernels: str = _opt("auto", "paged backend's non-matmul kernels: auto (C compiled for this CPU at first start, else torch ops) | c | torch")
    prefix_caching: bool = _opt(True, "reuse cached KV blocks of shared prompt prefixes (paged backend only)")
    max_model_len: int = _opt(2048, "context window in tokens (prompt + output); capped by the model's own")
    torch_threads: int = _opt(0, "torch intra-op threads of large forward passes; 0 → every CPU this process may use")
    lend_idle_cores: bool = _opt(True, "engines of one `tickserve serve` lend their cores while idle: a pass on the low-bit path runs on one more thread per idle engine (a lone stream gets every core; CPU)")
    core_board: str = _opt("", "the shared file through which engines of one host say whether they are busy (set by `tickserve serve`); empty → no lending")
    core_board_slot: int = _opt(0, "this engine's slot on --core-board")
    single_thread_below: int = _opt(32, "forward passes of fewer tokens than this run on one thread, leaving the other cores to the frontend (CPU; 0 → never)")
    heartbeat_interval_s: float = _opt(0.25, "engine → frontend heartbeat period, seconds")
    stats_interval_s: float = _opt(0.25, "period of the engine's stats broadcast (/scheduler/stats/stream, /dashboard), seconds; 0 → off")
    frontend_timeout_s: float = _opt(5.0, "a frontend silent this long has its requests aborted, seconds")
    drain_timeout_s: float = _opt(30.0, "on SIGTERM, finish in-flight requests for at most this long, seconds")
    seed: int = _opt(0, "global torch seed (unseeded sampling)")
    log_level: str = _opt("info", "debug | info | warning | error")

    @property
    def resolved_prefill_mode(self) -> PrefillMode:
        """The card's rule: an empty mode is derived from PREFILL_CHUNK_SIZE (>0 → chunked);
        a prefill or decode role is disaggregated."""
        if self.role in (EngineRole.PREFILL.value, EngineRole.DECODE.value):
            return PrefillMode.DISAGGREGATED
        if self.prefill_mode:
            return PrefillMode(self.prefill_mode)
        return PrefillMode.CHUNKED if self.prefill_chunk_size > 0 else PrefillMode.MONOLITHIC

    @property
    def resolved_max_num_batched_tokens(self) -> int:
        """mixed_batch's per-tick token budget (vLLM's ``max_num_batched_tokens``); the
        default lets a full decode batch still leave a whole chunk for prefill."""
        if self.max_num_batched_tokens > 0:
            return self.max_num_batched_tokens
        return self.max_batch_size + self.prefill_chunk_size

    @property
    def resolved_num_blocks(self) -> int:
        """``kv_num_blocks``, or blocks for ``max_batch_size`` rows at ``max_model_len``
        (the engine caps that by ``kv_memory_fraction`` once it knows the model's block size
        in bytes, and builds its scheduler from the capped value)."""
        if self.kv_num_blocks > 0:
            return self.kv_num_blocks
        per_row = -(-self.max_model_len // self.kv_block_size)
        return per_row * self.max_batch_size

    @property
    def resolved_kv_budget_tokens(self) -> int:
        if self.kv_budget_tokens > 0:
            return self.kv_budget_tokens
        return self.resolved_num_blocks * self.kv_block_size

    @property
    def resolved_input_addr(self) -> str:
        return self.input_addr or f"ipc://{os.path.join(self.run_dir, 'input.sock')}"

    @property
    def resolved_output_addr(self) -> str:
        return self.output_addr or f"ipc://{os.path.join(self.run_dir, 'output.sock')}"

    def problems(self) -> list[str]:
        """Settings that can never work; the engine refuses to start with any."""
        out = []
        try:
            mode = self.resolved_prefill_mode
        except ValueError:
            out.append(f"unknown prefill_mode {self.prefill_mode!r}")
        else:
            if mode is PrefillMode.CHUNKED and self.prefill_chunk_size <= 0:
                out.append("prefill_mode=chunked needs prefill_chunk_size > 0")
            if mode is PrefillMode.MIXED_BATCH:
                if self.resolved_max_num_batched_tokens <= self.max_batch_size:
                    out.append("prefill_mode=mixed_batch needs max_num_batched_tokens > max_batch_size "
                               "(a full decode batch must leave room for prefill)")
                if self.backend == BackendName.HF.value:
                    out.append("prefill_mode=mixed_batch needs backend paged")
            if self.prefill_mode and mode is not PrefillMode(self.prefill_mode):
                out.append(f"role {self.role} runs prefill_mode disaggregated, not {self.prefill_mode}")
            elif mode is PrefillMode.DISAGGREGATED and self.role not in (EngineRole.PREFILL.value,
                                                                         EngineRole.DECODE.value):
                out.append("prefill_mode=disaggregated needs role prefill or decode "
                           "(tickserve serve --prefill-mode disaggregated starts both)")
        out += _role_problems(self)
        if self.policy not in {p.value for p in PolicyName}:
            out.append(f"unknown policy {self.policy!r}")
        if self.backend not in {b.value for b in BackendName}:
            out.append(f"unknown backend {self.backend!r}")
        if self.kernels not in ("auto", "c", "torch"):
            out.append(f"unknown kernels {self.kernels!r} (auto, c, torch)")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            out.append(f"unknown quantization {self.quantization!r} (auto, none, int8, int4)")
        if self.transport not in ("auto", "shm", "zmq"):
            out.append(f"unknown transport {self.transport!r} (auto, shm, zmq)")
        if self.shm_ring_bytes < 1 << 14 or self.shm_ring_bytes & (self.shm_ring_bytes - 1):
            out.append("shm_ring_bytes must be a power of two of at least 16384")
        if self.device not in DEVICES and not (self.device.startswith("cuda:") and self.device[5:].isdigit()):
            out.append(f"unknown device {self.device!r} ({', '.join(DEVICES)}, or cuda:N)")
        if self.dtype not in DTYPE_NAMES:
            out.append(f"unknown dtype {self.dtype!r} ({', '.join(DTYPE_NAMES)})")
        for name in ("max_queue_size", "max_batch_size", "kv_block_size", "max_model_len", "max_shm_peers"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be at least 1")
        for name in ("prefill_chunk_size", "max_num_batched_tokens", "kv_budget_tokens", "kv_num_blocks",
                     "torch_threads", "single_thread_below", "seed", "core_board_slot"):
            if getattr(self, name) < 0:
                out.append(f"{name} must be >= 0")
        if not 0.0 <= self.kv_memory_fraction < 1.0:
            out.append("kv_memory_fraction must be in [0, 1)")
        for name in ("fair_prompt_weight", "fair_output_weight", "heartbeat_interval_s"):
            if not getattr(self, name) > 0:
                out.append(f"{name} must be > 0")
        for name in ("stats_interval_s", "drain_timeout_s"):
            if not getattr(self, name) >= 0:
                out.append(f"{name} must be >= 0")
        if not self.frontend_timeout_s > 2 * self.heartbeat_interval_s:
            out.append("frontend_timeout_s must exceed two heartbeat intervals")
        out += _address_problems(self) + _log_level_problems(self.log_level)
        return out


@dataclass(frozen=True)
class FrontendConfig:
    model: str = _opt("", "model directory (for the tokenizer and chat template); empty → embedded default")
    host: str = _opt("127.0.0.1", "HTTP bind address")
    port: int = _opt(8000, "HTTP port")
    run_dir: str = _opt("", "engine run directory (ipc:// sockets)")
    engine: str = _opt("", "engines, comma-separated: run directories, tcp://HOST:PORT (output on PORT+1) or IN+OUT address pairs; requests are routed by session/prefix affinity with bounded load; empty → the one engine of run_dir / input_addr / output_addr")
    routing: str = _opt("affinity", "with several engines: affinity (session or prompt prefix, rendezvous hashing, bounded load) | round_robin")
    http_fd: int = _opt(-1, "serve HTTP on this already-listening socket (inherited from tickserve serve --api-server-count); -1 → bind host:port")
    transport: str = _opt("auto", "auto (shared memory when the engine is reached through its run directory, else ZeroMQ) | shm | zmq")
    input_addr: str = _opt("", "engine PULL address; empty → ipc://<run_dir>/input.sock")
    output_addr: str = _opt("", "engine PUB address; empty → ipc://<run_dir>/output.sock")
    frontend_id: str = _opt("", "PUB topic of this frontend; empty → random")
    served_model_name: str = _opt("", "model id reported by /v1/models; empty → derived from the model path")
    api_key: str = _opt("", "if set, require 'Authorization: Bearer <key>'")
    allowed_origins: str = _opt("", "CORS: comma-separated origins a browser app may call from, or *; empty → CORS off")
    max_body_bytes: int = _opt(4 * 1024 * 1024, "request body size limit, bytes")
    header_timeout_s: float = _opt(10.0, "a connection that has not sent a complete request head this long after its first byte is closed, seconds")
    body_timeout_s: float = _opt(30.0, "a request body not received within this long is answered 408, seconds")
    max_request_work: int = _opt(1 << 18, "one request's work: prompts × n × (prompt + max_tokens) tokens × (1 + logprobs + prompt_logprobs), in token entries (about 50 bytes of response each); more is answered 400")
    max_connections_per_client: int = _opt(512, "open connections allowed from one client address; more are answered 429 and closed")
    max_dashboard_streams_per_client: int = _opt(64, "open dashboard streams (/scheduler/stats/stream) allowed from one client address, counted apart from the connections above; more are answered 429")
    engine_timeout_s: float = _opt(1.0, "no engine heartbeat for this long → engine is down, seconds")
    ack_timeout_s: float = _opt(10.0, "wait for the engine's submit ack at most this long, seconds")
    drain_timeout_s: float = _opt(30.0, "on SIGTERM, wait this long for in-flight requests, seconds")
    log_level: str = _opt("info", "debug | info | warning | error")
    disable_log_requests: bool = _opt(False, "no log line per request (method, path, status, tokens, TTFT, latency, request id)")
    disable_uvicorn_access_log: bool = _opt(False, "vLLM's flag, accepted: the same as --disable-log-requests (the request line is the access log)")
    disable_log_stats: bool = _opt(False, "no periodic stats line (running, waiting, KV usage, tokens/s) while there is work")
    log_stats_interval_s: float = _opt(10.0, "period of the stats line while there is work, seconds")
    default_max_tokens: int = _opt(0, "max_tokens of a request that omits it (completions and chat); 0 → the model's generation_config.json max_new_tokens when it sets one, else the endpoint's own: 16 for /v1/completions (OpenAI's), the rest of the context for chat")
    chat_template: str = _opt("", "a Jinja chat template file used for every chat request instead of the model's (as vLLM's --chat-template); empty → the model's, or the packaged Hermes-style tool template for requests with tools")
    enable_auto_tool_choice: bool = _opt(False, "allow tool_choice \"auto\": the model decides, and its <tool_call> blocks are parsed (as vLLM's flag)")
    tool_call_parser: str = _opt("hermes", "how tool calls are read from the model's text: hermes (<tool_call>{...}</tool_call>)")

    @property
    def resolved_input_addr(self) -> str:
        return self.input_addr or f"ipc://{os.path.join(self.run_dir, 'input.sock')}"

    @property
    def resolved_output_addr(self) -> str:
        return self.output_addr or f"ipc://{os.path.join(self.run_dir, 'output.sock')}"

    @property
    def log_requests(self) -> bool:
        return not (self.disable_log_requests or self.disable_uvicorn_access_log)

    def problems(self) -> list[str]:
        """Settings that can never work; the frontend refuses to start with any."""
        out = []
        if self.chat_template and not os.path.isfile(self.chat_template):
            out.append(f"chat_template {self.chat_template!r} is not a file")
        if self.tool_call_parser not in ("hermes",):
            out.append(f"unknown tool_call_parser {self.tool_call_parser!r} (hermes)")
        if not 1 <= self.port <= 65535:
            out.append(f"port {self.port} is not in 1..65535")
        if not self.host:
            out.append("host must not be empty")
        for name in ("max_body_bytes", "max_connections_per_client", "max_request_work",
                     "max_dashboard_streams_per_client"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be at least 1")
        if self.default_max_tokens < 0:
            out.append("default_max_tokens must be >= 0 (0: the model's generation config, else the context)")
        for name in ("header_timeout_s", "body_timeout_s", "engine_timeout_s", "ack_timeout_s", "log_stats_interval_s"):
            if not getattr(self, name) > 0:
                out.append(f"{name} must be > 0")
        if not self.drain_timeout_s >= 0:
            out.append("drain_timeout_s must be >= 0")
        if self.transport not in ("auto", "shm", "zmq"):
            out.append(f"unknown transport {self.transport!r} (auto, shm, zmq)")
        if self.routing not in ("affinity", "round_robin"):
            out.append(f"unknown routing {self.routing!r} (affinity, round_robin)")
        if self.engine:
            try:
                parse_engines(self.engine)
            except ValueError as exc:
                out.append(f"engine: {exc}")
        if self.transport == "shm" and (self.input_addr or self.output_addr):
            out.append("transport shm reaches an engine through its run directory (--run-dir), not by addresses")
        return out + _address_problems(self) + _log_level_problems(self.log_level)


@dataclass(frozen=True)
class ServeConfig:
    """``tickserve serve``'s own settings (the supervisor process)."""

    api_server_count: int = _opt(1, "frontend processes sharing the HTTP port (vLLM: --api-server-count)")
    data_parallel_size: int = _opt(0, "engine processes, each on its share of the CPUs (or a device) with its own KV pool; frontends route between them (vLLM: --data-parallel-size); 0 → auto: on a CPU, usable CPUs ÷ --torch-threads (one thread each when unset), at most 8 and as fit in half the free memory; 1 on a GPU")

    prefill_engines: int = _opt(0, "--prefill-mode disaggregated: prefill engines; 0 → auto (half the usable CPUs, at least 1)")
    decode_engines: int = _opt(0, "--prefill-mode disaggregated: decode engines; 0 → auto (the other CPUs, at least 1)")

    def problems(self) -> list[str]:
        out = [] if self.api_server_count >= 1 else ["api_server_count must be at least 1"]
        out += [f"{n} must be at least 0 (0: auto)" for n in ("prefill_engines", "decode_engines")
                if getattr(self, n) < 0]
        return out + ([] if self.data_parallel_size >= 0 else ["data_parallel_size must be at least 0 (0: auto)"])


DEVICES = ("auto", "cuda", "mps", "cpu")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("debug", "info", "warning", "error")


def parse_engines(spec: str) -> list[tuple[str, str, str]]:
    """``spec`` as ``(address label, run_dir, input_addr+output_addr)`` entries: run
    directories, ``tcp://HOST:PORT`` pairs (output on ``PORT + 1``) or ``IN+OUT``.
    Raises ``ValueError`` naming a malformed entry."""
    out = []
    for raw in [s.strip() for s in spec.split(",") if s.strip()]:
        if "+" in raw:
            inp, outp = raw.split("+", 1)
            if not (inp.startswith("tcp://") and outp.startswith("tcp://")):
                raise ValueError(f"engine {raw!r}: IN+OUT takes two tcp:// addresses")
            out.append((raw, "", f"{inp}+{outp}"))
        elif raw.startswith("tcp://"):
            host, _, port = raw[len("tcp://"):].rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65535:
                raise ValueError(f"engine {raw!r}: expected tcp://HOST:PORT")
            out.append((raw, "", f"tcp://{host}:{port}+tcp://{host}:{int(port) + 1}"))
        else:
            out.append((raw, raw, ""))
    if not out:
        raise ValueError("no engine address given")
    return out


def _role_problems(config: "EngineConfig") -> list[str]:
    if config.role not in {r.value for r in EngineRole}:
        return [f"unknown role {config.role!r} (monolithic, prefill, decode)"]
    out = []
    if config.role != EngineRole.MONOLITHIC.value and config.backend != BackendName.PAGED.value:
        out.append(f"role {config.role} needs backend paged (its KV blocks are what is handed over)")
    if config.role == EngineRole.PREFILL.value:
        if not config.decode_engines:
            out.append("role prefill needs --decode-engines (run directories or tcp://HOST:PORT)")
        else:
            try:
                parse_decode_engines(config.decode_engines)
            except ValueError as exc:
                out.append(f"decode_engines: {exc}")
    elif config.decode_engines:
        out.append("decode_engines is for role prefill")
    if config.handover_addr:
        if config.role != EngineRole.DECODE.value:
            out.append("handover_addr is for role decode")
        elif not config.handover_addr.startswith("tcp://"):
            out.append(f"handover_addr {config.handover_addr!r} is not a tcp:// address")
    if config.max_handover_bytes < 1:
        out.append("max_handover_bytes must be at least 1")
    return out


def parse_decode_engines(spec: str) -> list[str]:
    """A prefill engine's ``decode_engines``: run directories (shared memory) and
    ``tcp://HOST:PORT`` addresses, in order. Raises ``ValueError`` naming a bad entry."""
    out = []
    for raw in [s.strip() for s in spec.split(",") if s.strip()]:
        if raw.startswith("tcp://"):
            host, _, port = raw[len("tcp://"):].rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"decode engine {raw!r}: expected tcp://HOST:PORT")
        elif "://" in raw:
            raise ValueError(f"decode engine {raw!r}: a run directory or tcp://HOST:PORT")
        out.append(raw)
    if not out:
        raise ValueError("no decode engine given")
    return out


def _address_problems(config) -> list[str]:
    out = []
    for name in ("input_addr", "output_addr"):
        addr = getattr(config, name)
        if addr and not addr.startswith(("ipc://", "tcp://")):
            out.append(f"{name} {addr!r} is not an ipc:// or tcp:// address")
    return out


def _log_level_problems(level: str) -> list[str]:
    return [] if level.lower() in LOG_LEVELS else [f"unknown log_level {level!r} ({', '.join(LOG_LEVELS)})"]


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def boolean(raw: str) -> bool:
    """A boolean setting: true/false, yes/no, on/off, 1/0 (any case); anything else is
    an error, never a silent false. Raises ``ValueError``."""
    word = str(raw).strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"not a boolean: {raw!r} (true/false, yes/no, on/off, 1/0)")


def _parse(tp: Any, raw: str) -> Any:
    if tp is bool:
        return boolean(raw)
    return tp(raw)


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per field of ``cls``; unset flags stay ``None`` so the
    environment and defaults can fill them."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if any(flag in a.option_strings for a in parser._actions):
            continue
        help_ = f"{f.metadata.get('help', '')} [env {env_name(f.name)}, default {f.default!r}]"
        tp = hints[f.name]
        if tp is bool:  # a bare --flag means true, as vLLM's switches; --flag false still works
            parser.add_argument(flag, dest=f.name, type=boolean, nargs="?", const=True, default=None, help=help_)
        else:
            parser.add_argument(flag, dest=f.name, type=tp, default=None, help=help_)


def build(cls: type, args: Mapping[str, Any] | argparse.Namespace | None = None,
          environ: Mapping[str, str] | None = None, **overrides: Any) -> Any:
    """Build ``cls`` from overrides > args > environment > defaults.

    Raises ``ValueError`` naming the variable when an environment value does not parse.
    """
    if isinstance(args, argparse.Namespace):
        args = vars(args)
    args = args or {}
    environ = environ if environ is not None else {}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif args.get(f.name) is not None:
            values[f.name] = args[f.name]
        elif env_name(f.name) in environ:
            try:
                values[f.name] = _parse(hints[f.name], environ[env_name(f.name)])
            except ValueError:
                raise ValueError(f"{env_name(f.name)}={environ[env_name(f.name)]!r} is not a valid "
                                 f"{hints[f.name].__name__}") from None
    return cls(**values)


def to_argv(config: Any) -> list[str]:
    """Flags that rebuild ``config`` exactly (for spawning a child process)."""
    out: list[str] = []
    for f in dataclasses.fields(config):
        out += ["--" + f.name.replace("_", "-"), str(getattr(config, f.name))]
    return out
