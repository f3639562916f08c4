"""The shared-memory carrier between real engine and frontend processes: both carriers
against one engine at once, kill -9 of either side with frames in flight (no hang,
nothing left behind), a full outbound ring, frames larger than a ring, and garbage
written into a ring. The ring alone: ``test_shm_ring.py``; hostile peers:
``test_shm_hostile.py``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from shared import shm
from shared import shm_channel
from shared import protocol as p
from shared.transport import topic_for
from tests.procs import REPO, ProcessGroup, _env, free_port, http_json, start_stack, stats, wait_for, wait_healthy

pytestmark = pytest.mark.skipif(shm.available() is not None, reason=f"no shared memory here: {shm.available()}")


# ---------------------------------------------------------------- processes


def _stack(tmp: Path, model_dir: Path, run: Path, transport: str = "auto", **engine_options):
    return start_stack(tmp, model_dir, run, {"transport": transport}, **engine_options)


def _baseline(s: dict) -> bool:
    return (s["num_active"] == 0 and s["num_pending"] == 0 and s["num_prefilling"] == 0
            and s["active_kv_reserved"] == 0 and s["blocks"]["num_used_blocks"] == 0 and s["num_waiting"] == 0)


def _fds_and_maps(pid: int) -> tuple[int, int]:
    """Open fds, and mappings of tickserve's rings, of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    maps = sum(1 for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "tickserve-ring" in line)
    return fds, maps


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_shm_and_zmq_frontends_and_a_zmq_script_share_one_engine(tmp_path, tiny_model_dir, run_dir):
    group, shm_base = _stack(tmp_path, tiny_model_dir, run_dir)
    try:
        port = free_port()
        group.frontend(tiny_model_dir, run_dir, port, transport="zmq")
        zmq_base = f"http://127.0.0.1:{port}"
        port2 = free_port()
        group.frontend(tiny_model_dir, run_dir, port2)  # a second shared-memory frontend
        shm_base2 = f"http://127.0.0.1:{port2}"
        wait_healthy(zmq_base)
        wait_healthy(shm_base2)
        assert httpx.get(f"{shm_base}/version", timeout=10).json()["transport"] == "shm"
        assert httpx.get(f"{zmq_base}/version", timeout=10).json()["transport"] == "zmq"
        body = {"prompt": "the same prompt", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        texts = [http_json(f"{b}/v1/completions", body)[1]["choices"][0]["text"] for b in (shm_base, zmq_base, shm_base2)]
        assert texts[0] == texts[1] == texts[2]
        script = subprocess.run([sys.executable, "tools/zmq_client.py", "--run-dir", str(run_dir), "--prompt", "Hi",
                                 "--max-tokens", "4", "--model", str(tiny_model_dir)],
                                env=_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
        assert script.returncode == 0, script.stderr[-2000:]
        carriers = stats(shm_base)["frontends"]
        assert sorted(c["carrier"] for c in carriers.values()) == ["shm", "shm", "zmq"]
        assert stats(zmq_base)["runtime"]["transport"].startswith("shm+zmq")
    finally:
        group.close()


def test_kill_9_of_either_side_leaves_nothing_behind(tmp_path, tiny_model_dir, run_dir):
    """Frames in flight each time: the survivor notices at once, frees everything it held
    of the dead peer (fds, ring mappings, the dead frontend's rows), and /dev/shm is as it
    was. Three cycles of each."""
    dev_shm = set(os.listdir("/dev/shm"))
    group = ProcessGroup(tmp_path)
    engine = group.engine(tiny_model_dir, run_dir)
    try:
        zport = free_port()
        group.frontend(tiny_model_dir, run_dir, zport, transport="zmq")  # a witness that watches the engine
        witness = f"http://127.0.0.1:{zport}"
        wait_healthy(witness)
        wait_for(lambda: stats(witness)["num_frontends"] >= 1, 10)
        before = _fds_and_maps(engine.popen.pid)
        for cycle in range(3):  # frontends die
            port = free_port()
            fe = group.frontend(tiny_model_dir, run_dir, port, transport="shm")
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base)
            stream = httpx.stream("POST", f"{base}/v1/completions", json={"prompt": "in flight", "max_tokens": 1500,
                                                                           "ignore_eos": True, "stream": True},
                                  timeout=30)
            resp = stream.__enter__()
            assert resp.status_code == 200
            wait_for(lambda: stats(witness)["num_active"] == 1, 10)
            t0 = time.monotonic()
            os.kill(fe.popen.pid, signal.SIGKILL)
            wait_for(lambda: _baseline(stats(witness)), 10, 0.05, "the dead frontend's row freed")
            assert time.monotonic() - t0 < 1.5
            try:
                stream.__exit__(None, None, None)
            except httpx.HTTPError:
                pass
            fe.popen.wait(10)
        wait_for(lambda: _fds_and_maps(engine.popen.pid) == before, 5, what="engine back to its fds and maps")
        # the engine dies while a shared-memory frontend streams: the frontend fails the
        # stream at once, drops every fd and mapping of the dead engine's rings, and
        # reconnects to the next engine
        port = free_port()
        fe = group.frontend(tiny_model_dir, run_dir, port, transport="shm")
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        baseline_fe = None
        for cycle in range(3):
            events: list[str] = []
            with httpx.stream("POST", f"{base}/v1/completions", json={"prompt": "in flight", "max_tokens": 1500,
                                                                       "ignore_eos": True, "stream": True},
                              timeout=30) as resp:
                lines = resp.iter_lines()
                events.append(next(lines))
                t0 = time.monotonic()
                os.kill(engine.popen.pid, signal.SIGKILL)
                events.extend(lines)
            assert time.monotonic() - t0 < 2.0
            events = [e for e in events if e]
            assert events[-1] == "data: [DONE]" and any('"error"' in e for e in events)
            engine.popen.wait(10)
            fds, maps = _fds_and_maps(fe.popen.pid)
            assert maps == 0
            if baseline_fe is None:
                baseline_fe = fds
            # the failed stream's HTTP connection closes on its own schedule: bounded wait
            wait_for(lambda: _fds_and_maps(fe.popen.pid)[0] <= baseline_fe, 5, what="the frontend back to its fds")
            engine = group.engine(tiny_model_dir, run_dir)
            wait_healthy(base, 60)
            assert _fds_and_maps(fe.popen.pid)[1] == 2  # the new engine's two rings
        assert set(os.listdir("/dev/shm")) == dev_shm
    finally:
        group.close()


def test_a_full_outbound_ring_drops_and_fails_the_stream_loudly(tmp_path, tiny_model_dir, run_dir):
    """A frontend that stops reading (SIGSTOP) while the engine writes: its ring fills,
    the engine drops and counts instead of waiting, and once the frontend reads again the
    gap fails the stream with an error event; the engine never stalled."""
    group, base = _stack(tmp_path, tiny_model_dir, run_dir, shm_ring_bytes=1 << 14)
    try:
        fe = group.procs[1]
        with httpx.stream("POST", f"{base}/v1/completions", json={"prompt": "fill", "max_tokens": 1900,
                                                                   "ignore_eos": True, "stream": True,
                                                                   "logprobs": 5}, timeout=60) as resp:
            lines = resp.iter_lines()
            next(lines)
            os.kill(fe.popen.pid, signal.SIGSTOP)
            time.sleep(3)
            os.kill(fe.popen.pid, signal.SIGCONT)
            rest = [line for line in lines if line]
        # the gap (or, as the frontend slept through them, the missed heartbeats) fails it
        assert rest[-1] == "data: [DONE]" and any('"error"' in line for line in rest), rest[-3:]
        wait_for(lambda: _baseline(stats(base)), 20, what="baseline after the gap")
        carrier = next(iter(stats(base)["frontends"].values()))
        assert carrier["carrier"] == "shm" and carrier["dropped"] > 0
        status, body, _ = http_json(f"{base}/v1/completions", {"prompt": "after", "max_tokens": 3})
        assert status == 200, body
    finally:
        group.close()


def test_frames_larger_than_a_ring_arrive_in_order(tmp_path, tiny_model_dir, run_dir):
    """Both directions: a prompt whose Submit is larger than half the inbound ring, and
    prompt logprobs whose output is larger than half the outbound ring, go over the
    socket beside the rings, in order with the frames around them."""
    group, base = _stack(tmp_path, tiny_model_dir, run_dir, shm_ring_bytes=1 << 14)
    try:
        ids = list(range(1000, 2600))  # ~4.8 KB of msgpack: more than half the 4 KiB inbound ring
        status, body, _ = http_json(f"{base}/v1/completions", {"prompt": ids, "max_tokens": 2, "echo": True,
                                                               "logprobs": 5, "temperature": 0})
        assert status == 200, body
        lps = body["choices"][0]["logprobs"]
        assert len(lps["tokens"]) == len(ids) + 2 and len(lps["top_logprobs"][1]) == 5
        carrier = next(iter(stats(base)["frontends"].values()))
        assert carrier["overflow_in"] >= 1 and carrier["overflow_out"] >= 1
        status, body, _ = http_json(f"{base}/v1/completions", {"prompt": "small after", "max_tokens": 3})
        assert status == 200
    finally:
        group.close()


def test_garbage_written_into_a_ring_is_counted_and_dropped(tmp_path, tiny_model_dir, run_dir):
    group, base = _stack(tmp_path, tiny_model_dir, run_dir)
    try:
        rogue = shm_channel.ShmChannel(str(run_dir), "rogue-fe", topic_for("rogue-fe"), p.BROADCAST_TOPIC)
        assert rogue.connect()
        ring = rogue.outbound
        for junk in (b"\x00" * 64, os.urandom(300), b"\xff" * 40):  # records of garbage, and garbage records
            assert ring.try_write(shm.DATA_KIND, shm.OWN, 0, junk)
            shm.ring_doorbell(rogue.out_bell)
        at = shm.DATA + ring._tail % ring.capacity
        ring.buf[at: at + 32] = os.urandom(32)
        ring._tail += 32  # as a writer would publish it: within the ring, over garbage
        ring._idx[shm.TAIL // 8] = ring._tail
        shm.ring_doorbell(rogue.out_bell)
        # a header that is not one: counted, and everything up to the writer's tail skipped
        wait_for(lambda: stats(base)["frontends"]["rogue-fe"]["bad_records"] >= 1, 10, what="bad record counted")
        rogue.send(p.Hello("someone-else"))  # a ring may only speak for its own frontend
        wait_for(lambda: stats(base)["bad_frames"] >= 4, 10, what="garbage counted")
        rogue.close()
        status, body, _ = http_json(f"{base}/v1/completions", {"prompt": "unharmed", "max_tokens": 3})
        assert status == 200, body
        assert all(pr.alive() for pr in group.procs)
    finally:
        group.close()
