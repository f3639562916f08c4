"""The engine process: an I/O thread and a tick thread around one scheduler.

I/O thread (never takes the backend lock)
    PULL: decode frames (bad ones are counted, logged, dropped), validate submits,
    gate 1 (queue capacity) and the configuration-only hard rejects, publish the
    ack, then hand the request to the tick thread through an in-process queue.
    PUB: acks, welcomes, stats, heartbeats, and every frame the tick thread
    produced (forwarded from an inproc socket, so only this thread touches PUB).
    Tracks frontend heartbeats and aborts the requests of a silent frontend.

Tick thread (holds the backend lock for the whole tick)
    drain the inbox (submits, aborts, departed frontends, stats requests) →
    ``scheduler.step()`` → encode one ``StepOutput`` per frontend.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

import msgspec
import torch
import zmq

from engine_proc.backends.base import Backend, pick_device, pick_dtype
from engine_proc.block_pool import BlockPool
from engine_proc.gates import never_fits
from engine_proc.policy import make_policy
from engine_proc.request import Request
from engine_proc.scheduler import Scheduler
from engine_proc.stats_window import StatsWindow
from engine_proc.threads import ThreadPlan, usable_cpus
from shared import codec, config as cfg, startup_faults
from shared import protocol as p
from shared.protocol import BROADCAST_TOPIC
from shared.transport import (AddressInUse, AddressLock, EngineInbound, EngineOutbound, Inbound,
                              RoutedOutbound, topic_for)

log = logging.getLogger("tickserve.engine")

TICK_OUT_ADDR = "inproc://tick-out"


@dataclass
class _Submit:
    request: Request


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _FrontendGone:
    frontend_id: str


def load_model(config: cfg.EngineConfig):
    """Load the causal LM on the configured device. Returns ``(model, model_dir)``.
    Raises :class:`~shared.startup_faults.StartupFault` for files that cannot load."""
    from transformers import AutoModelForCausalLM

    from engine_proc.model_loader import resolve_model
    model_dir = resolve_model(config.model)
    startup_faults.check_model_dir(model_dir, tokenizer=False)  # the engine needs no tokenizer
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    with startup_faults.faults_of(model_dir, tokenizer=False):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.to(device).eval(), model_dir


def eos_ids_of(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def build_scheduler(config: cfg.EngineConfig, model, on_left_pending=None) -> Scheduler:
    """Backend, block pool, policy and scheduler for ``model`` as ``config`` says.

    Raises ``NotImplementedError`` for a prefill mode that is not built yet.
    """
    max_len = min(config.max_model_len, getattr(model.config, "max_position_embeddings", config.max_model_len))
    if config.kv_num_blocks == 0:  # enough for a full batch at full context, within the memory cap
        blocks = config.resolved_num_blocks
        if config.kv_memory_fraction > 0:
            blocks = min(blocks, blocks_for_memory(model, config.kv_block_size, config.kv_memory_fraction))
        config = dataclasses.replace(config, kv_num_blocks=blocks)
    prefix_caching = config.backend == cfg.BackendName.PAGED.value and config.prefix_caching
    pool = BlockPool(config.resolved_num_blocks, config.kv_block_size, enable_prefix_caching=prefix_caching)
    backend = make_backend(config, model, max_len, pool)
    policy = make_policy(config.policy, prompt_weight=config.fair_prompt_weight,
                         output_weight=config.fair_output_weight)
    return Scheduler(config, backend, policy, pool, eos_ids_of(model),
                     prefix_caching=prefix_caching, on_left_pending=on_left_pending)


def kv_bytes_per_block(model, block_size: int) -> int:
    """Bytes of K and V for one block: 2 · layers · kv_heads · head_dim · block_size · dtype size."""
    c = model.config
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    elem = next(model.parameters()).element_size()
    return 2 * c.num_hidden_layers * kv_heads * head_dim * block_size * elem


def available_memory_bytes(device: torch.device) -> int:
    """Free accelerator memory (CUDA), else MemAvailable from /proc/meminfo (bytes)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def blocks_for_memory(model, block_size: int, fraction: float) -> int:
    """KV blocks that fit in ``fraction`` of the memory available now (at least 1)."""
    device = next(model.parameters()).device
    return max(1, int(available_memory_bytes(device) * fraction) // kv_bytes_per_block(model, block_size))


def make_backend(config: cfg.EngineConfig, model, max_model_len: int, pool: BlockPool) -> Backend:
    """The configured backend; the paged one keeps its KV in ``pool``'s blocks."""
    if config.backend == cfg.BackendName.HF.value:
        from engine_proc.backends.hf import HFBackend

        return HFBackend(model, max_model_len)
    from engine_proc.backends.paged import PagedBackend

    threads = ThreadPlan(config.torch_threads or usable_cpus(), config.single_thread_below)
    return PagedBackend(model, max_model_len, pool, kernels=config.kernels, threads=threads)


class EngineServer:
    """Runs the two threads over bound sockets until :meth:`stop`."""

    def __init__(self, config: cfg.EngineConfig, scheduler: Scheduler, runtime: p.RuntimeInfo | None = None):
        self.config = config
        self.scheduler = scheduler
        self.runtime = runtime or runtime_info(config, scheduler)
        self.engine_id = uuid.uuid4().hex[:12]
        self.limits = scheduler.limits
        self.ctx = zmq.Context.instance()
        self._locks = [AddressLock(config.resolved_input_addr)]  # raises AddressInUse
        try:
            self._locks.append(AddressLock(config.resolved_output_addr))
            self.inbound: Inbound = EngineInbound(self.ctx, config.resolved_input_addr)
            self.outbound = RoutedOutbound(EngineOutbound(self.ctx, config.resolved_output_addr))
            self.shm = self._shm_frontends(config)
        except BaseException:
            for lock in self._locks:
                lock.release()
            raise
        self._tick_out_pull = self.ctx.socket(zmq.PULL)
        self._tick_out_pull.bind(TICK_OUT_ADDR + self.engine_id)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self.backend_lock = threading.Lock()
        self._stop = threading.Event()
        self._draining = False
        # Gate 1 counters: each written by one thread only.
        self._accepted = 0  # I/O thread
        self._left_pending = 0  # tick thread
        self._live_ids: set[str] = set()  # I/O thread's view of unfinished request ids
        self._frontends: dict[str, float] = {}  # frontend id → last heard (monotonic)
        self._disconnect_check: list[float] = []  # when to look for frontends that left (monotonic)
        self._empty_step = codec.encode(p.StepOutput([]))
        self.bad_frames = 0
        self.rejected: dict[str, int] = {}  # I/O thread: submits refused before the ack, by code
        self.stats_window = StatsWindow(config.stats_interval_s)  # fed and published by the tick thread
        self.fatal: BaseException | None = None
        scheduler._on_left_pending = self._count_left_pending
        self._tick_thread = threading.Thread(target=self._tick_loop, name="engine-tick", daemon=True)
        self._threads = [threading.Thread(target=self._io_loop, name="engine-io", daemon=True),
                         self._tick_thread]

    def _shm_frontends(self, config: cfg.EngineConfig):
        """The shared-memory listener in the run directory (``transport`` auto), or None."""
        if config.transport == "zmq" or not config.run_dir:
            return None
        from engine_proc.shm_frontends import ShmFrontends
        from shared import shm

        why_not = shm.available()
        if why_not:
            log.warning("shared-memory transport unavailable (%s): frontends use ZeroMQ", why_not)
            return None
        return ShmFrontends(config.run_dir, int(self.engine_id, 16), self.outbound, config.shm_ring_bytes,
                            config.max_shm_peers)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def join(self, timeout: float | None = None) -> None:
        for t in self._threads:
            t.join(timeout)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        self.inbound.close()
        self.outbound.close()
        self._tick_out_pull.close(0)
        for lock in self._locks:  # this engine's socket files and locks, and no one else's
            lock.release()

    def begin_drain(self) -> None:
        """Refuse new submits (SHUTTING_DOWN → HTTP 503); in-flight requests go on."""
        self._draining = True

    @property
    def idle(self) -> bool:
        """Nothing accepted is unfinished (the I/O thread's view)."""
        return not self._live_ids

    @property
    def num_waiting(self) -> int:
        return self._accepted - self._left_pending

    def _count_left_pending(self, req: Request) -> None:
        self._left_pending += 1

    # ------------------------------------------------------------------ I/O thread

    IO_SLICE_S = 0.005
    """Longest the I/O thread works through inbound frames before it looks at its clock
    again (heartbeats, reaping): input, however large, never delays a heartbeat."""

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbound.sock, zmq.POLLIN)
        poller.register(self._tick_out_pull, zmq.POLLIN)
        monitor = self._monitor_disconnects()
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        if self.shm is not None:
            self.shm.register(poller)
        interval = self.config.heartbeat_interval_s
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    self.outbound.publish(BROADCAST_TOPIC, p.EngineHeartbeat(self.engine_id, time.time()))
                    self._sync_topics()
                    self._reap_frontends(now)
                    next_beat = now + interval
                if self._disconnect_check and now >= self._disconnect_check[0]:
                    self._reap_after_disconnect(self._disconnect_check.pop(0) - 3 * interval)
                wake = min([next_beat] + self._disconnect_check[:1])
                events = dict(poller.poll(max(1, int((wake - now) * 1000))))
                if self._tick_out_pull in events:
                    self._forward_tick_frames()
                if monitor is not None and monitor in events:
                    self._on_monitor_event(monitor, interval)
                if self.inbound.sock in events:
                    deadline = time.monotonic() + self.IO_SLICE_S
                    while time.monotonic() < deadline:
                        frame = self.inbound.recv_frame()
                        if frame is None:
                            break
                        self._on_frame(frame)
                if self.shm is not None:  # also with no events: handshake deadlines, peers that failed
                    self.shm.handle(events, time.monotonic() + self.IO_SLICE_S, self._on_frame, self._frontend_gone)
        except Exception as exc:  # the engine cannot serve without its I/O thread
            log.exception("I/O thread failed")
            self.fatal = exc
            self.stop()
        else:  # deliver what the tick thread said last (finishes, failures)
            self._tick_thread.join(timeout=2)
            self._forward_tick_frames()
        finally:
            if monitor is not None:
                self.inbound.sock.disable_monitor()
                monitor.close(0)

    def _sync_topics(self) -> None:
        """An empty StepOutput on every frontend's own topic, each heartbeat: its sequence
        number shows a frontend whose last frames were dropped (a full ring, a PUB queue at
        its high-water mark) the gap, even when those frames were the last its requests
        would ever get."""
        for fid in list(self._frontends):
            self.outbound.publish_frame(topic_for(fid), self._empty_step)

    def _monitor_disconnects(self) -> zmq.Socket | None:
        """A monitor of the inbound socket's disconnections: a frontend whose process
        died closes its connection at once, long before its heartbeats are missed."""
        try:
            return self.inbound.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except (zmq.ZMQError, AttributeError):
            return None

    def _on_monitor_event(self, monitor: zmq.Socket, interval: float) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            # Some peer went away; which one is not said. Every live frontend sends a
            # heartbeat each interval: after three intervals, those not heard since the
            # disconnection are the ones that left.
            self._disconnect_check.append(time.monotonic() + 3 * interval)

    def _frontend_gone(self, frontend_id: str, why: str = "") -> None:
        """A frontend left (its connection closed): abort everything it submitted. Logged as
        a warning unless it said goodbye first (a clean stop)."""
        if why and frontend_id in self._frontends:
            log.warning("frontend %s disconnected (%s): aborting its requests", frontend_id, why)
        elif why:
            log.info("frontend %s closed its connection after its goodbye", frontend_id)
        self._frontends.pop(frontend_id, None)
        self._inbox.put(_FrontendGone(frontend_id))
        self._wake.set()

    def _reap_after_disconnect(self, since: float) -> None:
        for fid, seen in list(self._frontends.items()):
            if seen < since and (self.shm is None or fid not in self.shm.peers):
                log.warning("frontend %s disconnected: aborting its requests", fid)
                self._frontend_gone(fid)

    def _forward_tick_frames(self) -> None:
        while True:
            try:
                topic, payload = self._tick_out_pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.outbound.publish_frame(topic, payload)

    def _on_frame(self, frame: bytes, carrier_frontend: str | None = None) -> None:
        """One inbound frame; ``carrier_frontend``: the frontend whose shared-memory ring it
        came from (it may speak only for itself)."""
        try:
            msg = codec.decode(frame, "engine")
        except codec.DecodeError as exc:
            self._drop(f"bad frame: {exc}")
            return
        if carrier_frontend is not None and msg.frontend_id != carrier_frontend:
            self._drop(f"frontend {carrier_frontend} sent a message for {msg.frontend_id!r}")
            return
        if carrier_frontend is None and self.shm is not None and self.shm.owns(msg.frontend_id):
            self._drop(f"a ZeroMQ message for {msg.frontend_id!r}, a frontend connected over shared memory")
            return
        try:
            self._on_message(msg)
        except Exception as exc:  # a well-formed frame with nonsense inside: drop, keep serving
            self._drop(f"{type(msg).__name__} could not be handled: {exc!r}")

    def _drop(self, why: str) -> None:
        self.bad_frames += 1
        if self.bad_frames <= 100 or self.bad_frames % 1000 == 0:
            log.warning("dropped a message (%d so far): %s", self.bad_frames, why)

    def _on_message(self, msg) -> None:
        """A decoded, well-typed message (``codec.decode(..., "engine")`` checked every field)."""
        self._frontends[msg.frontend_id] = time.monotonic()
        if isinstance(msg, p.Submit):
            self._on_submit(msg)
        elif isinstance(msg, p.Abort):
            self._inbox.put(_Abort(list(msg.request_ids)))
            self._wake.set()
        elif isinstance(msg, p.Hello):
            self.outbound.publish(topic_for(msg.frontend_id), p.Welcome(
                self.engine_id, self.limits.max_model_len, self.scheduler.eos_token_ids,
                self.config.max_queue_size, self.config.heartbeat_interval_s, self.runtime))
        elif isinstance(msg, p.StatsRequest):  # answered by the tick thread, between ticks
            self._inbox.put(msg)
            self._wake.set()
        elif isinstance(msg, p.Goodbye):
            self._frontends.pop(msg.frontend_id, None)
            self._inbox.put(_FrontendGone(msg.frontend_id))
            self._wake.set()
        # p.Heartbeat: hearing from the frontend (above) is all it is for

    def _validate(self, msg: p.Submit) -> p.RejectReason | None:
        """What the decoder cannot know: the vocabulary, combinations of parameters,
        duplicates, the configuration's limits, draining, gate 1."""
        ids = msg.prompt_token_ids
        vocab = self.limits.vocab_size
        if max(ids) >= vocab:
            return p.RejectReason(p.RejectCode.INVALID, f"prompt token ids must be integers in [0, {vocab})",
                                  retryable=False)
        problem = msg.params.validate()
        if problem:
            return p.RejectReason(p.RejectCode.INVALID, problem, retryable=False)
        if msg.request_id in self._live_ids:
            return p.RejectReason(p.RejectCode.INVALID, f"duplicate request id {msg.request_id!r}",
                                  retryable=False)
        reason = never_fits(self.limits, len(ids), msg.params.max_tokens)
        if reason is not None:
            return reason
        if self._draining:
            return p.RejectReason(p.RejectCode.SHUTTING_DOWN, "the engine is shutting down")
        if self.num_waiting >= self.config.max_queue_size:
            return p.RejectReason(p.RejectCode.QUEUE_FULL,
                                  f"the queue is full ({self.config.max_queue_size} requests waiting)",
                                  1, 0)
        return None

    def _on_submit(self, msg: p.Submit) -> None:
        """Validate, then build the engine's request, then count it and ack: nothing is
        counted or acked for a submit that cannot become a request."""
        topic = topic_for(msg.frontend_id)
        reason = self._validate(msg)
        req = None
        if reason is None:
            try:
                req = Request(request_id=msg.request_id, frontend_id=msg.frontend_id,
                              prompt_token_ids=list(msg.prompt_token_ids), params=msg.params,
                              session_id=msg.session_id or "", priority=msg.priority)
            except Exception as exc:  # noqa: BLE001 - refuse, never half-accept
                reason = p.RejectReason(p.RejectCode.INVALID, f"the request could not be built: {exc}",
                                        retryable=False)
        if reason is not None:
            self.stats_window.on_reject(reason.code)
            self.rejected[reason.code.value] = self.rejected.get(reason.code.value, 0) + 1
            self.outbound.publish(topic, p.Ack(msg.request_id, False, reason))
            return
        self._accepted += 1
        self._live_ids.add(msg.request_id)
        self.outbound.publish(topic, p.Ack(msg.request_id, True))
        self._inbox.put(_Submit(req))
        self._wake.set()

    def _reap_frontends(self, now: float) -> None:
        timeout = self.config.frontend_timeout_s
        for fid, seen in list(self._frontends.items()):
            if now - seen > timeout:
                log.warning("frontend %s silent for %.1fs: aborting its requests", fid, now - seen)
                del self._frontends[fid]
                self._inbox.put(_FrontendGone(fid))
                self._wake.set()

    # ------------------------------------------------------------------ tick thread

    def _tick_loop(self) -> None:
        out = self.ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 1000)  # let the I/O thread collect the last frames
        out.connect(TICK_OUT_ADDR + self.engine_id)
        try:
            while not self._stop.is_set():
                with self.backend_lock:
                    self._drain_inbox(out)
                    if self.scheduler.has_work():
                        outputs = self.scheduler.step(stream=lambda early: self._send_outputs(out, early))
                    else:
                        outputs = self.scheduler.drain_outputs()
                self._send_outputs(out, outputs)
                if self.stats_window.due():
                    self._publish_stats(out)
                if not self.scheduler.has_work():
                    self._wake.wait(0.1)
                    self._wake.clear()
        except Exception as exc:
            log.exception("tick failed; failing every request and exiting")
            self.fatal = exc
            self._fail_all(out, f"engine error: {exc}")
            self.stop()
        finally:
            out.close(0)

    def _drain_inbox(self, out: zmq.Socket) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Submit):
                req = item.request
                try:
                    self.scheduler.add_request(req)
                except ValueError as exc:  # acked already: end it with an error, keep serving
                    log.warning("request %s refused after its ack: %s", req.request_id, exc)
                    self._send_outputs(out, [(req.frontend_id, p.RequestOutput(
                        req.request_id, [], p.FinishReason.ERROR, error=str(exc)))])
                    self._left_pending += 1
                    continue
                self.stats_window.on_arrival(req.request_id, req.session_id, req.arrival_time)
            elif isinstance(item, _Abort):
                for rid in item.request_ids:
                    self.scheduler.abort_request(rid)
            elif isinstance(item, _FrontendGone):
                self.scheduler.abort_frontend(item.frontend_id)
            elif isinstance(item, p.StatsRequest):
                out.send_multipart([topic_for(item.frontend_id),
                                    codec.encode(p.Stats(item.nonce, self._stats_data(per_frontend=True)))])

    def _stats_data(self, scheduler_stats: dict | None = None, per_frontend: bool = False) -> dict:
        """``/scheduler/stats``: the scheduler's counters, the engine's, and the last
        published window (rates and latency percentiles, see :mod:`stats_window`). The map
        of every frontend (``per_frontend``) only in an answer to a request: in the broadcast,
        which every frontend gets, it would grow with the square of the frontends."""
        sched = scheduler_stats or self.scheduler.stats()
        rejected = dict(self.rejected)  # before the ack (gate 1, invalid, never fits, draining)
        for code, n in sched.get("rejected_by_code", {}).items():  # at admission (hard-reject)
            rejected[code] = rejected.get(code, 0) + n
        frontends = {"num_frontends": len(self._frontends)}
        if self.shm is not None:
            frontends["shm"] = self.shm.summary()
        if per_frontend:
            carriers = {fid: {"carrier": "zmq"} for fid in list(self._frontends)}
            carriers.update(self.shm.stats() if self.shm is not None else {})
            frontends["frontends"] = carriers
        return dict(sched, num_waiting=self.num_waiting, num_rejected=sum(rejected.values()),
                    rejected_by_code=rejected, bad_frames=self.bad_frames, **frontends,
                    engine_id=self.engine_id, runtime=msgspec.structs.asdict(self.runtime),
                    window=self.stats_window.latest)

    def _publish_stats(self, out: zmq.Socket) -> None:
        """Between ticks, at most every ``stats_interval_s``: one ``Stats`` (nonce 0) on the
        broadcast topic, shared by every frontend and every dashboard behind it."""
        sched = self.scheduler.stats()
        self.stats_window.publish(sched)
        out.send_multipart([BROADCAST_TOPIC, codec.encode(p.Stats(0, self._stats_data(sched)))])

    def _send_outputs(self, sock: zmq.Socket, outputs: list[tuple[str, p.RequestOutput]]) -> None:
        if not outputs:
            return
        self.stats_window.on_outputs(output for _, output in outputs)
        by_frontend: dict[str, list[p.RequestOutput]] = {}
        for fid, output in outputs:
            by_frontend.setdefault(fid, []).append(output)
            if output.finish_reason is not None:
                self._live_ids.discard(output.request_id)
        for fid, items in by_frontend.items():
            sock.send_multipart([topic_for(fid), codec.encode(p.StepOutput(items))])

    def _fail_all(self, sock: zmq.Socket, error: str) -> None:
        outputs = []
        for req in list(self.scheduler._requests.values()):
            outputs.append((req.frontend_id, p.RequestOutput(req.request_id, [], p.FinishReason.ERROR,
                                                              error=error)))
        try:
            self._send_outputs(sock, outputs)
        except Exception:  # best effort on the way down
            pass


