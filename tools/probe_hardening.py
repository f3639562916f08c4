"""Hostile and careless input against a running engine and frontend, with figures.

Starts an engine (``--policy fair``, a queue of ``--queue`` requests) and a frontend on
the default model in a temporary run directory, then, one probe after another:

1. garbage engine frames: the 7-byte ``[3, "x", [[1]]]`` Abort, a ``StatsRequest``
   without a frontend id, list/dict session ids, and ``--garbage`` random frames (random
   bytes and random msgpack values) — is the engine the same process afterwards, how
   many frames it counted as bad, how long until it serves again;
2. Submits with string/list/NaN/inf priorities — queue slots still free afterwards;
3. 200 Submits of 1M token ids each — the longest gap between engine heartbeats, and
   ``/health`` meanwhile;
4. a lone surrogate sent as raw bytes in every text field — status codes, requests left
   in flight;
5. ``--stalled`` connections that send half a request head — how many are still open
   after the header timeout (+1 s), the frontend's fds before and after;
6. loose JSON types — status codes;
7. ``--sessions`` distinct ``user`` values under the fair policy — sessions the engine
   keeps afterwards, and the size of ``/scheduler/stats``;
8. bad configurations — exit status and lines printed;
9. a second engine on the run directory — its exit status; the first still serves;
10. gate-1 429s and client-disconnect aborts — counted alike in ``/scheduler/stats``
    and ``/metrics``;
11. ``kill -9`` of a frontend holding a stream, over ZeroMQ and over shared memory —
    seconds until the engine frees its row.

With ``--shm``, instead: ``tickserve serve`` on the default model, and the nine
shared-memory findings (``tools/_probe_shm.py``: an overflow marker with no frame, ring
positions near 2^64, ``ftruncate`` of the memfds, silent and trickling handshakes, a live
frontend's id, 500 idle handshakes, torn index loads, frames larger than the socket buffer,
the frontend's aborts, receiver and event loop), each with its figure and the witness's:
the engine the same process, ``/health`` codes, unrelated streams completed.

Prints one JSON document (progress on stderr). Figures, not assertions: the tests in
``tests/test_hardening.py`` and ``tests/test_shm_hostile.py`` assert the same behaviour on
the tiny model.

Usage:
    python tools/probe_hardening.py --out hardening.json
    python tools/probe_hardening.py --shm --out hardening-shm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import msgpack  # noqa: E402
import zmq  # noqa: E402

from shared import codec  # noqa: E402
from shared import protocol as p  # noqa: E402
from tests.procs import ProcessGroup, _env, free_port, stats, wait_for, wait_healthy  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def baseline(s: dict) -> bool:
    return (s["num_active"] == 0 and s["num_pending"] == 0 and s["num_prefilling"] == 0
            and s["active_kv_reserved"] == 0 and s["num_waiting"] == 0)


def wire(msg) -> list:
    return msgpack.unpackb(codec.encode(msg), raw=False, strict_map_key=False)


def serves(base: str) -> bool:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "still here?", "max_tokens": 2}, timeout=60)
    return r.status_code == 200


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def junk(rng: random.Random, depth: int = 0):
    makers = [lambda: None, lambda: True, lambda: rng.randint(-2**63, 2**64 - 1),
              lambda: rng.choice([math.nan, math.inf, 1e308, -0.0]),
              lambda: "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(6))),
              lambda: os.urandom(rng.randrange(6)),
              lambda: [junk(rng, depth + 1) for _ in range(rng.randrange(4))],
              lambda: {rng.randrange(4): junk(rng, depth + 1) for _ in range(rng.randrange(3))}]
    return makers[rng.randrange(8 if depth < 3 else 6)]()


def probe_frames(args, eng, base, push) -> dict:
    submit = wire(p.Submit("g-0", "g-fe", [5, 6], p.SamplingParams(max_tokens=1), "s", 0))
    crafted = [msgpack.packb([3, "x", [[1]]]), msgpack.packb([3, "x", [{"a": 1}]]),
               msgpack.packb([6, None, 1])]
    for bad_session in ([1], {"a": 1}):
        values = list(submit)
        values[5] = bad_session
        crafted.append(msgpack.packb(values))
    rng = random.Random(0)
    frames = crafted + [os.urandom(rng.randrange(1, 64)) if i % 2 else
                        msgpack.packb([rng.randrange(12)] + [junk(rng) for _ in range(rng.randrange(7))])
                        for i in range(args.garbage)]
    before = stats(base)["bad_frames"]
    for f in frames:
        push.send(f)
    t0 = time.monotonic()
    wait_for(lambda: stats(base)["bad_frames"] - before >= len(frames) * 0.99, 60, what="frames counted")
    ok = serves(base)
    return {"frames_sent": len(frames), "engine_same_process": eng.alive(),
            "bad_frames_counted": stats(base)["bad_frames"] - before, "serves_after": ok,
            "s_until_counted_and_served": round(time.monotonic() - t0, 2)}


def probe_priorities(args, base, push) -> dict:
    for bad in ["high", [1], math.nan, math.inf]:
        values = wire(p.Submit(f"prio-{bad!r}", "g-fe", [5, 6], p.SamplingParams(max_tokens=1), "s", 0))
        values[6] = bad
        push.send(msgpack.packb(values))
    time.sleep(0.5)
    s = stats(base)
    codes = [httpx.post(f"{base}/v1/completions", json={"prompt": "slot", "max_tokens": 1}, timeout=60).status_code
             for _ in range(args.queue + 2)]
    return {"num_waiting_after": s["num_waiting"], "later_requests": codes}


def probe_big_frames(run: Path, base: str, push) -> dict:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, p.BROADCAST_TOPIC)
    sub.connect(f"ipc://{run}/output.sock")
    beats: list[float] = []
    health: list[int] = []
    stop = threading.Event()

    def listen():
        while not stop.is_set():
            if sub.poll(50):
                _, _, payload = sub.recv_multipart()
                if isinstance(codec.decode(payload), p.EngineHeartbeat):
                    beats.append(time.monotonic())

    def watch():
        while not stop.is_set():
            health.append(httpx.get(f"{base}/health", timeout=5).status_code)
            time.sleep(0.1)

    threads = [threading.Thread(target=listen, daemon=True), threading.Thread(target=watch, daemon=True)]
    for t in threads:
        t.start()
    time.sleep(0.6)
    frame = codec.encode(p.Submit("big", "big-fe", [7] * 1_000_000, p.SamplingParams(max_tokens=1), None, 0))
    start = time.monotonic()
    for _ in range(200):
        push.send(frame)
    time.sleep(5)
    stop.set()
    for t in threads:
        t.join(5)
    sub.close(0)
    during = [b for b in beats if b >= start]
    gaps = [b - a for a, b in zip(during, during[1:])]
    return {"frames": 200, "frame_bytes": len(frame), "max_heartbeat_gap_s": round(max(gaps, default=float("nan")), 3),
            "health_codes": sorted(set(health)), "serves_after": serves(base)}


SURROGATE = [("/v1/completions", b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}'),
             ("/v1/completions", b'{"prompt": ["ok", "a\xed\xa0\x80"], "max_tokens": 2}'),
             ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}], "max_tokens": 2}'),
             ("/v1/completions", b'{"prompt": "a", "stop": ["\xed\xa0\x80"], "max_tokens": 2}'),
             ("/v1/completions", b'{"prompt": "a", "user": "\xed\xa0\x80", "max_tokens": 2}'),
             ("/tokenize", b'{"prompt": "\xed\xa0\x80"}')]
LOOSE = [{"prompt": "a", "stream": "yes"}, {"prompt": ["1"], "max_tokens": 1}, {"prompt": [True], "max_tokens": 1},
         {"prompt": "a", "max_tokens": True}]


def probe_http(base: str) -> dict:
    codes = [httpx.post(f"{base}{path}", content=body, headers={"content-type": "application/json"},
                        timeout=30).status_code for path, body in SURROGATE]
    loose = [httpx.post(f"{base}/v1/completions", json=b, timeout=30).status_code for b in LOOSE]
    digits = httpx.post(f"{base}/v1/completions", json={"prompt": ["1"], "max_tokens": 1}, timeout=30)
    return {"surrogate_codes": codes, "in_flight_after": stats(base)["frontend"]["in_flight"],
            "loose_type_codes": loose, "digit_string_list_is_text": digits.status_code == 200}


def probe_stalled(args, fe, base: str, header_timeout: float) -> dict:
    port = int(base.rsplit(":", 1)[1])
    before = fds(fe.popen.pid)
    stalled = []
    for _ in range(args.stalled):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        stalled.append(s)
    peak = fds(fe.popen.pid)
    time.sleep(header_timeout + 1)
    still_open = 0
    for s in stalled:
        s.setblocking(False)
        try:
            still_open += s.recv(10) != b""
        except BlockingIOError:
            still_open += 1
        s.close()
    return {"connections": args.stalled, "open_after_deadline_plus_1s": still_open,
            "frontend_fds_before": before, "during": peak, "after": fds(fe.popen.pid)}


def probe_sessions(args, base: str) -> dict:
    async def go():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            sem = asyncio.Semaphore(64)

            async def one(i):
                async with sem:
                    for _ in range(20):
                        r = await client.post(f"{base}/v1/completions",
                                              json={"prompt": "hi", "max_tokens": 1, "user": f"user-{i}"})
                        if r.status_code != 429:
                            return r.status_code
                        await asyncio.sleep(0.05)
                    return 429

            return await asyncio.gather(*(one(i) for i in range(args.sessions)))

    codes = asyncio.run(go())
    wait_for(lambda: baseline(stats(base)), 60)
    httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 1, "user": "last"}, timeout=60)
    body = httpx.get(f"{base}/scheduler/stats", timeout=10)
    return {"sessions_sent": args.sessions, "served": codes.count(200),
            "sessions_kept": body.json().get("num_sessions"),
            "stats_bytes": len(body.content)}


def cli(*argv: str, timeout: float = 120) -> tuple[int, int, float]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "shared.cli", *argv], env=_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    return done.returncode, len([x for x in done.stderr.splitlines() if x.strip()]), round(time.monotonic() - t0, 1)


def probe_configs() -> dict:
    cases = {"--prefill-mode disaggregated": ["--prefill-mode", "disaggregated"], "--dtype int8": ["--dtype", "int8"],
             "--log-level loud": ["--log-level", "loud"], "--port 99999": ["--port", "99999"],
             "--model /nonexistent": ["--model", "/nonexistent"], "--prefix-caching maybe": ["--prefix-caching", "maybe"]}
    import torch
    if not torch.cuda.is_available():
        cases["--device cuda"] = ["--device", "cuda"]
    out = {}
    for name, argv in cases.items():
        code, lines, secs = cli("serve", *(argv if "--port" in argv else ["--port", str(free_port()), *argv]))
        out[name] = {"exit": code, "lines": lines, "s": secs}
    return out


def probe_second_engine(group, run: Path, base: str) -> dict:
    second = group.spawn(["-m", "engine_proc", "--run-dir", str(run)], "second-engine")
    code = second.popen.wait(120)
    return {"second_engine_exit": code, "first_serves": serves(base)}


def probe_counters(args, base: str) -> dict:
    def metric(prefix):
        text = httpx.get(f"{base}/metrics", timeout=10).text
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(prefix))

    rejected, aborted = "tickserve_requests_rejected_total", 'tickserve_requests_finished_total{finish_reason="abort"}'
    before, rejected0, aborted0 = stats(base), metric(rejected), metric(aborted)
    held = [httpx.stream("POST", f"{base}/v1/completions", json={"prompt": f"hold {i}", "max_tokens": 1500,
                                                                   "ignore_eos": True, "stream": True}, timeout=60)
            for i in range(args.queue + 16)]  # more than the batch (8) and the queue hold
    codes = [h.__enter__().status_code for h in held]
    for h in held:
        h.__exit__(None, None, None)
    wait_for(lambda: baseline(stats(base)), 60)
    after = stats(base)
    return {"429s_sent": codes.count(429), "num_rejected_delta": after["num_rejected"] - before["num_rejected"],
            "metrics_rejected_delta": metric(rejected) - rejected0, "disconnects": codes.count(200),
            "metrics_finished_abort_delta": metric(aborted) - aborted0}


def probe_frontend_kill(group, run: Path, model: str, witness: str) -> dict:
    out = {}
    for transport in ("zmq", "shm"):
        port = free_port()
        fe = group.frontend(model, run, port, transport=transport)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        stream = httpx.stream("POST", f"{base}/v1/completions", json={"prompt": "long", "max_tokens": 1800,
                                                                       "ignore_eos": True, "stream": True}, timeout=60)
        stream.__enter__()
        wait_for(lambda: stats(witness)["num_active"] == 1, 20)
        t0 = time.monotonic()
        fe.popen.send_signal(signal.SIGKILL)
        wait_for(lambda: baseline(stats(witness)), 20, 0.02)
        out[transport] = round(time.monotonic() - t0, 3)
        try:
            stream.__exit__(None, None, None)
        except httpx.HTTPError:
            pass
    return {"s_until_row_freed": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model directory or .gguf; empty → the embedded SmolLM2")
    ap.add_argument("--queue", type=int, default=4, help="the engine's --max-queue-size")
    ap.add_argument("--garbage", type=int, default=10_000)
    ap.add_argument("--stalled", type=int, default=3_000)
    ap.add_argument("--sessions", type=int, default=5_000)
    ap.add_argument("--shm", action="store_true", help="the shared-memory findings against tickserve serve instead")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not args.model:
        from shared.models import resolve_model
        args.model = str(resolve_model(""))
    if args.shm:
        return report(probe_shm(args), args.out)
    tmp = Path(tempfile.mkdtemp(prefix="probe-"))
    run = Path(tempfile.mkdtemp(prefix="ts-probe-", dir="/tmp"))
    group = ProcessGroup(tmp)
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    header_timeout = 2.0
    result: dict = {"probe": "hardening", "model": args.model}
    try:
        eng = group.spawn(["-m", "engine_proc", "--model", args.model, "--run-dir", str(run), "--policy", "fair",
                           "--max-queue-size", str(args.queue), "--max-batch-size", "8"], "engine")
        port = free_port()
        fe = group.frontend(args.model, run, port, transport="zmq", header_timeout_s=header_timeout,
                            max_connections_per_client=args.stalled + 100)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, 300)
        push.connect(f"ipc://{run}/input.sock")
        steps = [("1_garbage_frames", lambda: probe_frames(args, eng, base, push)),
                 ("2_bad_priorities", lambda: probe_priorities(args, base, push)),
                 ("3_big_frames", lambda: probe_big_frames(run, base, push)),
                 ("4_6_http_bodies", lambda: probe_http(base)),
                 ("5_stalled_connections", lambda: probe_stalled(args, fe, base, header_timeout)),
                 ("7_sessions", lambda: probe_sessions(args, base)),
                 ("8_bad_configurations", probe_configs),
                 ("9_second_engine", lambda: probe_second_engine(group, run, base)),
                 ("10_counters", lambda: probe_counters(args, base)),
                 ("11_frontend_kill", lambda: probe_frontend_kill(group, run, args.model, base))]
        for name, step in steps:
            log(name)
            result[name] = step()
            log(f"{name}: {json.dumps(result[name])}")
        result["engine_same_process_at_end"] = eng.alive()
    finally:
        push.close(0)
        group.close()
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return report(result, args.out)


def probe_shm(args) -> dict:
    """``tickserve serve`` (one engine, the default shared-memory carrier) and the nine
    shared-memory findings against it."""
    from tests.procs import child_running
    from tools import _probe_shm

    tmp = Path(tempfile.mkdtemp(prefix="probe-"))
    run = Path(tempfile.mkdtemp(prefix="ts-probe-", dir="/tmp"))
    group = ProcessGroup(tmp)
    try:
        port = free_port()
        serve = group.spawn(["-m", "shared.cli", "serve", "--model", args.model, "--port", str(port),
                             "--run-dir", str(run), "--data-parallel-size", "1"], "serve")
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, 300)
        result = {"probe": "hardening-shm", "model": args.model,
                  **_probe_shm.run_all(run, base, serve, lambda: child_running(serve.popen.pid, "engine_proc"))}
    finally:
        group.close()
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def report(result: dict, out: str | None) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
