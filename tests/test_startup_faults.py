"""Start-up faults that a restart cannot heal stop at once, in one line, exit 78; the
others are still restarted with backoff (finding 1 of issue 21: a truncated
model.safetensors gave 10 tracebacks in 90 s and never exited)."""

from __future__ import annotations

import errno
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from shared import startup_faults as sf
from shared.supervisor import Supervisor
from tests.procs import REPO, _env, free_port


@pytest.fixture
def model_copy(tmp_path, tiny_model_dir) -> Path:
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    return d


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_a_good_directory_passes_and_each_broken_file_is_named(model_copy, tmp_path):
    sf.check_model_dir(model_copy)
    weights = model_copy / "model.safetensors"
    _truncate(weights)
    with pytest.raises(sf.StartupFault) as fault:
        sf.check_model_dir(model_copy)
    assert fault.value.path == str(weights) and "truncated" in fault.value.problem
    sf.check_model_dir(model_copy, weights=False)  # the frontend does not read the weights
    weights.write_bytes(b"\x00" * 3)
    with pytest.raises(sf.StartupFault, match="not a safetensors file"):
        sf.check_model_dir(model_copy)
    weights.unlink()
    with pytest.raises(sf.StartupFault, match="has no weights"):
        sf.check_model_dir(model_copy)

    tok = tmp_path / "tok"
    shutil.copytree(model_copy, tok)
    _truncate(tok / "tokenizer.json")
    with pytest.raises(sf.StartupFault, match="tokenizer.json: is not valid JSON"):
        sf.check_model_dir(tok, weights=False)
    for f in tok.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(sf.StartupFault, match="has no tokenizer files"):
        sf.check_model_dir(tok, weights=False)
    sf.check_model_dir(tok, weights=False, tokenizer=False)  # the engine needs none

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"\x9d\x9c" * 1000)
    with pytest.raises(sf.StartupFault, match="not a GGUF file"):
        sf.check_gguf(gguf)
    gguf.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + b"\0" * 100)
    with pytest.raises(sf.StartupFault, match="GGUF version 7"):
        sf.check_gguf(gguf)


def test_classify_tells_faults_of_the_files_from_transient_failures(model_copy):
    for transient in (MemoryError(), RuntimeError("worker killed"), OSError(errno.ENOSPC, "No space left")):
        assert sf.classify(transient, model_copy) is None
    fault = sf.classify(ValueError("Unrecognized model in /m. Should have a `model_type` key"), model_copy)
    assert fault is not None and fault.path == str(model_copy) and "Unrecognized model" in fault.problem
    assert sf.classify(ImportError("needs the sentencepiece library"), model_copy) is not None
    _truncate(model_copy / "model.safetensors")
    fault = sf.classify(RuntimeError("anything"), model_copy)  # the header checks name the file
    assert fault is not None and fault.path.endswith("model.safetensors")


def _child(code: int):
    return SimpleNamespace(name="engine 0", proc=SimpleNamespace(returncode=code), started=0.0, backoff=0.5,
                           restart_at=None)


def test_the_supervisor_stops_on_a_fault_and_restarts_anything_else_with_backoff():
    sup = Supervisor.__new__(Supervisor)
    sup.stopping, sup.exit_code = False, 0
    crashed = _child(1)
    sup._exited(crashed, now=10.0)
    assert not sup.stopping and crashed.restart_at == 10.5 and crashed.backoff == 1.0
    sup._exited(crashed, now=11.0)
    assert crashed.restart_at == 12.0 and crashed.backoff == 2.0
    for code in (sf.EXIT_CONFIG, 2):
        sup.stopping = False
        sup._exited(_child(code), now=20.0)
        assert sup.stopping and sup.exit_code == code


def _run(*args: str, timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, *args], env=_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    return done, time.monotonic() - t0


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def test_serve_stops_in_one_line_on_a_truncated_model(model_copy):
    _truncate(model_copy / "model.safetensors")
    served, took = _run("-m", "shared.cli", "serve", str(model_copy), "--port", str(free_port()))
    assert served.returncode == 78 and took < 10, served.stderr
    assert "model.safetensors: is truncated" in _one_line(served.stderr) and served.stdout == ""


def test_the_engine_and_the_frontend_stop_with_one_logged_line(model_copy, tmp_path, caplog):
    """Each child, as a supervisor starts it should the files change under it (in this process)."""
    import torch

    from engine_proc.engine import run_engine
    from frontend.server import run_frontend
    from shared import config as cfg

    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(model_copy, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*"))
    unknown = tmp_path / "unknown"  # passes the header checks; transformers refuses the model type
    shutil.copytree(model_copy, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no-such-architecture"}))
    run = tmp_path / "run"
    run.mkdir()
    engine = cfg.build(cfg.EngineConfig, model=str(unknown), run_dir=str(run), device="cpu",
                       torch_threads=torch.get_num_threads())
    with caplog.at_level(logging.ERROR):
        assert run_engine(engine) == sf.EXIT_CONFIG
        assert run_frontend(cfg.build(cfg.FrontendConfig, model=str(no_tokenizer), run_dir=str(run))) \
            == sf.EXIT_CONFIG
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2 and not any(r.exc_info for r in errors)
    engine_line, frontend_line = (r.getMessage() for r in errors)
    assert "engine cannot start" in engine_line and "no-such-architecture" in engine_line
    assert "has no tokenizer files" in frontend_line and "sentencepiece" not in frontend_line
    assert "\n" not in engine_line + frontend_line
