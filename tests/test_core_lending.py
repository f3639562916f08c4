"""Engines lending idle cores (engine_proc/core_lending.py): the board's slots, the thread
plan that reads them, and a real engine process publishing its load on one."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from engine_proc.core_lending import MIN_IDLE_S, SLOT, CoreBoard, create_board, open_board
from engine_proc.threads import ThreadPlan, usable_cpus
from tests.procs import start_stack, wait_for


def _slots(path) -> list[int]:
    data = open(path, "rb").read()
    return [SLOT.unpack_from(data, i * SLOT.size)[0] for i in range(len(data) // SLOT.size)]


def test_each_engine_writes_its_slot_and_counts_its_idle_siblings(tmp_path):
    path = str(tmp_path / "cores.board")
    create_board(path, 3)
    a, b, c = (CoreBoard(path, i) for i in range(3))
    assert [x.idle_siblings() for x in (a, b, c)] == [2, 2, 2]
    a.publish(True)
    assert _slots(path) == [-1, 0, 0]
    assert (a.idle_siblings(), b.idle_siblings(), c.idle_siblings()) == (2, 1, 1)
    c.publish(True)
    assert b.idle_siblings() == 0
    a.close()  # an engine that stops leaves its slot idle, from now
    assert _slots(path)[0] > 0 and _slots(path)[2] == -1
    assert b.idle_siblings() == 0  # not yet idle for MIN_IDLE_S: not lent out
    assert b.idle_siblings(min_idle_s=0.0) == 1
    time.sleep(MIN_IDLE_S + 0.02)
    assert b.idle_siblings() == 1


def test_a_board_that_cannot_be_used_is_refused_in_one_warning(tmp_path, caplog):
    path = str(tmp_path / "cores.board")
    create_board(path, 2)
    with pytest.raises(ValueError, match="slot 2 is not on the board of 2 engines"):
        CoreBoard(path, 2)
    (tmp_path / "odd").write_bytes(b"123")
    with pytest.raises(ValueError, match="is not a board"):
        CoreBoard(str(tmp_path / "odd"), 0)
    with caplog.at_level(logging.WARNING, logger="tickserve.engine"):
        assert open_board(str(tmp_path / "missing"), 0) is None
    assert "will not borrow" in caplog.text
    assert open_board("", 0) is None


class _Kernels:
    num_threads = 1


@pytest.mark.skipif(usable_cpus() < 2, reason="needs two CPUs to lend one")
def test_small_passes_borrow_one_thread_per_idle_sibling_and_only_while_it_is_idle(tmp_path):
    path = str(tmp_path / "cores.board")
    create_board(path, 2)
    me, sibling = CoreBoard(path, 0), CoreBoard(path, 1)
    kernels = _Kernels()
    plan = ThreadPlan(1, 32, kernels=[kernels], board=me, lend_below=32)
    assert plan.threads_for(1) == 2
    assert plan.threads_for(31) == 2
    assert plan.threads_for(32) == 1  # at the crossover and above: the dense path, its own thread only
    import torch

    before = torch.get_num_threads()
    try:
        assert plan.apply(1) == 2 and kernels.num_threads == 2
        sibling.publish(True)
        assert plan.threads_for(1) == 1
        assert plan.apply(1) == 1 and kernels.num_threads == 1
    finally:
        torch.set_num_threads(before)
    no_lending = ThreadPlan(1, 32, board=me, lend_below=0)  # no low-bit path: nothing borrows
    sibling.publish(False)
    assert plan.threads_for(1) == 1  # idle only just now
    time.sleep(MIN_IDLE_S + 0.02)
    assert plan.threads_for(1) == 2 and no_lending.threads_for(1) == 1


_PIN = """
import json, os, sys
from engine_proc.core_lending import CoreBoard
board = CoreBoard(sys.argv[1], 1)
board.pin_home(2)
tasks = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
print(json.dumps({"home": sorted(os.sched_getaffinity(0)), "cpus": board.cpus, "tasks": list(tasks.values())}))
"""


@pytest.mark.skipif(usable_cpus() < 2, reason="needs two CPUs")
def test_pin_home_keeps_the_engine_thread_on_its_share_and_the_pool_threads_free(tmp_path):
    """In a process of its own, as an engine's main thread: the OpenMP pool threads it starts
    keep every CPU, the thread itself keeps slot 1's share."""
    path = str(tmp_path / "cores.board")
    create_board(path, 2)
    cpus = sorted(os.sched_getaffinity(0))
    done = subprocess.run([sys.executable, "-c", _PIN, path], capture_output=True, text=True, timeout=120,
                          cwd=str(Path(__file__).resolve().parents[1]))
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["home"] == cpus[len(cpus) // 2:len(cpus) // 2 * 2] and got["cpus"] == len(cpus)
    assert cpus in got["tasks"]  # a pool thread started before the pin keeps every CPU


@pytest.mark.slow
def test_an_engine_process_publishes_whether_it_is_busy(tmp_path, tiny_model_dir):
    board = tmp_path / "cores.board"
    create_board(str(board), 2)
    group, base = start_stack(tmp_path, tiny_model_dir, tmp_path / "run", core_board=board, core_board_slot=1,
                              kv_num_blocks=4096)
    try:
        wait_for(lambda: _slots(board)[1] >= 0, 10, what="the engine's slot idle once its KV pool is mapped")
        assert _slots(board)[0] == 0  # never written: no engine in that slot
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as resp:
            model = json.load(resp)["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "hello there", "max_tokens": 200, "ignore_eos": True,
                           "stream": True}).encode()
        seen_busy = threading.Event()

        def stream():
            req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                for line in resp:
                    if line.startswith(b"data: ") and _slots(board)[1] == -1:
                        seen_busy.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert seen_busy.wait(60), f"slot never busy while streaming: {_slots(board)}"
        reader.join(120)
        assert not reader.is_alive()
        wait_for(lambda: _slots(board)[1] > 0, 10, what="the engine's slot idle again after the request")
    finally:
        group.close()


def test_an_engine_lends_no_core_while_its_kv_pool_is_being_mapped(tmp_path, tiny_model_dir):
    """The KV prefault walk (engine_proc/kv_prefault.py) runs on the engine's own core: a
    sibling's threads borrowed onto it waited on the walk, so the slot reads busy until the
    pool is resident. Sampled from the engine's start: whenever the slot reads idle, the
    whole pool (3 GiB: 2 layers × K, V × 2 KV heads × 16 dims × 16 tokens × 4 bytes a
    block) is resident."""
    blocks, block_bytes = 393216, 2 * 2 * 2 * 16 * 16 * 4
    pool = blocks * block_bytes
    board = tmp_path / "cores.board"
    create_board(str(board), 2)
    group, base = start_stack(tmp_path, tiny_model_dir, tmp_path / "run", core_board=board, core_board_slot=1,
                              kv_num_blocks=blocks, max_model_len=256)
    try:
        engine = group.procs[0].popen.pid
        page = os.sysconf("SC_PAGE_SIZE")
        idle_rss = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = _slots(board)[1]
            with open(f"/proc/{engine}/statm") as f:
                rss = int(f.read().split()[1]) * page
            if state > 0:  # idle since that time: published after the walk ended
                idle_rss.append(rss)
                if len(idle_rss) >= 3:
                    break
            time.sleep(0.02)
        assert idle_rss, "the engine's slot never turned idle after its pool was mapped"
        assert min(idle_rss) >= pool, f"slot idle with {min(idle_rss) >> 20} MiB resident, pool {pool >> 20} MiB"
    finally:
        group.close()
