"""``tickserve serve --prefill-mode disaggregated`` with real processes on the tiny model:
one prefill and one decode engine, rows handed over through the run directory; greedy
tokens equal an in-process monolithic engine's; kill -9 of either engine fails only what
it held, it is restarted, and nothing leaks on the other side."""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import make_request, make_scheduler, run_until_idle, tokens_of
from tests.procs import ProcessGroup, cmdline, children_running, free_port, http_json, stats, wait_for

pytestmark = pytest.mark.slow


def _tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 40000) for _ in range(n)]


def _roles_up(base: str) -> bool:
    s = stats(base)
    return s.get("num_engines_up") == 2 and sorted(e.get("role") for e in s["engines"]) == ["decode", "prefill"]


@pytest.fixture(scope="module")
def disagg(tmp_path_factory, tiny_model_dir):
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))  # short: ipc paths are limited to ~100 bytes
    group = ProcessGroup(tmp_path_factory.mktemp("disagg"))
    port = free_port()
    proc = group.spawn(["-m", "shared.cli", "serve", str(tiny_model_dir), "--port", str(port), "--run-dir", str(run),
                        "--prefill-mode", "disaggregated", "--prefill-engines", "1", "--decode-engines", "1",
                        "--device", "cpu", "--dtype", "float32", "--torch-threads", "1", "--max-batch-size", "8",
                        "--prefill-chunk-size", "16", "--log-level", "warning"], "serve")
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_for(lambda: _roles_up(base), 180, 0.3, "a prefill and a decode engine up")
        except TimeoutError:
            raise AssertionError("serve did not start:\n" + proc.output()[-4000:])
        yield proc, base
    finally:
        group.close()
        shutil.rmtree(run, ignore_errors=True)


def _complete(base: str, prompt, **kw) -> list[list[int]]:
    status, body, _ = http_json(f"{base}/v1/completions", {
        "prompt": prompt, "temperature": 0, "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True,
        **kw}, timeout=120)
    assert status == 200, body
    return [[int(t.split(":", 1)[1]) for t in c["logprobs"]["tokens"]] for c in body["choices"]]


def _engine_pid(serve, role: str) -> int:
    pids = [p for p in children_running(serve.popen.pid, "engine_proc") if f"--role {role} " in cmdline(p) + " "]
    assert len(pids) == 1, pids
    return pids[0]


