"""The tickserve command line: the model as a positional argument, help texts a user can read."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from shared.marked_dirs import is_marked, make_marked_dir, remove_marked
from tests.procs import REPO, ProcessGroup, _env, free_port, http_json, wait_healthy


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_serve_takes_the_model_positionally_and_leaves_the_run_dir_s_files_alone(tmp_path, tiny_model_dir):
    """Also: ``--run-dir DIR`` used to remove ``DIR/metrics`` (a user's dashboard went with
    it); the metrics directory is now one tickserve made and marked, gone after the stop."""
    port = free_port()
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))  # ipc socket paths must stay short
    dashboard = run / "metrics" / "grafana" / "dashboard.json"
    dashboard.parent.mkdir(parents=True)
    dashboard.write_text('{"title": "mine"}')
    group = ProcessGroup(tmp_path)
    try:
        serve = group.spawn(["-m", "shared.cli", "serve", str(tiny_model_dir), "--port", str(port), "--run-dir",
                             str(run), "--device", "cpu", "--torch-threads", "1", "--data-parallel-size", "1",
                             "--log-level", "warning"], "serve")
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, timeout=120)
        status, body, _ = http_json(f"{base}/v1/models")
        assert status == 200 and body["data"][0]["id"] == tiny_model_dir.name
        made = [d for d in run.iterdir() if d.name.startswith("metrics-")]
        assert len(made) == 1 and is_marked(str(made[0]))
        assert serve.stop(30) == 0
        assert dashboard.read_text() == '{"title": "mine"}'
        assert not made[0].exists()
    finally:
        group.close()
        shutil.rmtree(run, ignore_errors=True)


def test_a_directory_without_the_marker_is_never_removed(tmp_path):
    user = tmp_path / "metrics-mine"
    (user / "keep").mkdir(parents=True)
    assert not remove_marked(str(user)) and (user / "keep").exists()
    made = Path(make_marked_dir(str(tmp_path), "metrics-", "test"))
    link = tmp_path / "metrics-link"
    link.symlink_to(made)
    assert not remove_marked(str(link)) and made.exists()  # a link to a marked directory is not one
    assert remove_marked(str(made)) and not made.exists()


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
