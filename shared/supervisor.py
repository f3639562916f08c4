"""``tickserve serve``'s supervisor: M engines and N frontends as child processes, each
restarted when it dies, on one HTTP port.

The supervisor binds the HTTP port itself and every frontend inherits the listening
socket (``--http-fd``): the N frontends accept from one queue, so ``kill -9`` of one
fails only the streams it held — the port keeps answering, and the connections queued
meanwhile are served by the others (or by its successor). Each child:

* is restarted with exponential backoff (0.5 s doubling to 10 s, back to 0.5 s after a
  stable minute);
* runs in its own session (a terminal's Ctrl-C reaches only the supervisor, which stops
  the children once, in order) and gets SIGTERM from the kernel if the supervisor dies;
* is not restarted when it exits with a configuration status (78 for files or settings
  that cannot work, 2 for refused flags or a refused engine: a restart cannot fix what
  it reported, :mod:`shared.startup_faults`): the supervisor stops and exits with that
  status. Any other exit (a crash, memory that ran out) is restarted.

Data parallel (M > 1): engine ``i`` runs in ``<run_dir>/engine-i`` on its share of the
CPUs (pinned there, ``torch_threads`` split), with ``1/M`` of the KV memory cap; every
frontend connects to all of them and routes (``frontend/router.py``). Frontends share
their Prometheus counters through prometheus-client's multiprocess mode (a directory
in the run directory, made fresh and marked: :mod:`shared.marked_dirs`), so a scrape of
any one reports the totals of all.

On SIGTERM/SIGINT: frontends first (they drain), then engines; the metrics directory
goes (it is marked as tickserve's), and the run directory if the supervisor made it.
Nothing else in a ``--run-dir`` of the user's is touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from shared import config as cfg
from shared.marked_dirs import remove_marked
from shared.placement import cpu_share
from shared.ready_line import announce_when_ready
from shared.startup_faults import EXIT_CONFIG

log = logging.getLogger("tickserve.serve")

REFUSED = 2  # a process that refuses its flags, or a frontend its engine's model
FATAL_CODES = (EXIT_CONFIG, REFUSED)  # statuses a restart cannot change


@dataclass
class Child:
    name: str  # "engine 0", "frontend 1"
    module: str  # "engine_proc" | "frontend"
    config: Any
    pass_fds: tuple[int, ...] = ()
    cpus: list[int] | None = None
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    started: float = 0.0
    backoff: float = 0.5
    restart_at: float | None = None
    restarts: int = 0


class Supervisor:
    def __init__(self, engines: list[cfg.EngineConfig], frontends: list[cfg.FrontendConfig],
                 http_sock: socket.socket | None, run_dir: str, own_run_dir: bool, metrics_dir: str | None = None,
                 announce: tuple[str, int] | None = None):
        """``announce``: ``(host, port)`` to print the ready line for (:mod:`shared.ready_line`)
        once every engine is warm, or ``None``."""
        self.run_dir, self.own_run_dir, self.metrics_dir = run_dir, own_run_dir, metrics_dir
        self.announce = announce
        self.http_sock = http_sock
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        # engines split the CPUs; those that lend idle cores to each other (core_board) pin only their own thread
        self.engines = [Child(f"engine {i}", "engine_proc", c,
                              cpus=cpu_share(cpus, i, len(engines)) if len(engines) > 1 and cpus and not c.core_board
                              else None)
                        for i, c in enumerate(engines)]
        env = {"PROMETHEUS_MULTIPROC_DIR": metrics_dir} if metrics_dir else {}
        fds = (http_sock.fileno(),) if http_sock is not None else ()
        self.frontends = [Child(f"frontend {i}", "frontend", c, pass_fds=fds, env=env)
                          for i, c in enumerate(frontends)]
        self.stopping = False
        self.exit_code = 0

    @property
    def children(self) -> list[Child]:
        return self.engines + self.frontends

    def _spawn(self, child: Child) -> None:
        cpus = child.cpus

        def preexec() -> None:  # in the child, before exec
            _die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)

        child.proc = subprocess.Popen([sys.executable, "-m", child.module, *cfg.to_argv(child.config)],
                                      start_new_session=True, preexec_fn=preexec, pass_fds=child.pass_fds,
                                      env={**os.environ, **child.env})
        child.started = time.monotonic()
        child.restart_at = None
        log.info("%s started (pid %d%s)", child.name, child.proc.pid, f", cpus {cpus}" if cpus else "")

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for child in self.children:
            self._spawn(child)
        if self.announce is not None and self.frontends:
            threading.Thread(target=announce_when_ready, args=(*self.announce, len(self.engines), lambda: self.stopping),
                             name="ready-line", daemon=True).start()
        while not self.stopping:
            time.sleep(0.1)
            now = time.monotonic()
            for child in self.children:
                if self.stopping or child.proc is None or child.proc.poll() is None:
                    continue
                if child.restart_at is None:
                    self._exited(child, now)
                elif now >= child.restart_at:
                    child.restarts += 1
                    self._spawn(child)
        self.shutdown()
        return self.exit_code

    def _exited(self, child: Child, now: float) -> None:
        code = child.proc.returncode
        if code in FATAL_CODES:
            log.error("%s cannot run with this configuration (exit %d); shutting down", child.name, code)
            self.exit_code = code
            self.stopping = True
            return
        if now - child.started > 60:
            child.backoff = 0.5
        log.error("%s exited with %s; restarting in %.1fs", child.name, code, child.backoff)
        child.restart_at = now + child.backoff
        child.backoff = min(child.backoff * 2, 10.0)

    def _on_signal(self, signum, frame) -> None:
        if self.stopping:  # a second Ctrl-C: pass it on, the children stop at once
            for child in self.children:
                if child.proc is not None and child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
        self.stopping = True

    def shutdown(self) -> None:
        drain = max((c.config.drain_timeout_s for c in self.frontends), default=0)
        for group, timeout in ((self.frontends, drain + 5), (self.engines, 10)):
            live = [c for c in group if c.proc is not None and c.proc.poll() is None]
            for child in live:
                child.proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            deadline = started + timeout
            for child in live:
                try:
                    child.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait(5)
                log.debug("%s stopped %.2f s after its SIGTERM", child.name, time.monotonic() - started)
        if self.http_sock is not None:
            self.http_sock.close()
        if self.metrics_dir:
            remove_marked(self.metrics_dir)
        if self.own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The HTTP socket every frontend inherits. Raises ``OSError`` when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the parent dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