def runtime_info(config: cfg.EngineConfig, scheduler: Scheduler, model_dir: str = "") -> p.RuntimeInfo:
    """The engine's :class:`~shared.protocol.RuntimeInfo`, read off what actually runs."""
    backend = scheduler.backend
    dtype = next(backend.model.parameters()).dtype if hasattr(backend, "model") else None
    from engine_proc.model_loader import model_fingerprint

    schemes = sorted({addr.split("://", 1)[0] for addr in (config.resolved_input_addr, config.resolved_output_addr)})
    return p.RuntimeInfo(
        model=str(model_dir or config.model), device=str(backend.device),
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else "unknown",
        torch_threads=backend.threads.max_threads if getattr(backend, "threads", None) else torch.get_num_threads(),
        backend=config.backend,
        prefill_mode=scheduler.prefill_mode.value, policy=config.policy,
        transport=("shm+" if config.transport != "zmq" and config.run_dir else "") + "zmq " + "+".join(schemes),
        model_fingerprint=model_fingerprint(model_dir) if model_dir else "",
        kernels=getattr(getattr(backend, "kernels", None), "name", ""),
        model_runner=getattr(backend, "model_runner", "transformers"),
        single_thread_below=backend.threads.single_thread_below if getattr(backend, "threads", None) else 0,
        kv_block_size=scheduler.block_pool.block_size, kv_num_blocks=scheduler.block_pool.num_blocks)


