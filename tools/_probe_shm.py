"""The nine shared-memory findings of issue 20, re-run against a running ``tickserve serve``
(``tools/probe_hardening.py --shm``). Each probe attacks the engine's shared-memory
carrier from this process — as a buggy, stalled or hostile local peer would — while a
witness polls ``/health`` every 50 ms and streams unrelated requests through the real
frontend; each reports its own figure beside the witness's: whether the engine is the
same process with the same id, the ``/health`` codes seen, and how many unrelated
streams completed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from shared import codec, shm, shm_channel, shm_ring
from shared import protocol as p
from shared.transport import topic_for
from tests import shm_peers as peers
from tests.procs import Witness, stats, wait_for


class Beats:
    """An extra shared-memory frontend that only listens: the longest gap between the
    engine's heartbeats while it runs (seconds)."""

    def __init__(self, run: Path):
        self.chan = peers.rogue(run, "heartbeat-witness")
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                if self.chan.poll(50):
                    while (got := self.chan.recv()) is not None:
                        if isinstance(got.msg, p.EngineHeartbeat):
                            self.times.append(time.monotonic())
            except Exception:  # noqa: BLE001 - a gap, counted below
                time.sleep(0.01)

    def max_gap(self, since: float) -> float:
        ts = [t for t in self.times if t >= since]
        return round(max((b - a for a, b in zip(ts, ts[1:])), default=float("nan")), 3)

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.chan.close()


def _attack(base, procs, beats, fn) -> dict:
    t0 = time.monotonic()
    with Witness(base, procs, max_tokens=32) as w:
        figure = fn()
    return {**figure, **w.summary(), "max_heartbeat_gap_s": beats.max_gap(t0)}


def f1_overflow_without_frame(run: Path) -> dict:
    rogue = peers.rogue(run, "rogue-overflow")
    rogue.outbound.try_write(shm.OVERFLOW_KIND, shm.OWN, 0, b"")
    t0 = time.monotonic()
    shm.ring_doorbell(rogue.out_bell)
    took = peers.closed_by_engine(rogue.sock, 5)
    rogue.close()
    return {"peer_retired_after_ms": None if took is None else round((time.monotonic() - t0) * 1000, 1)}


def f2_positions_near_2_64(run: Path) -> dict:
    out = {}
    rogue = peers.rogue(run, "rogue-inbound")
    rogue.outbound._idx[shm_ring._HEAD], rogue.outbound._idx[shm_ring._TAIL] = shm_ring.M64 - 7, shm_ring.M64
    t0 = time.monotonic()
    shm.ring_doorbell(rogue.out_bell)
    gone = peers.closed_by_engine(rogue.sock, 5) is not None
    out["inbound_head_tail_near_2^64_retired_after_ms"] = round((time.monotonic() - t0) * 1000, 1) if gone else None
    rogue.close()
    rogue = peers.rogue(run, "rogue-tail")
    rogue.inbound._idx[shm_ring._TAIL] = shm_ring.M64  # the engine's own outbound tail, rewritten
    time.sleep(0.6)
    heard = 0
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and not heard:
        if rogue.poll(100):
            while (got := rogue.recv()) is not None:
                heard += isinstance(got.msg, p.EngineHeartbeat)
    out["outbound_tail_rewritten_peer_still_served"] = heard > 0
    rogue.close()
    return out


def f3_ftruncate(run: Path) -> dict:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(5)
    sock.connect(shm.socket_path(str(run)))
    sock.send(shm.HELLO + b"rogue-truncate")
    _, fds, _, _ = socket.recv_fds(sock, 1024, 4)
    results = []
    for fd in fds[:2]:
        for size in (0, 4096, 1 << 30):
            try:
                os.ftruncate(fd, size)
                results.append("truncated")
            except OSError as exc:
                results.append(exc.strerror)
    for fd in fds:
        os.close(fd)
    time.sleep(0.5)
    sock.close()
    return {"ftruncate_results": sorted(set(results)), "attempts": len(results)}


def f4_silent_and_trickling(run: Path, base: str) -> dict:
    path = shm.socket_path(str(run))
    t0 = time.monotonic()
    silent, trickles = [], []
    for _ in range(6):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path)
        silent.append(s)
    for _ in range(3):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path)
        s.send(b"t")
        trickles.append(s)
    streams: list[bool] = []  # the finding: 3 trickles during 4 streams failed all 4
    t = threading.Thread(target=lambda: streams.extend(_streams(base, 4, 48)))
    t.start()
    closed = []
    for s in silent:
        peers.closed_by_engine(s, 5)
        closed.append(time.monotonic() - t0)
    answers = []
    for s in trickles:
        s.settimeout(2)
        try:
            answers.append(s.recv(1024).decode(errors="replace"))
        except OSError as exc:
            answers.append(str(exc))
    t.join(120)
    for s in silent + trickles:
        s.close()
    return {"silent_closed_after_connect_s_max": round(max(closed), 3), "trickle_answers": sorted(set(answers)),
            "streams_meanwhile_completed": f"{sum(streams)} of 4"}


