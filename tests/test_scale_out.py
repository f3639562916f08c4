"""Scale-out on loopback with the tiny model: two engines behind two frontends (session
affinity, load spill, an engine killed and brought back, aborts at the owner), several
frontends and engines under ``tickserve serve`` (kill -9 of a frontend, the totals of
``/metrics``), how many engines ``--data-parallel-size 0`` picks, and the Kubernetes
inference gateway's metrics contract."""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from frontend.router import BalancePolicy, affinity_key, choose, rendezvous_order
from tests.procs import ProcessGroup, children_running, free_port, http_json, stats, wait_for, wait_healthy


# ---------------------------------------------------------------- the router alone


class _Engine:
    def __init__(self, address, load=0.0, up=True, slots=100.0):
        self.address, self._load, self.up, self.slots = address, load, up, slots

    def load(self):
        return self._load

    def free_slots(self):
        return self.slots - self._load


def test_rendezvous_is_stable_and_moves_only_a_dead_engines_keys():
    engines = [_Engine(f"/run/engine-{i}") for i in range(4)]
    keys = [affinity_key(f"user-{i}", []) for i in range(400)]
    first = {k: rendezvous_order(k, engines)[0].address for k in keys}
    assert len(set(first.values())) == 4  # every engine gets keys
    assert all(rendezvous_order(k, list(reversed(engines)))[0].address == first[k] for k in keys)  # order-free
    engines[2].up = False
    moved = {k for k in keys if choose(k, engines)[0].address != first[k]}
    assert moved == {k for k in keys if first[k] == "/run/engine-2"}


def test_bounded_load_spills_to_the_least_loaded_and_prefix_keys_share_an_engine():
    a, b = _Engine("a"), _Engine("b")
    key = next(k for k in (affinity_key(f"s{i}", []) for i in range(100)) if choose(k, [a, b])[0] is a)
    a._load = 20.0
    assert choose(key, [a, b], BalancePolicy(balance_abs=8, balance_rel=1.5))[0] is b
    a._load = 5.0
    assert choose(key, [a, b])[0] is a  # within the bound: affinity wins
    a.slots = 5.0
    assert choose(key, [a, b])[0] is b  # a would queue it while b has room
    b.slots = 0.0
    assert choose(key, [a, b])[0] is a  # both full: affinity again
    system = list(range(100, 140))
    assert affinity_key(None, system + [1, 2]) == affinity_key(None, system + [9, 9, 9])
    assert affinity_key("alice", system) != affinity_key(None, system)


# ---------------------------------------------------------------- two engines, two frontends


