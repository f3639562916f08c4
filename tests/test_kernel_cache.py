"""The kernel cache heals itself (finding 2 of issue 21): a build is found without a
compiler, a damaged or foreign library is rebuilt instead of crashing ``dlopen``, an
unwritable cache falls back to torch ops with one warning, two processes build once,
and clang builds the kernels."""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
import torch

from engine_proc.kernels import CKernels, TorchKernels, select_kernels
from engine_proc.kernels.build import KernelShape, KernelsUnavailable, build
from shared import native_build
from shared.native_build import build_source

pytestmark = pytest.mark.skipif(native_build.compiler() is None or not sys.platform.startswith("linux"),
                                reason="needs a C compiler on Linux")

SOURCE = "int tickserve_answer(void) { return 42; }\n"
FLAGS = ("-O2", "-fPIC", "-shared")


def _command(cc, clang, src, out):
    return [cc, *FLAGS, src, "-o", out]


def _answer(path: Path) -> int:
    return ctypes.CDLL(str(path)).tickserve_answer()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TICKSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def _library(symbols=("tickserve_answer",)) -> Path:
    return native_build.cached_library("answer", SOURCE.encode(), FLAGS, symbols, _command)


def test_a_cached_build_is_found_without_a_compiler(cache, monkeypatch):
    lib = _library()
    entry = native_build.entry_of(lib)
    assert entry["symbols"] == ["tickserve_answer"] and entry["size"] == lib.stat().st_size
    assert entry["cpu"].startswith(("cpuid ", "cpuinfo ")) and "march" in entry["target"] + "cpu="
    monkeypatch.setattr(native_build, "compiler", lambda: pytest.fail("the compiler ran on a cache hit"))
    monkeypatch.setattr(native_build.subprocess, "run", lambda *a, **k: pytest.fail("a process ran on a hit"))
    assert _library() == lib and _answer(lib) == 42


def test_the_key_follows_the_cpu_and_the_source_not_the_compiler(monkeypatch):
    key = native_build.lookup_key("answer", SOURCE.encode(), FLAGS)
    monkeypatch.setenv("CC", "clang")
    assert native_build.lookup_key("answer", SOURCE.encode(), FLAGS) == key
    assert native_build.lookup_key("answer", SOURCE.encode() + b" ", FLAGS) != key
    assert native_build.lookup_key("answer", SOURCE.encode(), FLAGS + ("-O3",)) != key
    monkeypatch.setattr(native_build, "_signature", native_build.cpu_signature() + " avx512f-gone")
    assert native_build.lookup_key("answer", SOURCE.encode(), FLAGS) != key
    if os.uname().machine == "x86_64":
        assert native_build._cpuid_signature().startswith("cpuid ")  # read from CPUID itself