def f5_live_id(run: Path, base: str) -> dict:
    victim = stats(base)["frontend"]["frontend_id"]
    results: list[bool] = []
    t = threading.Thread(target=lambda: results.extend(_streams(base, 6, 200)))
    t.start()
    time.sleep(0.5)
    thief = shm_channel.ShmChannel(str(run), victim, topic_for(victim), p.BROADCAST_TOPIC)
    admitted = thief.connect()
    thief.close()
    t.join(120)
    return {"thief_admitted": admitted, "refusal": thief.refusal,
            "victim_streams_completed": f"{sum(results)} of {len(results)}"}


def f6_many_peers(run: Path, base: str, engine_pid: int, n: int = 500) -> dict:
    one = peers.rogue(run, "before-the-crowd")
    size_one = _broadcast_bytes(one)
    one.close()
    wait_for(lambda: stats(base)["shm"]["peers"] <= 2, 20, what="back to the frontend and the witness")
    fds_before, maps_before = _fds(engine_pid), _ring_bytes(engine_pid)
    t0 = time.monotonic()
    chans = [shm_channel.ShmChannel(str(run), f"crowd-{i}", topic_for(f"crowd-{i}"), p.BROADCAST_TOPIC)
             for i in range(n)]
    admitted = sum(c.connect() for c in chans)
    took = time.monotonic() - t0
    refusals = sorted({c.refusal for c in chans if c.refusal})
    fds_peak, maps_peak = _fds(engine_pid), _ring_bytes(engine_pid)
    size_full = _broadcast_bytes(next(c for c in chans if c.connected))
    for c in chans:
        c.close()
    wait_for(lambda: stats(base)["shm"]["peers"] <= 2, 20, what="the crowd retired")
    return {"handshakes": n, "admitted": admitted, "refused": n - admitted, "refusals": refusals,
            "s_for_all": round(took, 2), "engine_fds_before_peak_after": [fds_before, fds_peak, _fds(engine_pid)],
            "engine_ring_mib_before_peak": [maps_before >> 20, maps_peak >> 20],
            "stats_broadcast_bytes_3_peers_vs_at_the_cap": [size_one, size_full],
            "stats_broadcast_has_per_peer_map": None if size_full is None else False}


def f7_torn_indices() -> dict:
    """Two processes: one stores HEAD and TAIL 2 M times each, the other loads them; loads
    that are not a value some store wrote, with struct's accessors and with the ring's."""
    return {name: {k: v for k, v in peers.torn_index_loads(old).items() if k not in ("seen_stored", "samples")}
            for name, old in (("struct_pack_into_unpack_from", True), ("ring_memoryview_cast_Q", False))}


def f8_big_frame(run: Path) -> dict:
    out = {}
    rogue = peers.rogue(run, "big-frame")
    for ids in (100_000, 400_000, 1_000_000):  # up to 3 MB (1M ids: the protocol's cap on a prompt)
        frame = p.Submit(f"big-{ids}", "big-frame", [40_000] * ids, p.SamplingParams(max_tokens=1), None, 0)
        size = len(codec.encode(frame))
        t0 = time.monotonic()
        rogue.send(frame, timeout_ms=5000)
        ack = None
        while ack is None and time.monotonic() - t0 < 10:
            if rogue.poll(100):
                while (got := rogue.recv()) is not None:
                    if isinstance(got.msg, p.Ack) and got.msg.request_id == f"big-{ids}":
                        ack = got.msg
        out[f"{size}_bytes_acked_after_s"] = _rounded(time.monotonic() - t0) if ack else None
    rogue.close()
    return out