@pytest.fixture
def two_by_two(tmp_path, tiny_model_dir):
    runs = [Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp")) for _ in range(2)]
    group = ProcessGroup(tmp_path)
    for r in runs:
        group.engine(tiny_model_dir, r, max_batch_size=8)
    bases = []
    for _ in range(2):
        port = free_port()
        group.frontend(tiny_model_dir, "", port, engine=",".join(map(str, runs)))
        bases.append(f"http://127.0.0.1:{port}")
    try:
        for b in bases:
            wait_healthy(b, 120)
        wait_for(lambda: stats(bases[0])["num_engines_up"] == 2 and stats(bases[1])["num_engines_up"] == 2, 30)
        yield group, runs, bases
    finally:
        group.close()
        for r in runs:
            shutil.rmtree(r, ignore_errors=True)


def _finished(base) -> list[int]:
    return [e["num_finished"] for e in stats(base)["engines"]]


def _at_baseline(base) -> bool:
    s = stats(base)
    return all(e["num_active"] == 0 and e["num_pending"] == 0 and e["active_kv_reserved"] == 0
               and e["blocks"]["num_used_blocks"] == 0 for e in s["engines"]) and s["num_engines_up"] == 2


def test_one_session_sticks_to_one_engine_from_either_frontend(two_by_two):
    group, runs, bases = two_by_two
    before = _finished(bases[0])
    for i in range(8):
        status, body, _ = http_json(f"{bases[i % 2]}/v1/completions",
                                    {"prompt": f"turn {i}", "max_tokens": 2, "user": "alice"})
        assert status == 200, body
    wait_for(lambda: sum(_finished(bases[0])) - sum(before) == 8, 10)
    grew = [a - b for a, b in zip(_finished(bases[0]), before)]
    assert sorted(grew) == [0, 8]  # all eight on one engine
    # n > 1: every choice of one request on the engine of its first
    status, body, _ = http_json(f"{bases[1]}/v1/completions", {"prompt": "n", "n": 4, "max_tokens": 2,
                                                               "user": "alice"})
    assert status == 200 and len(body["choices"]) == 4
    wait_for(lambda: sum(_finished(bases[0])) - sum(before) == 12, 10)
    assert sorted(a - b for a, b in zip(_finished(bases[0]), before)) == [0, 12]


def test_a_skewed_load_spills_to_the_other_engine(two_by_two):
    group, runs, bases = two_by_two
    done: list[int] = []

    def stream(i):
        status, body, _ = http_json(f"{bases[i % 2]}/v1/completions",
                                    {"prompt": f"busy {i}", "max_tokens": 300, "ignore_eos": True, "user": "bob"},
                                    timeout=120)
        done.append(status)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    seen_both = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not seen_both:
        active = [e["num_active"] + e["num_pending"] for e in stats(bases[0])["engines"]]
        seen_both = all(a > 0 for a in active)
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert seen_both, "one session's flood never reached the second engine"
    assert done.count(200) == 24
    wait_for(lambda: _at_baseline(bases[0]), 30)


def test_a_killed_engine_fails_its_streams_and_traffic_moves_then_comes_back(two_by_two, tiny_model_dir):
    group, runs, bases = two_by_two
    engines = group.procs[:2]
    events: list[str] = []
    with httpx.stream("POST", f"{bases[0]}/v1/completions", json={"prompt": "long", "max_tokens": 1800,
                                                                   "ignore_eos": True, "stream": True,
                                                                   "user": "carol"}, timeout=60) as resp:
        lines = resp.iter_lines()
        events.append(next(lines))
        owner = next(i for i, e in enumerate(stats(bases[1])["engines"]) if e["num_active"] > 0)
        t0 = time.monotonic()
        engines[owner].popen.send_signal(signal.SIGKILL)
        events.extend(line for line in lines if line)
    assert time.monotonic() - t0 < 2.5
    assert events[-1] == "data: [DONE]" and any('"error"' in e for e in events)
    for i in range(4):  # carol's next requests go to the surviving engine
        status, body, _ = http_json(f"{bases[i % 2]}/v1/completions", {"prompt": "again", "max_tokens": 2,
                                                                       "user": "carol"})
        assert status == 200, body
    engines[owner].popen.wait(10)
    group.engine(tiny_model_dir, runs[owner], max_batch_size=8)  # what the supervisor would do
    wait_for(lambda: stats(bases[0])["num_engines_up"] == 2 and stats(bases[1])["num_engines_up"] == 2, 60)
    before = _finished(bases[0])
    for i in range(4):
        assert http_json(f"{bases[i % 2]}/v1/completions", {"prompt": "back", "max_tokens": 2,
                                                            "user": "carol"})[0] == 200
    wait_for(lambda: sum(_finished(bases[0])) - sum(before) == 4, 10)
    grew = [a - b for a, b in zip(_finished(bases[0]), before)]
    assert grew[owner] == 4  # the key came home to its engine


def test_an_abort_reaches_the_engine_that_owns_the_request(two_by_two):
    group, runs, bases = two_by_two
    for session in ("dave", "erin", "frank", "grace"):
        stream = httpx.stream("POST", f"{bases[1]}/v1/completions", json={"prompt": "x", "max_tokens": 1800,
                                                                           "ignore_eos": True, "stream": True,
                                                                           "user": session}, timeout=60)
        resp = stream.__enter__()
        next(resp.iter_lines())
        stream.__exit__(None, None, None)  # the client leaves mid-stream
    wait_for(lambda: _at_baseline(bases[0]), 10, what="both engines back to baseline after the aborts")


# ---------------------------------------------------------------- tickserve serve: N frontends


@pytest.fixture
def served(tmp_path, tiny_model_dir):
    group = ProcessGroup(tmp_path)
    port = free_port()
    proc = group.spawn(["-m", "shared.cli", "serve", str(tiny_model_dir), "--port", str(port), "--device", "cpu",
                        "--dtype", "float32", "--torch-threads", "1", "--api-server-count", "2", "--data-parallel-size", "2",
                        "--log-level", "warning"], "serve")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 120)
        yield proc, base
    finally:
        group.close()


