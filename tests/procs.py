"""Spawning real engine / frontend processes for tests, with bounded waits and cleanup."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _flags(options: dict) -> list[str]:
    out = []
    for key, value in options.items():
        out += ["--" + key.replace("_", "-"), str(value)]
    return out


@dataclass
class Proc:
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class ProcessGroup:
    """Processes started by one test; ``close`` stops them all (SIGTERM, then SIGKILL)."""

    tmp: Path
    procs: list[Proc] = field(default_factory=list)

    def spawn(self, args: list[str], name: str) -> Proc:
        log = self.tmp / f"{name}-{len(self.procs)}.log"
        fh = open(log, "wb")
        popen = subprocess.Popen([sys.executable, *args], stdout=fh, stderr=subprocess.STDOUT,
                                 env=_env(), cwd=str(REPO), start_new_session=True)
        proc = Proc(popen, log)
        self.procs.append(proc)
        return proc

    def engine(self, model_dir: Path, run_dir: Path, **options) -> Proc:
        opts = {"model": model_dir, "run_dir": run_dir, "device": "cpu", "dtype": "float32", "torch_threads": 1,
                **options}
        return self.spawn(["-m", "engine_proc", *_flags(opts)], "engine")

    def frontend(self, model_dir: Path, run_dir: Path, port: int, **options) -> Proc:
        opts = {"model": model_dir, "run_dir": run_dir, "port": port, "log_level": "warning", **options}
        return self.spawn(["-m", "frontend", *_flags(opts)], "frontend")

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.alive():
                try:
                    os.killpg(proc.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.popen.wait(5)


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout}s (last: {last!r})")


def http_json(url: str, body: dict | None = None, timeout: float = 30.0, headers: dict | None = None
              ) -> tuple[int, dict, dict]:
    """(status, json body, headers) of a GET (no body) or POST."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null"), dict(resp.headers)
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError:
            payload = {"raw": raw.decode(errors="replace")}
        return err.code, payload, dict(err.headers)


def wait_healthy(base: str, timeout: float = 120.0) -> None:
    wait_for(lambda: http_json(f"{base}/health", timeout=2)[0] == 200, timeout, 0.2, f"{base}/health 200")


def stats(base: str) -> dict:
    status, body, _ = http_json(f"{base}/scheduler/stats", timeout=5)
    assert status == 200, body
    return body


def both_carriers():
    """A module-scoped, autouse fixture that runs every test of the module that assigns it
    (``carrier = both_carriers()``) twice: with ``TICKSERVE_TRANSPORT=shm`` and ``=zmq``,
    which the engine (serve shared memory or not) and frontend processes it starts read."""
    import pytest

    @pytest.fixture(scope="module", params=["shm", "zmq"], autouse=True)
    def carrier(request):
        old = os.environ.get("TICKSERVE_TRANSPORT")
        os.environ["TICKSERVE_TRANSPORT"] = request.param
        yield request.param
        if old is None:
            os.environ.pop("TICKSERVE_TRANSPORT", None)
        else:
            os.environ["TICKSERVE_TRANSPORT"] = old

    return carrier


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux ``/proc``); empty once it is gone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except FileNotFoundError:
        return []


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def children_running(serve_pid: int, module: str) -> list[int]:
    """The children of a ``tickserve serve`` that run ``python -m module``."""
    return [c for c in children(serve_pid) if f"-m {module}" in cmdline(c)]


def child_running(serve_pid: int, module: str) -> int | None:
    found = children_running(serve_pid, module)
    return found[0] if found else None


def start_stack(tmp: Path, model_dir: Path, run: Path, frontend_options: dict | None = None,
                **engine_options) -> tuple[ProcessGroup, str]:
    """An engine on ``run`` and one frontend, healthy: ``(group, base URL)``; their logs
    in the assertion if they do not start within 120 s."""
    group = ProcessGroup(tmp)
    group.engine(model_dir, run, **engine_options)
    port = free_port()
    group.frontend(model_dir, run, port, **(frontend_options or {}))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 120)
    except TimeoutError:
        group.close()
        raise AssertionError("stack did not start:\n" + "\n".join(pr.output()[-3000:] for pr in group.procs))
    return group, base


def two_frontends(group: ProcessGroup, model_dir: Path, run: Path, **engine_options) -> tuple[Proc, str, str]:
    """An engine on ``run`` and two frontends on it, both healthy: ``(first frontend,
    its URL, the second's URL)``."""
    group.engine(model_dir, run, **engine_options)
    pa, pb = free_port(), free_port()
    fa = group.frontend(model_dir, run, pa)
    group.frontend(model_dir, run, pb)
    a, b = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    wait_healthy(a)
    wait_healthy(b)
    return fa, a, b


class Witness:
    """While an attack runs: ``/health`` every 50 ms, and short streams back to back through
    the frontend at ``base``. ``summary()`` gives the figures; ``check()`` asserts that the
    engine never noticed: the same engine id before and after (no restart), only 200s, every
    stream complete, every process in ``procs`` alive."""

    def __init__(self, base: str, procs: list[Proc] | tuple = (), max_tokens: int = 24):
        import threading

        self.base, self.procs, self.max_tokens = base, list(procs), max_tokens
        self.engine_id = http_json(f"{base}/health", timeout=10)[1]["engine_id"]
        self.health: list[int] = []
        self.streams: list[bool] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._watch, daemon=True),
                         threading.Thread(target=self._stream, daemon=True)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        wait_for(lambda: self.streams, 60, what="an unrelated stream finished")
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _watch(self):
        while not self._stop.is_set():
            try:
                self.health.append(http_json(f"{self.base}/health", timeout=5)[0])
            except OSError:
                self.health.append(0)
            time.sleep(0.05)

    def _stream(self):
        import httpx

        body = {"prompt": "an unrelated stream", "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        while not self._stop.is_set():
            try:
                with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=60) as resp:
                    lines = [line for line in resp.iter_lines() if line]
                self.streams.append(resp.status_code == 200 and lines[-1] == "data: [DONE]"
                                    and not any('"error"' in line for line in lines))
            except httpx.HTTPError:
                self.streams.append(False)

    def summary(self) -> dict:
        codes: dict[int, int] = {}
        for code in self.health:
            codes[code] = codes.get(code, 0) + 1
        try:
            same = http_json(f"{self.base}/health", timeout=10)[1].get("engine_id") == self.engine_id
        except OSError:
            same = False
        return {"engine_same": same and all(proc.alive() for proc in self.procs), "health_codes": codes,
                "unrelated_streams_completed": f"{sum(self.streams)} of {len(self.streams)}"}

    def check(self) -> None:
        assert all(proc.alive() for proc in self.procs), "\n".join(pr.output()[-2000:] for pr in self.procs)
        assert http_json(f"{self.base}/health", timeout=10)[1]["engine_id"] == self.engine_id  # no restart
        assert self.health and set(self.health) == {200}, sorted(set(self.health))
        assert self.streams and all(self.streams), self.streams
