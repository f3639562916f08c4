"""Hostile and careless input at every boundary: engine frames (every field of every
message type mutated), queue-slot leaks, frames big enough to starve heartbeats, HTTP
bodies (raw surrogates, loose types), stalled and piled-up connections, per-session
state, bad configurations, a second engine on one run directory, counters that must
agree, and how fast a dead frontend is noticed. Real processes on the tiny model."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import codec
from shared import protocol as p
from tests.procs import REPO, ProcessGroup, _env, free_port, http_json, stats, two_frontends, wait_for, wait_healthy


def _baseline(s: dict) -> bool:
    return (s["num_active"] == 0 and s["num_pending"] == 0 and s["num_prefilling"] == 0
            and s["active_kv_reserved"] == 0 and s["blocks"]["num_used_blocks"] == 0 and s["num_waiting"] == 0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    """Engine (queue of 4, fair policy) + frontend, and a raw PUSH socket onto the engine."""
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    group = ProcessGroup(tmp_path_factory.mktemp("hard"))
    group.engine(tiny_model_dir, run, max_queue_size=4, max_batch_size=4, policy="fair")
    port = free_port()
    group.frontend(tiny_model_dir, run, port, header_timeout_s=1.0, max_connections_per_client=40)
    base = f"http://127.0.0.1:{port}"
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(f"ipc://{run}/input.sock")
    try:
        wait_healthy(base, 120)
        yield group, run, base, push
    finally:
        push.close(0)
        ctx.term()
        group.close()
        shutil.rmtree(run, ignore_errors=True)


def _alive(group, base) -> None:
    assert all(proc.alive() for proc in group.procs), "\n".join(pr.output()[-2000:] for pr in group.procs)
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "still here?", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------- engine frames

VALID = {
    p.Hello: p.Hello("fuzz-fe"),
    p.Submit: p.Submit("fuzz-0", "fuzz-fe", [5, 6, 7], p.SamplingParams(max_tokens=2), "s", 0),
    p.Abort: p.Abort("fuzz-fe", ["fuzz-0"]),
    p.Heartbeat: p.Heartbeat("fuzz-fe"),
    p.Goodbye: p.Goodbye("fuzz-fe"),
    p.StatsRequest: p.StatsRequest("fuzz-fe", 1),
}
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.integers(0, 5) | st.text(max_size=3), inner,
                                                                max_size=3),
    max_leaves=8)


def _wire(msg) -> list:
    return msgpack.unpackb(codec.encode(msg), raw=False, strict_map_key=False)


@st.composite
def mutated_frames(draw):
    """A valid engine-bound message with one field (or one sampling parameter) replaced
    by junk, or the frame cut short or grown."""
    cls = draw(st.sampled_from(sorted(VALID, key=lambda c: c.__name__)))
    values = _wire(VALID[cls])
    where = draw(st.integers(1, len(values) - 1))
    kind = draw(st.sampled_from(["replace", "replace", "replace", "param", "truncate", "extend"]))
    if kind == "param" and cls is p.Submit:
        params = list(values[4])
        params[draw(st.integers(0, len(params) - 1))] = draw(JUNK)
        values[4] = params
    elif kind == "truncate":
        values = values[:where]
    elif kind == "extend":
        values = values + [draw(JUNK)]
    else:
        values[where] = draw(JUNK)
    return msgpack.packb(values, use_bin_type=True)


def test_every_field_of_every_message_mutated_leaves_the_engine_serving_at_baseline(stack):
    """~800 frames, each a real message with one field broken: the engine survives, no
    queue slot leaks (the queue is only 4 deep), and it returns to baseline."""
    group, run, base, push = stack
    before = stats(base)["bad_frames"]
    sent: list[bytes] = []

    @settings(max_examples=800, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(mutated_frames())
    def send(frame):
        sent.append(frame)
        push.send(frame)

    send()
    # the frames that still decode are real requests or aborts; let them finish
    wait_for(lambda: _baseline(stats(base)), 60, what="baseline after the mutated frames")
    bad = sum(1 for f in sent if _undecodable(f))
    assert stats(base)["bad_frames"] - before >= bad * 0.9  # counted (a few may still be in flight)
    _alive(group, base)
    for _ in range(6):  # the queue still has all its 4 slots
        status, body, _ = http_json(f"{base}/v1/completions", {"prompt": "slot", "max_tokens": 1})
        assert status == 200, body


def _undecodable(frame: bytes) -> bool:
    try:
        codec.decode(frame, "engine")
    except codec.DecodeError:
        return True
    return False


def test_submits_with_broken_priorities_take_no_queue_slot(stack):
    """Finding 2: priorities that are strings, lists, NaN or inf were acked, then
    dropped, and leaked a gate-1 slot each. Now they are not messages at all."""
    group, run, base, push = stack
    for bad in ["high", [1], float("nan"), float("inf"), 2**40, True]:
        values = _wire(VALID[p.Submit])
        values[1] = f"prio-{bad!r}"
        values[6] = bad
        push.send(msgpack.packb(values))
    time.sleep(0.5)
    s = stats(base)
    assert s["num_waiting"] == 0 and s["num_pending"] == 0
    for _ in range(6):
        status, body, _ = http_json(f"{base}/v1/completions", {"prompt": "after", "max_tokens": 1})
        assert status == 200, body


def test_big_frames_never_delay_the_engines_heartbeats(stack):
    """Finding 3: 200 Submits of 1M token ids each (valid frames, refused for their
    length) kept the I/O thread busy for over a second without a heartbeat. Now its
    work per poll is bounded by time: the gap between heartbeats stays under the
    frontend's 1 s engine timeout, and a stream running meanwhile is not failed."""
    group, run, base, push = stack
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, p.BROADCAST_TOPIC)
    sub.connect(f"ipc://{run}/output.sock")
    beats: list[float] = []
    stop = threading.Event()

    def listen():
        while not stop.is_set():
            if sub.poll(50):
                topic, _, payload = sub.recv_multipart()
                if isinstance(codec.decode(payload), p.EngineHeartbeat):
                    beats.append(time.monotonic())

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    time.sleep(0.6)
    big = p.Submit("big", "big-fe", [7] * 1_000_000, p.SamplingParams(max_tokens=1), None, 0)
    frame = codec.encode(big)
    assert len(frame) > 1_000_000
    stream = httpx.post(f"{base}/v1/completions", json={"prompt": "meanwhile", "max_tokens": 60,
                                                        "ignore_eos": True}, timeout=60)
    start = time.monotonic()
    for i in range(200):
        push.send(frame)
    wait_for(lambda: time.monotonic() - start > 4, 10)
    stop.set()
    listener.join(2)
    sub.close(0)
    during = [b for b in beats if b >= start]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert during and max(gaps, default=0) < 0.9, gaps
    assert stream.status_code == 200 and stream.json()["usage"]["completion_tokens"] == 60
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    _alive(group, base)


