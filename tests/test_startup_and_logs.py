"""What ``tickserve serve`` says while it starts, serves and stops: a configuration under
which nothing could be admitted is refused in one line, one ready line once every engine
is warm, one log line per request, a stats line while there is work, no warning on a
normal start, and an idle stop in under a second."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import REPO, _env, free_port


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_a_pool_too_small_for_one_full_context_request_is_refused_in_one_line(tiny_model_dir):
    done = _cli("serve", str(tiny_model_dir), "--port", str(free_port()), "--device", "cpu",
                "--kv-num-blocks", "1")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "--kv-num-blocks 1" in lines[0] and "at least 128 blocks" in lines[0] and "--max-model-len 2048" in lines[0]
    assert "tickserve starting" not in done.stdout


def test_the_engine_alone_refuses_it_too(tiny_model_dir, tmp_path):
    done = subprocess.run([sys.executable, "-m", "engine_proc", "--model", str(tiny_model_dir), "--device", "cpu",
                           "--run-dir", str(tmp_path), "--kv-num-blocks", "4", "--max-model-len", "128",
                           "--kernels", "torch"],
                          env=_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 78, done.stderr[-2000:]
    assert "--kv-num-blocks 4 holds 64 tokens" in done.stderr and "at least 8 blocks" in done.stderr