def configure_torch(config: cfg.EngineConfig) -> None:
    torch.set_num_threads(config.torch_threads or usable_cpus())
    torch.manual_seed(config.seed)


EXIT_CONFIG = startup_faults.EXIT_CONFIG
"""Exit status of an engine that cannot start with its configuration (sysexits'
EX_CONFIG): a missing model, weights that cannot load, a device this build lacks, a model
the backend cannot run, an address another engine holds. The supervisor does not restart it."""


class ConfigurationError(RuntimeError):
    """The engine cannot start with this configuration (see :data:`EXIT_CONFIG`)."""


def device_problems(config: cfg.EngineConfig) -> list[str]:
    """What the configured device and dtype need that this machine or torch build lacks."""
    out = []
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        out.append(f"device {config.device}: this torch build has no CUDA, or no GPU is visible "
                   f"(torch {torch.__version__})")
    if config.device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        out.append("device mps: Apple's Metal backend is not available here")
    return out


def start_engine(config: cfg.EngineConfig) -> "EngineServer":
    """Everything before serving: check the configuration, load the model, build the
    scheduler, bind the sockets. Raises :class:`ConfigurationError` for anything a
    restart would not fix."""
    from engine_proc.kernels import KernelsUnavailable
    from engine_proc.model_loader import ModelNotFound

    problems = config.problems() + device_problems(config)
    if problems:
        raise ConfigurationError("; ".join(problems))
    try:
        configure_torch(config)
        model, model_dir = load_model(config)
        scheduler = build_scheduler(config, model)
        warm_up(scheduler)
        return EngineServer(config, scheduler, runtime_info(config, scheduler, str(model_dir)))
    except (ModelNotFound, startup_faults.StartupFault, NotImplementedError, KernelsUnavailable, AddressInUse) as exc:
        raise ConfigurationError(str(exc)) from None