# ---------------------------------------------------------------- HTTP bodies


def _raw_post(base: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{base}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize("path,template", [
    ("/v1/completions", b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": ["ok", "a\xed\xa0\x80"], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "ok", "stop": ["\xed\xa0\x80"], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "ok", "user": "\xed\xa0\x80", "max_tokens": 2}'),
    ("/tokenize", b'{"prompt": "\xed\xa0\x80"}'),
])
def test_raw_lone_surrogates_are_a_400_and_leave_nothing_in_flight(stack, path, template):
    """Finding 4: a lone surrogate sent as raw UTF-8-style bytes was an HTTP 500 (and,
    in ``user``, leaked an in-flight entry)."""
    group, run, base, push = stack
    r = _raw_post(base, path, template)
    assert r.status_code == 400, r.text
    assert "UTF-8" in r.json()["error"]["message"]
    s = httpx.get(f"{base}/scheduler/stats", timeout=10).json()
    assert s["frontend"]["in_flight"] == 0


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": [True], "max_tokens": 2}, "prompt"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "user": "u" * 300}, "user"),
    ({"prompt": "x", "priority": 2**40}, "priority"),
])
def test_loose_types_are_refused(stack, body, param):
    """Finding 6: OpenAI's schema is strict; so is this server."""
    group, run, base, push = stack
    status, payload, _ = http_json(f"{base}/v1/completions", body)
    assert status == 400, payload
    assert payload["error"]["param"] == param


