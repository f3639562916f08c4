"""Structured outputs' cost, over HTTP on the default model: every request constrained
against the same requests unconstrained.

Starts ``tickserve serve`` (or uses ``--url``) and measures, in one run:

* **throughput and ITL** at ``--streams`` concurrent streams (default 16 and 64): each
  stream a ``/v1/completions`` request of ``--max-tokens`` tokens. Constrained: a JSON
  schema whose output fills ``max_tokens`` (an array of integers with ``minItems``
  beyond reach), *without* ``ignore_eos``; unconstrained: the same prompts with
  ``ignore_eos`` (so both arms produce the same tokens per request). Output tok/s is all
  tokens over the wall time; ITL p50 over every stream's gaps between chunks.
* **TTFT** of one request alone: unconstrained, with a first-seen schema (a distinct
  ``description`` makes each new: the frontend's check and the engine's compile both
  run), and with that schema again (cached), ``--ttft-reps`` each, p50.
* **compile time** of a typical schema (an object of seven properties, nested object,
  pattern, enum, array), in this process with llguidance on the model's tokenizer: the
  matcher and its first mask, p50/p99 over 50 distinct variants.

Prints one JSON document (and writes ``--out``); ratios are constrained ÷ unconstrained.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import _bench_common as bc
from bench_http import Server

ARRAY_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 2000}
TYPICAL = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"]},
    "active": {"type": "boolean"}, "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "email", "tags", "address", "active", "role"]}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="", help="a running server; empty → start tickserve serve")
    ap.add_argument("--server-args", default="--max-batch-size 64 --log-level warning",
                    help="extra flags for `tickserve serve`")
    ap.add_argument("--streams", default="16,64", help="concurrent streams, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ttft-reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    return ap.parse_args(argv)


async def one_stream(client, url: str, body: dict) -> tuple[list[float], float, int, str]:
    """Stream one completion: chunk arrival times, send time, tokens, finish reason."""
    t0 = time.perf_counter()
    times: list[float] = []
    finish = ""
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(obj["error"])
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            for c in obj.get("choices") or []:
                if c.get("text"):
                    times.append(time.perf_counter())
                finish = c.get("finish_reason") or finish
    return times, t0, tokens, finish


def bodies(n: int, max_tokens: int, constrained: bool, rng: random.Random) -> list[dict]:
    out = []
    for i in range(n):
        body = {"prompt": f"List {rng.randrange(10**6)} numbers, case {i}:", "max_tokens": max_tokens,
                "temperature": 0.0}
        body.update({"guided_json": ARRAY_SCHEMA} if constrained else {"ignore_eos": True})
        out.append(body)
    return out


async def load_run(url: str, n: int, max_tokens: int, constrained: bool, seed: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, b) for b in
                                         bodies(n, max_tokens, constrained, random.Random(seed))))
        wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in results)
    itl = [(b - a) * 1e3 for times, *_ in results for a, b in zip(times, times[1:])]
    finishes: dict[str, int] = {}
    for r in results:
        finishes[r[3]] = finishes.get(r[3], 0) + 1
    return {"streams": n, "constrained": constrained, "output_tokens": tokens, "wall_s": round(wall, 2),
            "output_tok_s": round(tokens / wall, 1), "itl_ms": bc.summarize(itl), "finish_reasons": finishes}


async def ttft(url: str, body: dict) -> float:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        times, t0, _, _ = await one_stream(client, url, {**body, "max_tokens": 4})
    return (times[0] - t0) * 1e3


async def ttfts(url: str, reps: int) -> dict:
    plain, first, cached = [], [], []
    for i in range(reps):
        plain.append(await ttft(url, {"prompt": f"Plain prompt {i}:", "temperature": 0.0, "ignore_eos": True}))
        schema = dict(TYPICAL, description=f"bench variant {time.time_ns()}")
        first.append(await ttft(url, {"prompt": f"Fresh schema {i}:", "temperature": 0.0, "guided_json": schema}))
        cached.append(await ttft(url, {"prompt": f"Cached schema {i}:", "temperature": 0.0, "guided_json": schema}))
    p50 = {k: round(bc.percentile(v, 50), 1) for k, v in
           (("unconstrained", plain), ("first_seen_schema", first), ("cached_schema", cached))}
    return {"ttft_ms_p50": p50, "first_seen_minus_unconstrained_ms": round(p50["first_seen_schema"]
                                                                          - p50["unconstrained"], 1),
            "cached_over_unconstrained": bc.ratio(p50["cached_schema"], p50["unconstrained"])}


def compile_times(n: int = 50) -> dict:
    import torch
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from shared.constraints import JSON_OPTIONS
    from shared.models import resolve_model

    hf = AutoTokenizer.from_pretrained(str(resolve_model("")))
    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf)
    tok_s = time.perf_counter() - t0
    words = (tok.vocab_size + 31) // 32
    mask = torch.empty(words, dtype=torch.int32)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(dict(TYPICAL, description=f"v{i}"),
                                                                overrides=JSON_OPTIONS)
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        m.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"compile_ms": bc.summarize(times), "tokenizer_build_s": round(tok_s, 2)}


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.sigterm_as_interrupt()
    summary: dict = {"tool": "bench_structured", **bc.machine_info("start")}
    server = None
    try:
        url = args.url
        if not url:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            server = Server(port, args.server_args.split())
            server.wait_healthy(300)
            url = server.url
        bc.log("warm-up")
        asyncio.run(load_run(url, 4, 8, True, args.seed + 99))
        asyncio.run(load_run(url, 4, 8, False, args.seed + 99))
        runs = []
        for n in [int(x) for x in args.streams.split(",")]:
            for constrained in (False, True):
                bc.log(f"{n} streams, {'constrained' if constrained else 'unconstrained'}")
                runs.append(asyncio.run(load_run(url, n, args.max_tokens, constrained, args.seed + n)))
        summary["runs"] = runs
        summary["ratios"] = {}
        for n in {r["streams"] for r in runs}:
            plain, con = (next(r for r in runs if r["streams"] == n and r["constrained"] is c) for c in (False, True))
            summary["ratios"][f"{n}_streams"] = {
                "output_tok_s": bc.ratio(con["output_tok_s"], plain["output_tok_s"]),
                "itl_p50_unconstrained_over_constrained": bc.ratio(plain["itl_ms"]["p50"], con["itl_ms"]["p50"])}
        bc.log("TTFT")
        summary["ttft"] = asyncio.run(ttfts(url, args.ttft_reps))
        bc.log("compile times")
        summary["compile"] = compile_times()
    finally:
        if server is not None:
            server.stop()
    summary.update(bc.machine_info("end"))
    bc.emit(summary, args.out)
    return 0


if __name__ == "__main__":
    bc.run_main(main)
