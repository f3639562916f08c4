"""The frontend's connection to the engine, bridged into asyncio.

Two threads own the channel; the event loop never touches it:

* the **receiver** owns the receiving side: it (re)connects (shared memory), performs the
  ready handshake (``Hello`` until ``Welcome`` arrives on our topic, against ZeroMQ's
  slow-joiner problem), dispatches acks and token outputs to per-request asyncio queues,
  and watches the engine's heartbeats;
* the **sender** owns the sending side: every message (submits, aborts, stats requests,
  our hellos and heartbeats) goes to it through a queue, so no send — a full ring, an
  engine that is slow to take frames, a reconnect in progress — ever blocks the event
  loop. A message that cannot be sent by its deadline fails its caller; an abort has no
  deadline: it is retried until it is delivered, or until the connection it concerned
  is gone (then the engine aborted those requests itself).

``submit`` returns only after the engine's ack, so the HTTP layer can answer 429 before
any SSE byte.

Failure handling: a sequence gap on our topic, or no engine heartbeat for
``engine_timeout_s``, fails every in-flight request at once with an error (never a
silent loss, never a hang); when heartbeats return from a (restarted) engine, the
handshake runs again. A channel that fails in the receiver (the engine's end closed,
or broke the protocol, or anything unexpected) is dropped and connected again; the
receiver thread itself never ends before :meth:`EngineClient.close`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import zmq

from frontend.engine_sender import STOP, SenderThread
from shared import protocol as p
from shared.config import FrontendConfig
from shared.protocol import BROADCAST_TOPIC
from shared import shm
from shared import shm_channel
from shared.transport import Client, ClientChannel, SequenceGap, topic_for

log = logging.getLogger("tickserve.frontend")


class EngineUnavailable(RuntimeError):
    """No engine is up (or it stopped answering)."""


class Rejected(Exception):
    """The engine refused a submit; ``reason`` says which gate and why."""

    def __init__(self, reason: p.RejectReason):
        super().__init__(reason.message)
        self.reason = reason


@dataclass
class RequestStream:
    """Outputs of one accepted request, in order. The last has ``finish_reason`` set."""

    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    async def __aiter__(self):
        while not self.finished:
            out: p.RequestOutput = await self.queue.get()
            if out.finish_reason is not None:
                self.finished = True
            yield out


class EngineClient(SenderThread):
    """Thread-safe facade used from the event loop."""

    def __init__(self, config: FrontendConfig, ctx: zmq.Context | None = None):
        self.config = config
        self.frontend_id = config.frontend_id or f"fe-{uuid.uuid4().hex[:12]}"
        self.topic = topic_for(self.frontend_id)
        self.ctx = ctx or zmq.Context.instance()
        self.channel: Client = open_channel(config, self.frontend_id, self.topic, self.ctx)
        self._channel_lock = threading.Lock()  # one send attempt, or a connect / disconnect, at a time
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # event loop and receiver → sender
        self.aborts_pending = 0  # request ids the sender still has to deliver (the sender's count)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._acks: dict[str, asyncio.Future] = {}
        self._streams: dict[str, RequestStream] = {}
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self.on_stats_broadcast = None  # event loop: called with each broadcast Stats' data
        # event loop: (request_id, self) → the stream of a request another engine handed to
        # this one (disaggregated prefill and decode), moved here; None if unknown
        self.adopt = None
        self._nonces = itertools.count(1)
        self._ids = itertools.count()
        self.welcome: p.Welcome | None = None
        self.engine_id: str | None = None
        # The frontend's own model fingerprint; an engine whose Welcome names another is
        # refused (its token ids would not mean what this frontend's tokenizer thinks).
        self.expected_fingerprint = ""
        self.refused: str | None = None  # why the engine was refused, once it was
        self.on_refused = None  # callable(reason), called from the receiver thread
        self._last_heartbeat = 0.0
        self._up = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-client", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="engine-client-send", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()
        self._sender.start()

    @property
    def is_up(self) -> bool:
        return self._up.is_set()

    @property
    def transport_name(self) -> str:
        """The carrier this frontend reaches the engine by: ``shm`` or ``zmq``."""
        return self.channel.carrier

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def take_stream(self, request_id: str) -> RequestStream | None:
        """Give up an in-flight request's stream (another engine streams it now)."""
        return self._streams.pop(request_id, None)

    def put_stream(self, stream: RequestStream) -> None:
        """Take over a stream from another engine's client: this engine streams it now."""
        self._streams[stream.request_id] = stream

    def in_flight_ids(self) -> set[str]:
        """Ids of the accepted requests whose outputs are still streaming."""
        return set(self._streams)

    def close(self) -> None:
        self._stop.set()
        self._outbox.put(STOP)
        self._thread.join(timeout=2)
        self._sender.join(timeout=2)
        try:  # both threads are done: the channel is this thread's now
            self.channel.send(p.Goodbye(self.frontend_id), timeout_ms=100)
        except Exception:
            pass
        self.channel.close()

    # ------------------------------------------------------------------ requests

    def new_request_id(self) -> str:
        return f"{self.frontend_id}-{next(self._ids)}"

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: p.SamplingParams,
                     session_id: str | None = None, priority: int = 0) -> RequestStream:
        """Send a request and wait for the engine's ack.

        Raises :class:`Rejected` (with the engine's structured reason) or
        :class:`EngineUnavailable` (engine down, or no ack within ``ack_timeout_s``).
        """
        if not self.is_up:
            raise EngineUnavailable("the engine is not available")
        loop = asyncio.get_running_loop()
        ack_future = loop.create_future()
        stream = RequestStream(request_id)
        self._acks[request_id] = ack_future
        self._streams[request_id] = stream  # registered before the submit: no output is lost
        try:
            self.post(p.Submit(request_id, self.frontend_id, prompt_token_ids, params, session_id, priority),
                       on_fail=lambda exc: _fail_future(ack_future, exc))
            ack: p.Ack = await asyncio.wait_for(ack_future, self.config.ack_timeout_s)
        except (asyncio.TimeoutError, zmq.ZMQError, shm.RingFull, shm.PeerGone) as exc:
            self._streams.pop(request_id, None)
            self.abort([request_id])
            raise EngineUnavailable(f"the engine did not acknowledge the request ({type(exc).__name__})") from None
        except BaseException:  # could not even be encoded or sent, or the caller was cancelled
            self._streams.pop(request_id, None)
            self.abort([request_id])
            raise
        finally:
            self._acks.pop(request_id, None)
        if not ack.accepted:
            self._streams.pop(request_id, None)
            raise Rejected(ack.reason or p.RejectReason(p.RejectCode.INVALID, "rejected"))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Tell the engine to drop these requests (idempotent, never raises, never waits):
        the sender retries until the engine has them."""
        for rid in request_ids:
            self._streams.pop(rid, None)
        if request_ids:
            self._outbox.put(p.Abort(self.frontend_id, list(request_ids)))

    async def stats(self, timeout: float = 2.0) -> dict:
        if not self.is_up:
            raise EngineUnavailable("the engine is not available")
        nonce = next(self._nonces)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[nonce] = fut
        try:
            self.post(p.StatsRequest(self.frontend_id, nonce), on_fail=lambda exc: _fail_future(fut, exc))
            return await asyncio.wait_for(fut, timeout)
        except (asyncio.TimeoutError, zmq.ZMQError, shm.RingFull, shm.PeerGone):
            raise EngineUnavailable("the engine did not answer the stats request") from None
        finally:
            self._stats_waiters.pop(nonce, None)

    # ------------------------------------------------------------------ receiver thread

    def _run(self) -> None:
        state = {"next_hello": 0.0, "next_beat": 0.0, "next_connect": 0.0,
                 "next_wait_log": time.monotonic() + 5.0, "refusal": None}
        while not self._stop.is_set():
            try:
                self._receive_once(state)
            except Exception as exc:  # noqa: BLE001 - never let the receiver die: drop the channel, go on
                log.exception("the engine connection failed; connecting again")
                self._drop_channel(f"the connection failed ({type(exc).__name__}: {exc})")
                time.sleep(0.05)

    def _drop_channel(self, why: str) -> None:
        with self._channel_lock:
            self.channel.disconnect()
        if self._up.is_set():
            self._engine_down(why)

    def _receive_once(self, state: dict) -> None:
        now = time.monotonic()
        if not self._up.is_set() and now >= state["next_wait_log"]:
            # a start waits for the engine's load and warm-up: news, not a problem; an engine
            # that was up and is gone is one (every request meanwhile is a 503 with its own line)
            (log.warning if state.get("was_up") else log.info)("waiting for an engine at %s", self._where())
            state["next_wait_log"] = now + 10.0
        elif self._up.is_set():
            state["next_wait_log"] = now + 5.0
            state["was_up"] = True
        if not self.channel.connected:  # shared memory: (re)connect to the run directory's socket
            if now >= state["next_connect"]:
                state["next_connect"] = now + 0.1
                with self._channel_lock:
                    connected = self.channel.connect()
                refusal = getattr(self.channel, "refusal", None)
                if connected:
                    log.info("connected to the engine's shared-memory socket %s", self._where())
                elif refusal:
                    state["next_connect"] = now + 1.0
                    if refusal != state["refusal"]:
                        log.error("the engine at %s refused this frontend: %s", self._where(), refusal)
                state["refusal"] = refusal
            if not self.channel.connected:
                time.sleep(0.02)
                return
        if not self._up.is_set() and now >= state["next_hello"]:
            self.post(p.Hello(self.frontend_id), 0.1)
            state["next_hello"] = now + 0.1
        elif self._up.is_set() and now >= state["next_beat"]:
            self.post(p.Heartbeat(self.frontend_id), 0.25)
            state["next_beat"] = now + 0.25
        if self._up.is_set() and now - self._last_heartbeat > self.config.engine_timeout_s:
            self._engine_down("no heartbeat from the engine")
        try:
            if not self.channel.poll(50):
                return
            for _ in range(1024):
                try:
                    received = self.channel.recv()
                except SequenceGap as gap:
                    if gap.topic == self.topic:
                        self._call(self._fail_all, f"lost messages from the engine ({gap})")
                    continue
                except shm.PeerGone:
                    raise
                except Exception as exc:  # a malformed frame: count and drop
                    log.warning("dropped a bad frame from the engine: %s", exc)
                    continue
                if received is None:
                    break
                self._on_message(received.msg)
        except shm.PeerGone as exc:  # the engine's end closed (it died or stopped), or broke the protocol
            if isinstance(exc, shm.PeerFault):
                log.error("the engine's shared memory broke the protocol (%s): connecting again", exc)
            self._drop_channel(f"the engine closed its connection ({exc})")

    def _where(self) -> str:
        if self.channel.carrier == "shm":
            return shm.socket_path(self.config.run_dir) + " (shared memory)"
        return f"{self.config.resolved_input_addr} (PUB {self.config.resolved_output_addr})"

    def _on_message(self, msg) -> None:
        """Receiver thread: liveness here; everything touching requests on the loop."""
        if isinstance(msg, p.EngineHeartbeat):
            if self.engine_id is not None and msg.engine_id != self.engine_id and self._up.is_set():
                self._engine_down("the engine restarted")
            self._last_heartbeat = time.monotonic()
        elif isinstance(msg, p.Welcome):
            if self.refused is None and self._model_mismatch(msg):
                self.refused = self._model_mismatch(msg)
                log.error("%s", self.refused)
                if self.on_refused is not None:
                    self.on_refused(self.refused)
            if not self._up.is_set() and self.refused is None:
                self.welcome = msg
                self.engine_id = msg.engine_id
                self._last_heartbeat = time.monotonic()
                self._up.set()
                log.info("connected to engine %s over %s (%s)", msg.engine_id, self.transport_name,
                         msg.runtime.summary() if msg.runtime else "runtime not reported")
        else:
            self._call(self._dispatch, msg)

    def _model_mismatch(self, welcome: p.Welcome) -> str | None:
        """Why this engine's model differs from the frontend's, or ``None``."""
        theirs = welcome.runtime.model_fingerprint if welcome.runtime else ""
        if not (self.expected_fingerprint and theirs) or theirs == self.expected_fingerprint:
            return None
        return (f"the engine serves another model ({welcome.runtime.model}, fingerprint {theirs}) "
                f"than this frontend tokenizes for (fingerprint {self.expected_fingerprint}); "
                "start both with the same --model")

    def _dispatch(self, msg) -> None:
        """Event loop thread: owns _acks, _streams and _stats_waiters."""
        if isinstance(msg, p.Ack):
            fut = self._acks.get(msg.request_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, p.StepOutput):
            for out in msg.outputs:
                stream = self._streams.get(out.request_id)
                if stream is None and self.adopt is not None:
                    stream = self.adopt(out.request_id, self)
                if stream is None:
                    continue
                if out.finish_reason is not None:
                    del self._streams[out.request_id]
                stream.queue.put_nowait(out)
        elif isinstance(msg, p.Stats) and msg.nonce == 0:  # the engine's periodic broadcast
            if self.on_stats_broadcast is not None:
                self.on_stats_broadcast(msg.data)
        elif isinstance(msg, p.Stats):
            fut = self._stats_waiters.get(msg.nonce)
            if fut is not None and not fut.done():
                fut.set_result(msg.data)

    def _call(self, fn, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed meanwhile
                pass

    def _engine_down(self, why: str) -> None:
        log.error("engine unavailable: %s", why)
        self._up.clear()
        self.engine_id = None
        self.channel.reset_sequence()
        self._call(self._fail_all, f"engine unavailable: {why}")

    def _fail_all(self, error: str) -> None:
        """Event loop thread: end every in-flight request with an error, now."""
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            stream.queue.put_nowait(p.RequestOutput(rid, [], p.FinishReason.ERROR, error=error))
        for rid, fut in list(self._acks.items()):
            if not fut.done():
                fut.set_result(p.Ack(rid, False, p.RejectReason(p.RejectCode.SHUTTING_DOWN, error)))
        if streams:
            self.abort(list(streams))


def _fail_future(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def open_channel(config: FrontendConfig, frontend_id: str, topic: bytes, ctx: zmq.Context) -> Client:
    """The carrier to the engine: shared memory when the engine is reached through its run
    directory on this host (``transport`` auto or shm) and this host supports it, ZeroMQ
    otherwise (``tcp://`` addresses, ``transport`` zmq). Raises ``RuntimeError`` for
    ``transport shm`` where shared memory cannot work."""
    on_host = bool(config.run_dir) and not (config.input_addr or config.output_addr)
    if config.transport in ("auto", "shm") and on_host:
        why_not = shm.available()
        if why_not is None:
            return shm_channel.ShmChannel(config.run_dir, frontend_id, topic, BROADCAST_TOPIC)
        if config.transport == "shm":
            raise RuntimeError(f"transport shm: {why_not}")
        log.warning("shared memory unavailable (%s): using ZeroMQ", why_not)
    elif config.transport == "shm":
        raise RuntimeError("transport shm needs the engine's run directory (--run-dir), not tcp:// addresses")
    return ClientChannel(ctx, config.resolved_input_addr, config.resolved_output_addr, topic, BROADCAST_TOPIC)