def test_a_list_of_digit_strings_is_text_not_token_ids(stack):
    """``["1"]`` is a list of one text prompt (OpenAI's schema), never token id 1."""
    group, run, base, push = stack
    status, payload, _ = http_json(f"{base}/v1/completions", {"prompt": ["1"], "echo": True, "max_tokens": 1})
    assert status == 200, payload
    assert payload["choices"][0]["text"].startswith("1")
    tokenized = http_json(f"{base}/tokenize", {"prompt": "1"})[1]["tokens"]
    assert payload["usage"]["prompt_tokens"] == len(tokenized)


def test_stalled_connections_are_closed_and_one_address_cannot_hoard_connections(stack):
    """Finding 5: connections that send half a request head stayed open for good. The
    header deadline (1 s here) closes them; past the per-address cap (40 here) a new
    connection gets an OpenAI-shaped 429 and is closed."""
    group, run, base, push = stack
    port = int(base.rsplit(":", 1)[1])
    stalled = []
    for _ in range(30):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        stalled.append(s)
    extra = []
    for _ in range(10):
        extra.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    over = socket.create_connection(("127.0.0.1", port), timeout=5)
    answer = over.recv(4096)
    assert answer.startswith(b"HTTP/1.1 429") and b"too_many_connections" in answer
    over.close()
    for s in extra:
        s.close()
    deadline = time.monotonic() + 5
    for s in stalled:  # all closed by the server, within the deadline plus scheduling slack
        s.settimeout(max(0.1, deadline - time.monotonic()))
        assert s.recv(10) == b""
        s.close()
    _alive(group, base)


# ---------------------------------------------------------------- counters


def test_counters_agree_between_stats_and_metrics(stack):
    """Finding 10: 429s from gate 1 were missing from num_rejected; client-disconnect
    aborts were missing from tickserve_requests_finished_total."""
    group, run, base, push = stack
    before = stats(base)
    held = [httpx.stream("POST", f"{base}/v1/completions", json={"prompt": f"hold {i}", "max_tokens": 1500,
                                                                   "ignore_eos": True, "stream": True}, timeout=60)
            for i in range(12)]
    responses = [h.__enter__() for h in held]
    codes = [r.status_code for r in responses]
    assert 429 in codes, codes
    for h in held:
        h.__exit__(None, None, None)  # the accepted ones disconnect mid-stream: aborts
    wait_for(lambda: _baseline(stats(base)), 30, what="baseline after the disconnects")
    after = stats(base)
    assert after["num_rejected"] - before["num_rejected"] >= codes.count(429)
    assert after["rejected_by_code"].get("queue_full", 0) >= codes.count(429)
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    aborts = [line for line in metrics.splitlines()
              if line.startswith('tickserve_requests_finished_total{finish_reason="abort"}')]
    assert aborts and float(aborts[0].split()[-1]) >= codes.count(200)


# ---------------------------------------------------------------- liveness of frontends


def test_a_killed_frontend_is_noticed_at_once_not_at_its_heartbeat_timeout(tmp_path, tiny_model_dir):
    """Finding 11: the engine kept a killed frontend's rows reserved until its 5 s
    heartbeat timeout. The engine watches its socket's disconnections: within ~1 s."""
    group = ProcessGroup(tmp_path)
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    try:
        fa, a, b = two_frontends(group, tiny_model_dir, run, frontend_timeout_s=30.0)
        stream = httpx.stream("POST", f"{a}/v1/completions", json={"prompt": "long", "max_tokens": 1800,
                                                                    "ignore_eos": True, "stream": True}, timeout=60)
        resp = stream.__enter__()
        assert resp.status_code == 200
        wait_for(lambda: stats(b)["num_active"] == 1, 10)
        killed = time.monotonic()
        fa.popen.send_signal(signal.SIGKILL)
        wait_for(lambda: _baseline(stats(b)), 10, 0.05, "the dead frontend's row freed")
        assert time.monotonic() - killed < 2.5
        try:
            stream.__exit__(None, None, None)
        except httpx.HTTPError:
            pass
    finally:
        group.close()
        shutil.rmtree(run, ignore_errors=True)