def _frontend_ids(base: str, n: int = 40) -> Counter:
    seen: Counter = Counter()
    for _ in range(n):
        with httpx.Client(timeout=10) as c:  # a new connection each time: the kernel picks a frontend
            seen[c.get(f"{base}/scheduler/stats").json()["frontend"]["frontend_id"]] += 1
    return seen


def test_two_frontends_share_one_port_and_one_killed_leaves_it_serving(served):
    proc, base = served
    wait_for(lambda: len(_frontend_ids(base)) == 2, 30, what="both frontends answering")
    kids = [int(p) for p in Path(f"/proc/{proc.popen.pid}/task/{proc.popen.pid}/children").read_text().split()]
    frontends = [k for k in kids if "-m\x00frontend\x00" in Path(f"/proc/{k}/cmdline").read_text()]
    assert len(frontends) == 2
    os.kill(frontends[0], signal.SIGKILL)
    for i in range(20):  # the port keeps answering while the supervisor brings a new one
        status, body, _ = http_json(f"{base}/v1/completions", {"prompt": f"still {i}", "max_tokens": 2})
        assert status == 200, body
    wait_for(lambda: len(_frontend_ids(base)) == 2, 30, what="the killed frontend restarted")


def test_metrics_from_any_frontend_are_the_totals_of_all(served):
    proc, base = served
    wait_for(lambda: len(_frontend_ids(base)) == 2, 30)
    for i in range(12):
        with httpx.Client(timeout=30) as c:
            assert c.post(f"{base}/v1/completions", json={"prompt": f"count {i}", "max_tokens": 2}).status_code == 200

    def finished(text: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("tickserve_requests_finished_total{"))

    scrapes = []
    for _ in range(6):
        with httpx.Client(timeout=10) as c:
            scrapes.append(finished(c.get(f"{base}/metrics").text))
    assert min(scrapes) >= 12 and max(scrapes) - min(scrapes) == 0, scrapes


# ---------------------------------------------------------------- the gateway's metrics contract


GAUGES = {"tickserve:num_requests_waiting", "tickserve:num_requests_running", "tickserve:kv_cache_usage_perc"}