def test_greedy_tokens_equal_monolithic_and_stats_show_the_roles(disagg, tiny_model_dir):
    serve, base = disagg
    shared = _tokens(1, 40)
    prompts = [shared + _tokens(2, 9), shared + _tokens(3, 30), _tokens(4, 70), _tokens(5, 5)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(lambda p: _complete(base, p, max_tokens=12)[0], prompts))
    two = _complete(base, prompts[0], max_tokens=6, n=2)  # n siblings are handed over one by one
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype="float32").eval()
    reqs = [make_request(p, max_tokens=12, ignore_eos=True) for p in prompts]
    outs = run_until_idle(make_scheduler(model, prefill_mode="chunked", prefill_chunk_size=16), {0: reqs})
    assert served == [tokens_of(outs[r.request_id]) for r in reqs]
    assert two == [tokens_of(outs[reqs[0].request_id])[:6]] * 2
    s = stats(base)
    by_role = {e["role"]: e for e in s["engines"]}
    assert by_role["decode"]["handovers"]["count"] >= 6 and by_role["decode"]["handovers"]["bytes"] > 0
    assert by_role["decode"]["handovers"]["time_p50_ms"] is not None
    assert by_role["prefill"]["handovers"]["count"] >= 6
    assert s["roles"] == {"decode": 1, "prefill": 1} and s["handovers"]["count"] >= 6
    assert httpx.get(f"{base}/version", timeout=10).json()["runtime"]["prefill_mode"] == "disaggregated"
    # a stop string (the frontend's: it aborts the row, wherever it decodes)
    status, body, _ = http_json(f"{base}/v1/completions", {"prompt": prompts[1], "max_tokens": 12,
                                                           "temperature": 0, "ignore_eos": True}, timeout=120)
    text = body["choices"][0]["text"]
    stop = next(text[i: i + 3] for i in range(len(text) // 2, len(text) - 2) if text[i: i + 3].strip())
    status, body, _ = http_json(f"{base}/v1/completions", {"prompt": prompts[1], "max_tokens": 12,
                                                           "temperature": 0, "ignore_eos": True, "stop": [stop]},
                                timeout=120)
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == text[:text.index(stop)]
    decode_id = by_role["decode"]["engine_id"]
    deadline = time.monotonic() + 10  # /metrics reads the engines' last heartbeat: it may lag a moment
    while True:
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        count = next((float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith(f'tickserve_handovers_total{{engine="{decode_id}",role="decode"}}')), 0)
        if count >= 6 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert f'tickserve_engine_info{{engine="{decode_id}",role="decode"}} 1.0' in metrics
    assert count >= 6
    assert f'tickserve_handover_time_ms{{engine="{decode_id}",quantile="0.99",role="decode"}}' in metrics
    assert "tickserve_engine_kv_pressure_by_engine{" in metrics
    for e in s["engines"]:
        assert e["runtime"]["role"] == e["role"]
        for field in ("kv_pressure", "active_kv_reserved", "kv_admit_blocked"):
            assert field in e


def _long_stream(base: str):
    stream = httpx.stream("POST", f"{base}/v1/completions", json={
        "prompt": _tokens(9, 20), "max_tokens": 900, "ignore_eos": True, "stream": True}, timeout=60)
    resp = stream.__enter__()
    lines = resp.iter_lines()
    first = [next(lines) for _ in range(3)]
    return stream, lines, first


def test_killed_decode_engine_fails_its_rows_is_restarted_and_prefill_leaks_nothing(disagg):
    serve, base = disagg
    stream, lines, first = _long_stream(base)
    old = _engine_pid(serve, "decode")
    t0 = time.monotonic()
    import os

    os.kill(old, signal.SIGKILL)
    rest = [line for line in lines if line]
    stream.__exit__(None, None, None)
    assert time.monotonic() - t0 < 10
    assert rest[-1] == "data: [DONE]" and any('"error"' in e for e in rest)
    wait_for(lambda: _engine_pid(serve, "decode") != old and _roles_up(base), 120, 0.3, "the decode engine back")
    wait_for(lambda: _complete(base, _tokens(10, 8), max_tokens=4), 60, 0.5, "a request served after the restart")
    prefill = next(e for e in stats(base)["engines"] if e["role"] == "prefill")
    assert prefill["active_kv_reserved"] == 0 and prefill["num_active"] == 0 and prefill["num_prefilling"] == 0
    assert prefill["blocks"]["num_used_blocks"] == 0


def test_killed_prefill_engine_leaves_decoding_rows_streaming(disagg):
    serve, base = disagg
    stream, lines, first = _long_stream(base)
    old = _engine_pid(serve, "prefill")
    import os

    os.kill(old, signal.SIGKILL)
    rest = [line for line in lines if line]
    stream.__exit__(None, None, None)
    assert rest[-1] == "data: [DONE]" and not any('"error"' in e for e in rest)
    events = [json.loads(e[len("data: "):]) for e in first + rest if e.startswith("data: {")]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")] == ["length"]
    wait_for(lambda: _engine_pid(serve, "prefill") != old and _roles_up(base), 120, 0.3, "the prefill engine back")
    assert wait_for(lambda: _complete(base, _tokens(11, 8), max_tokens=4), 60, 0.5, "served after the restart")
    decode = next(e for e in stats(base)["engines"] if e["role"] == "decode")
    wait_for(lambda: next(e for e in stats(base)["engines"] if e["role"] == "decode")["active_kv_reserved"] == 0,
             30, 0.3, "the decode engine empty")
    assert decode["handovers"]["held"] == 0


def test_engines_across_hosts_hand_over_on_tcp(tmp_path, tiny_model_dir):
    """``tickserve engine --role decode --handover-addr tcp://…`` and ``--role prefill
    --decode-engines tcp://…`` (the across-hosts layout, on loopback): a frontend given
    both engines gets the tokens an in-process monolithic engine computes, every row
    handed over by ZeroMQ."""
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    group = ProcessGroup(tmp_path)
    addr = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    try:
        group.engine(tiny_model_dir, run / "d", role="decode", handover_addr=addr, max_batch_size=8, transport="zmq")
        group.engine(tiny_model_dir, run / "p", role="prefill", decode_engines=addr, max_batch_size=8,
                     transport="zmq")
        group.frontend(tiny_model_dir, "", port, engine=f"{run / 'p'},{run / 'd'}", transport="zmq")
        base = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: _roles_up(base), 120, 0.3, "both engines up")
        except TimeoutError:
            raise AssertionError("\n".join(pr.output()[-3000:] for pr in group.procs))
        prompts = [_tokens(20, 25), _tokens(21, 60)]
        with ThreadPoolExecutor(2) as pool:
            served = list(pool.map(lambda p: _complete(base, p, max_tokens=8)[0], prompts))
        s = stats(base)
        prefill = next(e for e in s["engines"] if e["role"] == "prefill")
        assert prefill["decode_engines"][0]["target"] == addr and prefill["decode_engines"][0]["ready"]
        assert prefill["handovers"]["count"] == 2
    finally:
        group.close()
        shutil.rmtree(run, ignore_errors=True)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype="float32").eval()
    reqs = [make_request(p, max_tokens=8, ignore_eos=True) for p in prompts]
    outs = run_until_idle(make_scheduler(model, prefill_mode="chunked", prefill_chunk_size=16), {0: reqs})
    assert served == [tokens_of(outs[r.request_id]) for r in reqs]
