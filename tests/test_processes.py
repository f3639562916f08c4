"""Real engine and frontend processes on the tiny model, over real ipc sockets."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.procs import REPO, both_carriers, http_json, start_stack, stats, wait_for

carrier = both_carriers()  # every test here runs over shared memory and over ZeroMQ



@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))  # short: ipc paths are limited to ~100 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _stack(tmp: Path, model_dir: Path, **engine_options):
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    group, base = start_stack(tmp, model_dir, run, **engine_options)
    return group, run, base


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    group, run, base = _stack(tmp_path_factory.mktemp("stack"), tiny_model_dir, max_batch_size=4)
    yield run, base
    group.close()
    shutil.rmtree(run, ignore_errors=True)


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory, tiny_model_dir):
    group, run, base = _stack(tmp_path_factory.mktemp("small"), tiny_model_dir,
                              max_batch_size=1, max_queue_size=1, kv_budget_tokens=512)
    yield run, base
    group.close()
    shutil.rmtree(run, ignore_errors=True)


def _baseline(base: str) -> bool:
    s = stats(base)
    return (s["num_active"] == 0 and s["num_pending"] == 0 and s["num_prefilling"] == 0
            and s["active_kv_reserved"] == 0 and s["blocks"]["num_used_blocks"] == 0
            and s["num_waiting"] == 0)


def test_zmq_client_script_talks_to_engine_directly(stack):
    run, base = stack
    out = subprocess.run([sys.executable, str(REPO / "tools" / "zmq_client.py"), "--run-dir", str(run),
                          "--token-ids", "1,400,9000,77", "--max-tokens", "7", "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["accepted"] and result["finish_reason"] == "length"
    assert len(result["token_ids"]) == 7 and result["ttft_s"] > 0


def test_stream_and_non_stream_agree(stack):
    _, base = stack
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, full, _ = http_json(f"{base}/v1/completions", body)
    assert status == 200, full
    assert full["usage"]["completion_tokens"] == 12 and full["choices"][0]["finish_reason"] == "length"
    deltas = []
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        deltas.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(deltas) == full["choices"][0]["text"]
    assert len(deltas) > 1  # tokens arrive one by one, not in one lump


def test_prometheus_metrics_count_what_was_served(stack):
    _, base = stack
    before = httpx.get(f"{base}/metrics", timeout=10).text
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "count me", "max_tokens": 5, "ignore_eos": True},
                   timeout=30)
    assert r.status_code == 200
    after = httpx.get(f"{base}/metrics", timeout=10)
    assert after.status_code == 200 and after.headers["content-type"].startswith("text/plain")

    def value(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    text = after.text
    assert value(text, "tickserve_generation_tokens_total") - value(before, "tickserve_generation_tokens_total") == 5
    assert value(text, "tickserve_time_to_first_token_seconds_count") >= 1
    itl_samples = value(text, "tickserve_inter_token_latency_seconds_count")
    assert itl_samples >= 1
    assert 'tickserve_requests_finished_total{finish_reason="length"}' in text
    assert value(text, "tickserve_engine_up") == 1.0


def test_client_disconnect_aborts_and_frees_the_row(stack):
    _, base = stack
    aborted_before = stats(base)["num_aborted"]
    body = {"prompt": "tell me everything", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as resp:
        got = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got == 3:
                break
    wait_for(lambda: _baseline(base), 15, what="engine back at baseline after disconnect")
    after = stats(base)
    assert after["num_aborted"] == aborted_before + 1, after  # aborted, not run to max_tokens


def test_client_mistakes_get_openai_shaped_400_and_leave_no_trace(stack):
    _, base = stack
    cases = [
        {"prompt": "x", "temperature": 7},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "max_tokens": 100_000},
        {"prompt": [], "max_tokens": 3},
        {"prompt": [10**9], "max_tokens": 3},
        {"max_tokens": 3},
    ]
    for body in cases:
        status, payload, _ = http_json(f"{base}/v1/completions", body)
        assert status == 400, (body, payload)
        assert set(payload["error"]) == {"message", "type", "param", "code"} and payload["error"]["message"]
    req = httpx.post(f"{base}/v1/completions", content=b"{not json", timeout=10,
                     headers={"content-type": "application/json"})
    assert req.status_code == 400 and "JSON" in req.json()["error"]["message"]
    assert _baseline(base)


def test_queue_full_is_a_real_429_before_any_sse_byte(small_stack):
    """max_batch_size=1, max_queue_size=1: one running, one waiting, the third is refused."""
    _, base = small_stack
    body = {"prompt": "hold the line", "max_tokens": 300, "ignore_eos": True, "stream": True}
    client = httpx.Client(timeout=30)
    held = []
    try:
        for _ in range(2):
            resp = client.send(client.build_request("POST", f"{base}/v1/completions", json=body), stream=True)
            assert resp.status_code == 200
            held.append(resp)
        wait_for(lambda: stats(base)["num_waiting"] == 1, 10, what="one request waiting")
        third = client.post(f"{base}/v1/completions", json=body)
        assert third.status_code == 429
        assert third.headers["content-type"].startswith("application/json")
        assert third.headers["retry-after"]
        assert third.json()["error"]["code"] == "queue_full"
    finally:
        for resp in held:
            resp.close()
        client.close()
    wait_for(lambda: _baseline(base), 15, what="baseline after the held streams closed")


def test_request_that_can_never_fit_is_hard_rejected_with_reason(small_stack):
    _, base = small_stack
    status, payload, headers = http_json(f"{base}/v1/completions",
                                         {"prompt": "big", "max_tokens": 600, "stream": True})
    assert status == 429, payload
    assert payload["error"]["code"] == "kv_budget" and "512" in payload["error"]["message"]
    # waiting cannot help: it says so, and no Retry-After invites a client to try again
    assert "never" in payload["error"]["message"] and "retry-after" not in {k.lower() for k in headers}
    assert _baseline(base)
