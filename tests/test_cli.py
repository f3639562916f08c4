"""The tickserve command line: the model as a positional argument, help texts a user can read."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import REPO, ProcessGroup, _env, free_port, http_json, wait_healthy


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_serve_takes_the_model_positionally(tmp_path, tiny_model_dir):
    port = free_port()
    group = ProcessGroup(tmp_path)
    try:
        group.spawn(["-m", "shared.cli", "serve", str(tiny_model_dir), "--port", str(port),
                     "--device", "cpu", "--torch-threads", "1", "--data-parallel-size", "1", "--log-level", "warning"], "serve")
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, timeout=120)
        status, body, _ = http_json(f"{base}/v1/models")
        assert status == 200 and body["data"][0]["id"] == tiny_model_dir.name
    finally:
        group.close()


def test_a_missing_positional_model_is_a_one_line_error():
    done = _cli("serve", "/no/such/model.gguf", "--port", str(free_port()))
    assert done.returncode == 2
    assert "unrecognized arguments" not in done.stderr
    assert "does not exist" in done.stderr and "Traceback" not in done.stderr


def test_two_different_models_are_refused():
    done = _cli("serve", "/a", "--model", "/b")
    assert done.returncode == 2 and "two models given" in done.stderr


def test_help_speaks_plainly():
    top = _cli("--help")
    assert top.returncode == 0 and "serve [MODEL]" in top.stdout
    assert "``" not in top.stdout  # no reStructuredText markup
    serve = _cli("serve", "--help")
    assert serve.returncode == 0 and "MODEL" in serve.stdout
    for internal in ("_pending", "_active", "_prefilling"):
        assert internal not in serve.stdout
    assert "MAX_QUEUE_SIZE" in serve.stdout and "wait" in serve.stdout


def test_make_run_refuses_a_port_in_use_in_one_line(tmp_path):
    """``make run``'s script checks the port before it starts anything."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = subprocess.run(["bash", str(REPO / "tools" / "run_and_demo.sh")], cwd=REPO, capture_output=True,
                              text=True, timeout=60,
                              env={**_env(), "PORT": str(port), "HOST": "127.0.0.1", "PY": sys.executable})
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert "make run PORT=" in done.stderr
