"""The low-bit/dense crossover is measured once per host: engines that start together
read one answer (engine_proc.backends.crossover_cache)."""

from __future__ import annotations

import json
import multiprocessing
import time

from engine_proc.backends import crossover_cache as cc

PARTS = ("1536", "576", "torch.bfloat16", "Q4_1×210", "avx512vnni", "1")


def test_measured_once_then_read(tmp_path, monkeypatch):
    monkeypatch.setenv("TICKSERVE_CACHE_DIR", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return 32

    assert cc.host_crossover(measure, PARTS) == 32
    assert cc.host_crossover(lambda: 999, PARTS) == 32  # read back: not measured again
    assert len(calls) == 1
    path = cc.crossover_path(PARTS)
    assert path.parent == tmp_path / "kernels" and json.loads(path.read_text())["quantized_below"] == 32
    assert cc.host_crossover(lambda: 128, PARTS[:-1] + ("2",)) == 128  # another key: its own answer


def test_a_damaged_entry_is_measured_again_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("TICKSERVE_CACHE_DIR", str(tmp_path))
    path = cc.crossover_path(PARTS)
    path.parent.mkdir(parents=True)
    for damage in ("{not json", json.dumps({"quantized_below": 0}), json.dumps({"quantized_below": True}),
                   json.dumps([1, 2]), ""):
        path.write_text(damage)
        assert cc.host_crossover(lambda: 8, PARTS) == 8
        assert json.loads(path.read_text())["quantized_below"] == 8


def test_an_unwritable_cache_only_costs_the_measurement(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TICKSERVE_CACHE_DIR", str(blocker))  # kernels/ cannot be made under a file
    assert cc.host_crossover(lambda: 256, PARTS) == 256


def _engine(cache_dir: str, log: str, out) -> None:
    import os

    os.environ["TICKSERVE_CACHE_DIR"] = cache_dir

    def measure():
        with open(log, "a") as f:
            f.write("measured\n")
        time.sleep(0.3)  # long enough that the other process arrives while it runs
        return os.getpid()  # each process would answer differently if it measured

    out.put(cc.host_crossover(measure, PARTS))


def test_engines_starting_together_measure_once_and_agree(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    log = tmp_path / "log"
    procs = [ctx.Process(target=_engine, args=(str(tmp_path / "cache"), str(log), out)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    answers = [out.get(timeout=5) for _ in procs]
    assert len(set(answers)) == 1
    assert log.read_text().count("measured") == 1