# ---------------------------------------------------------------- configuration


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], env=_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args,says", [
    (["--prefill-mode", "disaggregated", "--data-parallel-size", "2"], "data-parallel-size"),
    (["--dtype", "int8"], "dtype"),
    (["--device", "cuda"], "cuda"),
    (["--log-level", "loud"], "log_level"),
    (["--port", "99999"], "port"),
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--kv-memory-fraction", "1.5"], "kv_memory_fraction"),
    (["--chat-template", "/nonexistent/template.jinja"], "chat_template"),
    (["--tool-call-parser", "mistral"], "tool_call_parser"),
])
def test_bad_configuration_is_one_line_and_exit_2(args, says):
    """Finding 8: these restarted the engine forever or printed tracebacks."""
    if "cuda" in args:
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    done = _cli("serve", "--port", str(free_port()), *args) if "--port" not in args else _cli("serve", *args)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_a_boolean_setting_is_strict():
    done = _cli("serve", "--prefix-caching", "maybe")
    assert done.returncode == 2 and "maybe" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # not argparse's whole usage
    done = _cli("serve", "--no-such-flag")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    from shared import config as cfg

    with pytest.raises(ValueError, match="TICKSERVE_PREFIX_CACHING"):
        cfg.build(cfg.EngineConfig, {}, {"TICKSERVE_PREFIX_CACHING": "maybe"})


def test_a_second_engine_on_a_run_directory_is_refused_and_the_first_keeps_serving(tmp_path, tiny_model_dir):
    """Finding 9: a second engine on the same --run-dir took over the socket files and,
    on exit, deleted them. Now it exits with the configuration status (78) at once, and
    a supervisor that meets that status stops instead of restarting for ever."""
    group = ProcessGroup(tmp_path)
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    try:
        group.engine(tiny_model_dir, run)
        port = free_port()
        group.frontend(tiny_model_dir, run, port)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        second = group.engine(tiny_model_dir, run)
        assert second.popen.wait(60) == 78, second.output()[-2000:]
        assert "another engine" in second.output()
        assert (run / "input.sock").exists() and (run / "output.sock").exists()
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "first", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        t0 = time.monotonic()
        served = _cli("serve", str(tiny_model_dir), "--port", str(free_port()), "--run-dir", str(run),
                      "--device", "cpu", "--torch-threads", "1", "--data-parallel-size", "1", timeout=120)
        assert served.returncode == 78 and time.monotonic() - t0 < 90, served.stderr[-2000:]
        assert "another engine" in served.stderr and "restarting" not in served.stderr
    finally:
        group.close()
        shutil.rmtree(run, ignore_errors=True)


# ---------------------------------------------------------------- overload


def test_a_thousand_streams_at_once_get_only_200s_and_json_429s_and_drain_to_baseline(tmp_path, tiny_model_dir):
    """1,000 streaming requests at once against a queue of 64: every answer is a
    complete stream or an OpenAI-shaped 429 before any SSE byte; nothing hangs; the
    engine is back at baseline afterwards."""
    import asyncio
    import json

    group = ProcessGroup(tmp_path)
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    try:
        group.engine(tiny_model_dir, run, max_queue_size=64, max_batch_size=32)
        port = free_port()
        group.frontend(tiny_model_dir, run, port, max_connections_per_client=2000)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)

        async def one(client, i):
            body = {"prompt": f"overload {i}", "max_tokens": 8, "ignore_eos": True, "stream": True}
            async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
                text = (await resp.aread()).decode()
                return resp.status_code, resp.headers.get("content-type", ""), text

        async def storm():
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits, trust_env=False) as client:
                return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(1000))), 240)

        results = asyncio.run(storm())
        codes = [status for status, _, _ in results]
        assert set(codes) <= {200, 429}, sorted(set(codes))
        assert codes.count(200) >= 64 and codes.count(429) > 0
        for status, ctype, text in results:
            if status == 429:
                assert json.loads(text)["error"]["code"] == "queue_full"
            else:
                assert ctype.startswith("text/event-stream") and text.rstrip().endswith("data: [DONE]")
                assert '"error"' not in text
        wait_for(lambda: _baseline(stats(base)), 30, what="baseline after the storm")
        assert stats(base)["rejected_by_code"]["queue_full"] == codes.count(429)
        assert all(proc.alive() for proc in group.procs)
    finally:
        group.close()
        shutil.rmtree(run, ignore_errors=True)