def warm_up(scheduler: Scheduler) -> None:
    """One short prefill and two decode steps through the backend before any frontend can
    connect: kernels are built and first-call costs paid, so the engine that says hello
    (and makes /health 200) serves its first request at speed."""
    pool, backend, row = scheduler.block_pool, scheduler.backend, "__warm_up__"
    ids = [1] * 8
    pool.allocate(row, [], len(ids) + 2)
    try:
        backend.prefill_chunk(row, ids, 0, True)
        backend.promote(row)
        for step in range(2):
            backend.decode_step_batched([row], [1], [len(ids) + step])
    finally:
        backend.release(row)
        pool.free(row)


def run_engine(config: cfg.EngineConfig) -> int:
    """Load the model, bind the sockets and serve until SIGTERM/SIGINT. Returns the exit
    code: 0 after a clean stop, 1 after an error while serving, :data:`EXIT_CONFIG`
    (logged in one line) when the configuration cannot work."""
    if not config.run_dir and not (config.input_addr and config.output_addr):
        config = cfg.build(type(config), vars(config) | {"run_dir": tempfile.mkdtemp(prefix="tickserve-")})
    try:
        server = start_engine(config)
    except ConfigurationError as exc:
        log.error("engine cannot start: %s", exc)
        return EXIT_CONFIG
    drain_deadline: list[float] = []

    def on_signal(signum, frame):
        if drain_deadline:  # a second signal: stop now
            server.stop()
            return
        log.info("draining: refusing new requests, finishing in-flight ones (at most %.0fs)",
                 config.drain_timeout_s)
        server.begin_drain()
        drain_deadline.append(time.monotonic() + config.drain_timeout_s)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    log.info("engine %s serving %s on %s (%s)", server.engine_id, server.runtime.model,
             config.resolved_input_addr, server.runtime.summary())
    print(f"tickserve engine ready input={config.resolved_input_addr} "
          f"output={config.resolved_output_addr}", flush=True)
    while not server._stop.is_set():
        server._stop.wait(0.1)
        if drain_deadline and (server.idle or time.monotonic() > drain_deadline[0]):
            server.stop()
    server.join(timeout=5)
    server.close()
    log.info("engine %s stopped%s", server.engine_id, f" after an error: {server.fatal!r}" if server.fatal else "")
    return 1 if server.fatal else 0


def main(argv: list[str] | None = None) -> int:
    from shared.cli import process_config

    return run_engine(process_config(cfg.EngineConfig, "tickserve engine", "Run the engine process alone.", argv))


if __name__ == "__main__":
    sys.exit(main())
