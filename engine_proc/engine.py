"""The engine process: an I/O thread and a tick thread around one scheduler.

I/O thread (never takes the backend lock; :mod:`engine_proc.io_loop`)
    PULL: decode frames (bad ones are counted, logged, dropped), validate submits,
    gate 1 (queue capacity) and the configuration-only hard rejects, publish the
    ack, then hand the request to the tick thread through an in-process queue.
    PUB: acks, welcomes, stats, heartbeats, and every frame the tick thread
    produced (forwarded from an inproc socket, so only this thread touches PUB).
    Tracks frontend heartbeats and aborts the requests of a silent frontend.

Tick thread (holds the backend lock for the whole tick; :mod:`engine_proc.tick_loop`)
    drain the inbox (submits, aborts, departed frontends, stats requests) →
    ``scheduler.step()`` → encode one ``StepOutput`` per frontend.

Building the engine is :mod:`engine_proc.factory`; what it runs, :mod:`engine_proc.runtime_info`;
the links of a prefill or decode engine (``PREFILL_MODE=disaggregated``), :mod:`engine_proc.handover_link`.
This module wires the two threads to their sockets and runs the process: start-up
(configuration problems exit with :data:`EXIT_CONFIG`), signals, the drain.
"""

from __future__ import annotations

import logging
import queue
import signal
import sys
import tempfile
import threading
import time
import uuid

import torch
import zmq

from engine_proc.factory import build_scheduler, configure_torch, load_model, warm_up
from engine_proc.gates import capacity_problems
from engine_proc.handover_link import HandoverLink
from engine_proc.io_loop import IOLoop
from engine_proc.request import Request
from engine_proc.runtime_info import runtime_info
from engine_proc.scheduler import Scheduler
from engine_proc.stats_window import StatsWindow
from engine_proc.tick_loop import TICK_OUT_ADDR, TickLoop
from shared import codec, config as cfg, startup_faults
from shared import protocol as p
from shared.transport import AddressInUse, AddressLock, EngineInbound, EngineOutbound, Inbound, RoutedOutbound

log = logging.getLogger("tickserve.engine")


class EngineServer(IOLoop, TickLoop, HandoverLink):
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
        scheduler.on_left_pending = self._count_left_pending
        scheduler.on_grammar_ready = self._wake.set  # a compile finished: tick now, not in 0.1 s
        self._tick_thread = threading.Thread(target=self._tick_loop, name="engine-tick", daemon=True)
        self._ticks_done = threading.Event()  # the tick loop ended, on whichever thread ran it (run_ticks)
        self._threads = [threading.Thread(target=self._io_loop, name="engine-io", daemon=True),
                         self._tick_thread]
        self._init_handover_link()  # disaggregated roles: engine_proc/handover_link.py

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

    def start(self, tick_thread: bool = True) -> None:
        """Start the I/O thread and, with ``tick_thread``, the tick thread; without it the
        caller then runs the ticks itself (:meth:`run_ticks`)."""
        for t in self._threads:
            if tick_thread or t is not self._tick_thread:
                t.start()

    def run_ticks(self) -> None:
        """The tick loop on the calling thread, until :meth:`stop`. ``run_engine`` runs it on
        the main thread, the one that loaded the model and warmed up: every forward pass then
        starts its OpenMP threads from one thread. A second thread doing so gives libgomp more
        threads to manage than the CPUs it may use, and it then throttles its spin-waits, so
        every parallel region of a pass sleeps and wakes its threads (a one-row decode step
        on two threads measured 22 ms so against 10 ms from one thread)."""
        self._tick_loop()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def join(self, timeout: float | None = None) -> None:
        for t in self._threads:
            if t.ident is not None:  # started
                t.join(timeout)

    def close(self) -> None:
        prefaulter = getattr(self.scheduler.backend, "kv_prefaulter", None)
        if prefaulter is not None:
            prefaulter.stop()
        if self.shm is not None:
            self.shm.close()
        self.inbound.close()
        self.outbound.close()
        self._tick_out_pull.close(0)
        self._close_handover_link()
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

    def wait_stopped(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for :meth:`stop`; whether it has been called."""
        return self._stop.wait(timeout)


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
    from shared.models import ModelNotFound

    problems = config.problems() + device_problems(config)
    if problems:
        raise ConfigurationError("; ".join(problems))
    try:
        configure_torch(config)
        model, model_dir = load_model(config)
        scheduler = build_scheduler(config, model)
        problems = capacity_problems(config, scheduler.limits.max_model_len,
                                     None if config.kv_num_blocks else scheduler.limits.num_blocks)
        if problems:
            raise ConfigurationError("; ".join(problems))
        warm_up(scheduler)
        return EngineServer(config, scheduler, runtime_info(config, scheduler, str(model_dir)))
    except (ModelNotFound, startup_faults.StartupFault, NotImplementedError, KernelsUnavailable, AddressInUse) as exc:
        raise ConfigurationError(str(exc)) from None


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
        if server.idle:  # nothing to finish: stop now, not at the next poll
            server.stop()

    def watch_drain() -> None:
        while not server.wait_stopped(0.1):
            if drain_deadline and (server.idle or time.monotonic() > drain_deadline[0]):
                server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start(tick_thread=False)
    log.info("engine %s serving %s on %s (%s)", server.engine_id, server.runtime.model,
             config.resolved_input_addr, server.runtime.summary())
    print(f"tickserve engine ready input={config.resolved_input_addr} "
          f"output={config.resolved_output_addr}", flush=True)
    threading.Thread(target=watch_drain, name="engine-drain", daemon=True).start()
    server.run_ticks()  # on this thread: see EngineServer.run_ticks
    server.join(timeout=5)
    server.close()
    log.info("engine %s stopped%s", server.engine_id, f" after an error: {server.fatal!r}" if server.fatal else "")
    return 1 if server.fatal else 0


def main(argv: list[str] | None = None) -> int:
    from shared.process_config import process_config

    return run_engine(process_config(cfg.EngineConfig, "tickserve engine", "Run the engine process alone.", argv))


if __name__ == "__main__":
    sys.exit(main())
