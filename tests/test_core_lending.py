"""Engines lending idle cores (engine_proc/core_lending.py): the board's slots, the thread
plan that reads them, and a real engine process publishing its load on one."""

from __future__ import annotations

import json
import logging
import threading
import urllib.request

import pytest

from engine_proc.core_lending import SLOT, CoreBoard, create_board, open_board
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
    assert _slots(path) == [1, 0, 0]
    assert (a.idle_siblings(), b.idle_siblings(), c.idle_siblings()) == (2, 1, 1)
    c.publish(True)
    assert b.idle_siblings() == 0
    a.close()  # an engine that stops leaves its slot idle
    assert _slots(path) == [0, 0, 1] and b.idle_siblings() == 1


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
    assert no_lending.threads_for(1) == 1


@pytest.mark.slow
def test_an_engine_process_publishes_whether_it_is_busy(tmp_path, tiny_model_dir):
    board = tmp_path / "cores.board"
    create_board(str(board), 2)
    group, base = start_stack(tmp_path, tiny_model_dir, tmp_path / "run", core_board=board, core_board_slot=1)
    try:
        assert _slots(board) == [0, 0]
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as resp:
            model = json.load(resp)["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "hello there", "max_tokens": 200, "ignore_eos": True,
                           "stream": True}).encode()
        seen_busy = threading.Event()

        def stream():
            req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                for line in resp:
                    if line.startswith(b"data: ") and _slots(board)[1] == 1:
                        seen_busy.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert seen_busy.wait(60), f"slot never busy while streaming: {_slots(board)}"
        reader.join(120)
        assert not reader.is_alive()
        wait_for(lambda: _slots(board) == [0, 0], 10, what="the engine's slot idle again after the request")
    finally:
        group.close()