def test_metrics_meet_the_inference_gateway_contract(served):
    proc, base = served
    stream = httpx.stream("POST", f"{base}/v1/completions", json={"prompt": "load", "max_tokens": 2000,
                                                                   "ignore_eos": True, "stream": True}, timeout=60)
    resp = stream.__enter__()
    lines = resp.iter_lines()  # kept: a collected iterator closes the response (a client disconnect)
    next(lines)

    def running_of(text: str) -> float:
        return float(next(line for line in text.splitlines()
                          if line.startswith("tickserve:num_requests_running ")).split()[-1])

    # while the stream runs: the gauges follow the engines' stats broadcasts (every 0.25 s,
    # later on a loaded host), so poll until one shows the stream running
    def scrape_while_running() -> str | None:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        return text if running_of(text) >= 1 else None

    text = wait_for(scrape_while_running, 15, what="a /metrics scrape with the stream running")
    # cheap to scrape: no round trip to an engine. With every engine stopped (SIGSTOP),
    # 20 scrapes still answer, with the gauges, from the last broadcasts
    engines = children_running(proc.popen.pid, "engine_proc")
    assert len(engines) == 2
    for pid in engines:
        os.kill(pid, signal.SIGSTOP)
    try:
        while_stopped = [httpx.get(f"{base}/metrics", timeout=10) for _ in range(20)]
    finally:
        for pid in engines:
            os.kill(pid, signal.SIGCONT)
    assert all(r.status_code == 200 and "tickserve:num_requests_running " in r.text for r in while_stopped)
    stream.__exit__(None, None, None)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for name in GAUGES | {"tickserve:cache_config_info"}:
        assert types.get(name) == "gauge", name
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    for name in GAUGES:
        own = [line for line in series if line.split("{")[0].split(" ")[0] == name]
        assert len(own) == 1 and own[0].startswith(name + " "), own  # one series, no labels
    usage = float(next(line for line in series if line.startswith("tickserve:kv_cache_usage_perc ")).split()[-1])
    assert 0.0 < usage <= 1.0, [line for line in series if line.startswith(("tickserve:", "tickserve_engine", "tickserve_requests_finished"))]
    assert running_of(text) >= 1
    info = next(line for line in series if line.startswith("tickserve:cache_config_info{"))
    assert 'block_size="16"' in info and re.search(r'num_gpu_blocks="\d+"', info)
    assert httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]


# ---------------------------------------------------------------- how many engines auto starts


def test_auto_data_parallel_size_splits_the_cores_within_memory(tmp_path, monkeypatch):
    from shared import placement

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    monkeypatch.setattr(placement, "available_memory_bytes", lambda: 10**9)
    auto = lambda **kw: placement.auto_data_parallel_size(**{  # noqa: E731
        "device": "auto", "torch_threads": 0, "cpus": 2, "by_address": False, "model_dir": model,
        "accelerator": False, **kw})
    assert auto() == 2  # one single-threaded engine per core
    assert auto(torch_threads=2) == 1 and auto(cpus=8, torch_threads=2) == 4  # --torch-threads per engine
    assert auto(cpus=64) == placement.MAX_AUTO_ENGINES
    assert auto(accelerator=True) == 1 and auto(device="cuda") == 1 and auto(device="cpu", accelerator=True) == 2
    assert auto(by_address=True) == 1  # placed by --input-addr/--output-addr: one engine
    with open(model / "model.safetensors", "r+b") as f:  # weights that fit in half the memory once
        f.truncate(4 * 10**8)
    assert auto(cpus=8) == 1


def test_serve_with_data_parallel_engines_reports_each(served):
    proc, base = served
    # one snapshot with both engines up and both engines' stats: an engine's heartbeat and its
    # stats broadcast arrive separately, so a loaded host can show one before the other
    s = wait_for(lambda: (s := stats(base))["num_engines_up"] == 2 and len(s["engines"]) == 2 and s, 60,
                 what="both engines up with their stats")
    assert len(s["engines"]) == 2
    assert all(e["runtime"]["torch_threads"] == 1 for e in s["engines"])
    version = wait_for(lambda: (v := httpx.get(f"{base}/version", timeout=10).json())["num_engines_up"] == 2 and v,
                       30, what="/version with both engines up")  # a heartbeat late on a loaded host
    assert version["num_engines"] == 2 and version["num_engines_up"] == 2 and version["runtime"]["torch_threads"] == 1
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "two engines", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_aggregated_stats_keep_the_block_size():
    """/metrics falls back to the aggregated stats before any broadcast: its
    cache_config_info reads block_size from them."""
    from frontend.engine_set import aggregate

    per_engine = [{"blocks": {"num_used_blocks": 1, "num_blocks": 10, "block_size": 16}},
                  {"blocks": {"num_used_blocks": 3, "num_blocks": 10, "block_size": 16}}]
    out = aggregate(per_engine, 2)
    assert out["blocks"] == {"num_used_blocks": 4, "num_blocks": 20, "block_size": 16}
    assert out["kv_pressure"] == 0.2