@pytest.mark.parametrize("damage", ["truncated", "empty", "foreign", "entry"])
def test_a_damaged_or_foreign_library_is_rebuilt_before_it_is_loaded(cache, caplog, damage):
    lib = _library()
    good = lib.read_bytes()
    if damage == "truncated":  # dlopen of this died of SIGBUS
        lib.write_bytes(good[: len(good) // 3])
    elif damage == "empty":
        lib.write_bytes(b"")
    elif damage == "foreign":  # a real library under the name, its entry rewritten to match
        other = build_source("other", "int something_else(void) { return 1; }\n")
        shutil.copy(other, lib)
        entry = native_build.entry_of(lib)
        data = lib.read_bytes()
        entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
        lib.with_suffix(".json").write_text(json.dumps(entry))
    else:
        lib.with_suffix(".json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="shared.native_build"):
        assert _library() == lib
    assert "rebuilding" in caplog.text
    assert native_build._check(lib, lib.with_suffix(".json"), ["tickserve_answer"]) is None
    assert len(lib.read_bytes()) == len(good) and _answer(lib) == 42


def test_elf_checks_name_what_is_wrong(tmp_path):
    path = tmp_path / "x.so"
    path.write_bytes(b"#!/bin/sh\n" * 10)
    assert native_build.elf_problem(path, ()) == "is not an ELF file"
    good = build_source("answer_elf", SOURCE)
    assert native_build.elf_problem(good, ("tickserve_answer",)) is None
    assert "lacks the functions decode_attention" in native_build.elf_problem(good, ("decode_attention",))
    path.write_bytes(good.read_bytes()[:200])
    assert "truncated" in native_build.elf_problem(path, ())


def test_an_unwritable_cache_falls_back_to_torch_ops_with_one_warning(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache should be")
    monkeypatch.setenv("TICKSERVE_CACHE_DIR", str(blocker))
    with pytest.raises(KernelsUnavailable, match="cannot be written"):
        build(KernelShape(torch.float32, 64, 2, 16))
    with caplog.at_level(logging.WARNING):
        kernels = select_kernels(torch.device("cpu"), torch.float32, 64, 2, 16)
    assert isinstance(kernels, TorchKernels) and not isinstance(kernels, CKernels)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "using torch ops" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()


def test_a_truncated_kernel_library_is_rebuilt_and_the_c_kernels_load(cache):
    shape = KernelShape(torch.float32, 64, 2, 16)
    lib = build(shape)
    lib.write_bytes(lib.read_bytes()[:4096])
    kernels = select_kernels(torch.device("cpu"), torch.float32, 64, 2, 16)
    assert isinstance(kernels, CKernels)
    x = torch.randn(3, 64)
    w = torch.randn(64)
    torch.testing.assert_close(kernels.add_rms_norm(x, None, w, 1e-5), TorchKernels.add_rms_norm(kernels, x, None, w, 1e-5))


def _build_in_child(root: str) -> str:
    os.environ["TICKSERVE_CACHE_DIR"] = root
    return str(_library())


def test_two_processes_starting_at_once_build_once(tmp_path, monkeypatch):
    """The second waits on the lock for the first's build instead of compiling it too."""
    log = tmp_path / "cc.log"
    cc = tmp_path / "slow-cc"
    real = native_build.compiler()
    cc.write_text(f'#!/bin/sh\ncase "$*" in *-shared*) echo build >> {log}; sleep 1;; esac\nexec {real} "$@"\n')
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        paths = pool.map_async(_build_in_child, [str(tmp_path / "cache")] * 2).get(timeout=120)
    assert paths[0] == paths[1] and _answer(Path(paths[0])) == 42
    assert log.read_text().split() == ["build"]
    assert sorted(p.name.split(".", 1)[1] for p in Path(paths[0]).parent.iterdir()) == ["json", "lock", "so"]


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is not installed")
def test_clang_builds_the_kernels_or_is_refused_in_one_line(tmp_path, monkeypatch):
    """``__builtin_shuffle`` is GCC's alone: CC=clang used to fail on every build."""
    monkeypatch.setenv("TICKSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "clang")
    try:
        kernels = CKernels(torch.float32, 64, 2, 16, num_threads=2)
    except KernelsUnavailable as exc:  # clang without LLVM's OpenMP runtime
        assert "\n" not in str(exc) and "libomp" in str(exc)
        return
    assert native_build.entry_of(build(KernelShape(torch.float32, 64, 2, 16)))["clang"]
    gate_up = torch.randn(5, 256)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), TorchKernels.silu_and_mul(kernels, gate_up),
                               rtol=1e-5, atol=1e-5)
    logits = torch.randn(4, 1000)
    assert torch.equal(kernels.argmax(logits), logits.argmax(-1))  # the shuffles' horizontal maximum


def test_a_build_says_so_once_and_a_hit_says_nothing(cache, caplog):
    """The first start on a host names the build (it used to go quiet for seconds); later
    starts find the library without a line."""
    with caplog.at_level(logging.INFO, logger="shared.native_build"):
        native_build.cached_library("answer", SOURCE.encode(), FLAGS, ("tickserve_answer",), _command,
                                    what="building the answer (first start on this host)")
    assert [r.getMessage() for r in caplog.records if "building" in r.getMessage()] == [
        "building the answer (first start on this host)"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shared.native_build"):
        _library()
    assert not caplog.records


def test_a_process_that_waits_for_another_s_build_says_so(cache, caplog):
    import fcntl
    import threading

    cache.mkdir(parents=True)
    key = native_build.lookup_key("answer", SOURCE.encode(), FLAGS)
    holder = open(cache / f"answer-{key}.lock", "a")  # another process's build, for half a second
    fcntl.flock(holder, fcntl.LOCK_EX)
    release = threading.Timer(0.5, lambda: fcntl.flock(holder, fcntl.LOCK_UN))
    release.start()
    try:
        with caplog.at_level(logging.INFO, logger="shared.native_build"):
            _library()
    finally:
        release.join()
        holder.close()
    waits = [r for r in caplog.records if "another process is building answer" in r.getMessage()]
    assert len(waits) == 1 and waits[0].levelno == logging.INFO
