"""Small API surfaces a client reaches for: ``models.retrieve``, CORS (off by default,
on with ``--allowed-origins``), and a frontend refusing an engine that serves another
model than the one it tokenizes for."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.procs import ProcessGroup, free_port, wait_for, wait_healthy

ORIGIN = "https://app.example"


@dataclass
class Stack:
    base: str  # CORS off (the default)
    cors: str  # --allowed-origins ORIGIN
    run: Path
    group: ProcessGroup


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))  # short: ipc paths are limited to ~100 bytes
    group = ProcessGroup(tmp_path_factory.mktemp("gaps"))
    group.engine(tiny_model_dir, run, max_batch_size=4)
    port, cors_port = free_port(), free_port()
    group.frontend(tiny_model_dir, run, port)
    group.frontend(tiny_model_dir, run, cors_port, allowed_origins=ORIGIN)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 120)
        wait_healthy(f"http://127.0.0.1:{cors_port}", 60)
        yield Stack(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{cors_port}", run, group)
    except TimeoutError:
        raise AssertionError("stack did not start:\n" + "\n".join(p.output()[-3000:] for p in group.procs))
    finally:
        group.close()
        shutil.rmtree(run, ignore_errors=True)


def test_models_retrieve(stack, tiny_model_dir):
    client = OpenAI(base_url=f"{stack.base}/v1", api_key="unused", max_retries=0, timeout=30)
    model = client.models.retrieve(tiny_model_dir.name)
    assert model.id == tiny_model_dir.name and model.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"


PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_cors_is_off_by_default(stack):
    pre = httpx.options(f"{stack.base}/v1/completions", headers=PREFLIGHT)
    assert pre.status_code == 405
    got = httpx.get(f"{stack.base}/v1/models", headers={"Origin": ORIGIN})
    assert got.status_code == 200 and "access-control-allow-origin" not in got.headers


def test_cors_with_allowed_origins(stack):
    pre = httpx.options(f"{stack.cors}/v1/completions", headers=PREFLIGHT)
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    got = httpx.post(f"{stack.cors}/v1/completions", headers={"Origin": ORIGIN},
                     json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert got.status_code == 200 and got.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{stack.cors}/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_version_and_stats_show_the_runtime_and_transport(stack):
    runtime = httpx.get(f"{stack.base}/version").json()["runtime"]
    assert runtime["transport"] == "shm+zmq ipc" and runtime["dtype"] == "float32"
    assert runtime["device"] == "cpu" and runtime["torch_threads"] == 1
    assert len(runtime["model_fingerprint"]) == 16
    assert httpx.get(f"{stack.base}/scheduler/stats").json()["runtime"] == runtime
    startup = stack.group.procs[0].output()  # the engine's start-up line says the same
    assert "dtype float32" in startup and "transport shm+zmq ipc" in startup and "1 thread" in startup


def test_a_copy_of_the_same_model_elsewhere_is_accepted(stack, tiny_model_dir, tmp_path):
    copy = tmp_path / "elsewhere" / tiny_model_dir.name
    shutil.copytree(tiny_model_dir, copy)
    port = free_port()
    proc = stack.group.frontend(copy, stack.run, port)
    wait_healthy(f"http://127.0.0.1:{port}", 60)
    proc.stop()


def test_frontend_refuses_an_engine_serving_another_model(stack, tiny_model_dir, tmp_path):
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 1  # another model, same tokenizer
    (other / "config.json").write_text(json.dumps(config))
    port = free_port()
    proc = stack.group.frontend(other, stack.run, port)
    wait_for(lambda: not proc.alive(), 60, what="the frontend to exit")
    assert proc.popen.returncode == 2
    assert "the engine serves another model" in proc.output()
    assert httpx.get(f"{stack.base}/health").status_code == 200  # the engine and others are unharmed


def test_stats_names_say_what_they_count(stack):
    s = httpx.get(f"{stack.base}/scheduler/stats").json()
    assert "kv_pressure" in s and "kv_pressure" not in s["blocks"]  # once
    assert {"prefix_query_tokens", "prefix_hit_tokens"} <= set(s["blocks"])
    assert "prefix_queries" not in s["blocks"]


def test_rejection_counter_exists_before_the_first_rejection(stack):
    text = httpx.get(f"{stack.cors}/metrics").text  # this frontend never had a rejection
    for code in ("queue_full", "kv_budget", "block_pool", "context_length"):
        assert f'tickserve_requests_rejected_total{{code="{code}"}} 0.0' in text