def f9_frontend_side(run: Path, engine_pid: int) -> dict:
    """The frontend's client in this process: an abort past a full ring (the engine stopped
    0.5 s while 4 large submits fill the ring), the event loop's longest stall meanwhile, and
    a bad ring from the engine (its tail out of range in our mapping)."""
    from frontend.engine_client import EngineClient, EngineUnavailable
    from shared.config import FrontendConfig

    out: dict = {}

    async def main():
        client = EngineClient(FrontendConfig(run_dir=str(run), transport="shm", frontend_id="probe-fe"))
        client.start(asyncio.get_running_loop())
        try:
            await peers.until(lambda: client.is_up, 20)
            await client.submit("probe-victim", [5] * 8, p.SamplingParams(max_tokens=1500, ignore_eos=True))
            aborted0 = (await client.stats())["num_aborted"]
            lag = peers.LoopLag()
            os.kill(engine_pid, signal.SIGSTOP)
            t_stop = time.monotonic()
            try:
                big = p.Submit("probe-big", "probe-fe", [40_000] * 100_000, p.SamplingParams(max_tokens=1), None, 0)
                for _ in range(5):  # three fill 900 KB of the 1 MiB ring, heartbeats the rest
                    client.post(big, 0.0)
                for _ in range(8000):
                    client.post(p.Heartbeat("probe-fe"), 0.0)
                with contextlib.suppress(TimeoutError):  # the figures below say if it did not
                    await peers.until(lambda: client._outbox.empty() and client.channel.outbound.free() < 64, 0.3)
                out["ring_bytes_free_before_the_abort"] = client.channel.outbound.free()
                client.abort(["probe-victim"])
                with contextlib.suppress(TimeoutError):
                    await peers.until(lambda: client.aborts_pending == 1, 0.1)
                out["abort_waiting_while_ring_full"] = client.aborts_pending
                try:
                    await client.stats(timeout=0.15)
                except EngineUnavailable:
                    pass
            finally:
                await asyncio.sleep(max(0.0, 0.5 - (time.monotonic() - t_stop)))
                os.kill(engine_pid, signal.SIGCONT)
            t_cont = time.monotonic()
            await peers.until(lambda: client.aborts_pending == 0, 10)
            while (await client.stats())["num_aborted"] <= aborted0 and time.monotonic() - t_cont < 10:
                await asyncio.sleep(0.02)
            out["abort_delivered_after_resume_s"] = round(time.monotonic() - t_cont, 3)
            out["event_loop_longest_stall_ms"] = round(lag.worst * 1000, 1)
            lag.stop()
            peer_tail = client.channel.inbound  # a bad ring from the engine
            peer_tail._idx[shm_ring._TAIL] = shm_ring.M64
            t_bad = time.monotonic()
            await peers.until(lambda: client.channel.connections >= 2 and client.is_up, 20)
            out["bad_ring_up_again_after_s"] = round(time.monotonic() - t_bad, 3)
            out["receiver_thread_alive"] = client._thread.is_alive()
        finally:
            client.close()

    asyncio.run(main())
    return out


def _streams(base: str, n: int, max_tokens: int) -> list[bool]:
    import httpx

    async def one(client):
        body = {"prompt": "a stream", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
            lines = [line async for line in resp.aiter_lines() if line]
        return resp.status_code == 200 and lines[-1] == "data: [DONE]" and not any('"error"' in x for x in lines)

    async def go():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(n)))

    return list(asyncio.run(go()))


def _broadcast_bytes(chan: shm_channel.ShmChannel) -> int | None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if chan.poll(100):
            while (rec := chan.inbound.read()) is not None:
                kind, topic, _, payload = rec
                if kind == shm.OVERFLOW_KIND:
                    payload = chan._socket.claim()
                msg = codec.decode(payload, "frontend")
                if isinstance(msg, p.Stats) and msg.nonce == 0:
                    assert "frontends" not in msg.data
                    return len(payload)
    return None


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _ring_bytes(pid: int) -> int:
    total = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "tickserve-ring" in line:
            lo, hi = line.split()[0].split("-")
            total += int(hi, 16) - int(lo, 16)
    return total


def _rounded(x):
    return None if x is None else round(x, 3)


def run_all(run: Path, base: str, serve_proc, engine_pid_of) -> dict:
    """Every finding, in order; ``engine_pid_of()`` is the engine's pid now."""
    engine_pid = engine_pid_of()
    beats = Beats(run)
    procs = [serve_proc]
    result: dict = {"engine_pid_at_start": engine_pid}
    steps = [("1_overflow_marker_without_frame", lambda: f1_overflow_without_frame(run)),
             ("2_ring_positions_near_2^64", lambda: f2_positions_near_2_64(run)),
             ("3_ftruncate_of_the_memfds", lambda: f3_ftruncate(run)),
             ("4_silent_and_trickling_handshakes", lambda: f4_silent_and_trickling(run, base)),
             ("5_a_live_frontends_id", lambda: f5_live_id(run, base)),
             ("6_500_idle_handshakes", lambda: f6_many_peers(run, base, engine_pid)),
             ("7_torn_index_loads_and_stores", f7_torn_indices),
             ("8_frames_larger_than_the_socket_buffer", lambda: f8_big_frame(run))]
    try:
        for name, step in steps:
            _log(name)
            result[name] = _attack(base, procs, beats, step)
            _log(f"{name}: {result[name]}")
        _log("9_frontend_side")
        result["9_frontend_side"] = _attack(base, procs, beats, lambda: f9_frontend_side(run, engine_pid))
        _log(f"9_frontend_side: {result['9_frontend_side']}")
    finally:
        beats.close()
    result["engine_pid_at_end"] = engine_pid_of()
    result["engine_never_restarted"] = result["engine_pid_at_end"] == engine_pid
    result["shm_summary_at_end"] = stats(base).get("shm")
    return result


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

