"""Scaling out, measured in one run:

1. **Engines** — output tokens/s at ``--streams`` (64) on the real model: one engine on
   every core (``--data-parallel-size 1``) against two engines on half the cores each,
   interleaved A/B/A/B (``tools/bench_compare.py``'s rounds).
2. **Frontends** — HTTP throughput with ``--frontend-streams`` (256) short streams on
   the tiny random model, where the frontend (tokenizing, detokenizing, SSE) rather than
   the model is the limit: ``--api-server-count 1`` against 2.
3. **Routing** — prefix-cache hit rate of a multi-session chat (each session's turns
   resend the conversation so far) over two engines: affine routing (session key,
   rendezvous hashing) against round-robin, on the tiny model.

Prints one JSON document with the ratios.

Usage:
    python tools/bench_scale.py                          # all three
    python tools/bench_scale.py --skip-engines --sessions 32 --turns 6
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as bc  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--frontend-streams", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--skip-engines", action="store_true")
    ap.add_argument("--skip-frontends", action="store_true")
    ap.add_argument("--skip-routing", action="store_true")
    ap.add_argument("--out", help="also write the JSON summary here")
    return ap.parse_args(argv)


def tiny_model_dir(root: Path) -> Path:
    """The tests' tiny random Llama with SmolLM2's tokenizer, as a model directory."""
    from transformers import AutoTokenizer

    from shared.models import resolve_model
    from tests.conftest import make_tiny_llama

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("")))
    path = root / "tiny-llama"
    make_tiny_llama(vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def compare(tickserve: list[str], streams: int, reps: int, extra: list[str]) -> dict:
    import bench_compare

    args = ["--concurrency", str(streams), "--reps", str(reps), *extra]
    for spec in tickserve:
        args += ["--tickserve", spec]
    out = Path(tempfile.mkstemp(prefix="bench-scale-", suffix=".json")[1])
    bench_compare.main(args + ["--out", str(out)])
    import json

    return json.loads(out.read_text())


async def chat(url: str, sessions: int, turns: int) -> None:
    """Each session: ``turns`` requests, each resending the conversation so far."""
    import httpx

    async def session(i: int, client):
        history = [{"role": "system", "content": f"You are assistant number {i}. " + "Be brief. " * 40}]
        for t in range(turns):
            history.append({"role": "user", "content": f"Question {t} of session {i}: tell me about item {t}."})
            r = await client.post(f"{url}/v1/chat/completions", json={
                "messages": history, "max_tokens": 24, "temperature": 0, "user": f"session-{i}"})
            r.raise_for_status()
            history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})

    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        await asyncio.gather(*(session(i, client) for i in range(sessions)))


def routing(model: Path, args) -> dict:
    import httpx

    from bench_compare import Target
    from bench_http import free_port

    results = {}
    for mode in ("affinity", "round_robin"):
        port = free_port()
        t = Target(mode, "tickserve", f"http://127.0.0.1:{port}",
                   [sys.executable, "-m", "shared.cli", "serve", str(model), "--port", str(port),
                    "--data-parallel-size", "2", "--routing", mode, "--dtype", "float32", "--log-level", "warning"],
                   str(bc.REPO), {"PYTHONPATH": str(bc.REPO)})
        t.start()
        try:
            t.wait_healthy(300)
            time.sleep(1.0)
            t0 = time.monotonic()
            asyncio.run(chat(t.url, args.sessions, args.turns))
            wall = time.monotonic() - t0
            stats = httpx.get(f"{t.url}/scheduler/stats", timeout=10).json()
            engines = stats.get("engines", [stats])
            query = sum(e["blocks"]["prefix_query_tokens"] for e in engines)
            hit = sum(e["blocks"]["prefix_hit_tokens"] for e in engines)
            results[mode] = {"prefix_hit_rate": round(hit / query, 4) if query else None, "prompt_tokens": query,
                             "wall_s": round(wall, 2), "per_engine_finished": [e["num_finished"] for e in engines]}
            bc.log(f"routing {mode}: {results[mode]}")
        finally:
            t.stop()
    results["hit_rate_ratio_affinity_vs_round_robin"] = bc.ratio(results["affinity"]["prefix_hit_rate"],
                                                                  results["round_robin"]["prefix_hit_rate"])
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.sigterm_as_interrupt()
    summary: dict = {"benchmark": "scale_out", "env": bc.machine_info("start")}
    root = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    try:
        if not args.skip_engines:
            got = compare(["dp1=--data-parallel-size 1", "dp2=--data-parallel-size 2"], args.streams, args.reps, [])
            summary["engines"] = {"dp1": got["servers"]["dp1"]["levels"],
                                  "dp2": got["servers"]["dp2"]["levels"]}
        model = tiny_model_dir(root) if not (args.skip_frontends and args.skip_routing) else None
        if not args.skip_frontends:
            flags = f"{model} --dtype float32 --max-batch-size 256 --max-queue-size 1024"
            got = compare([f"fe1={flags}", f"fe2={flags} --api-server-count 2"], args.frontend_streams, args.reps,
                          ["--max-tokens", "32", "--prompt-words", "20"])
            summary["frontends"] = {"fe1": got["servers"]["fe1"]["levels"], "fe2": got["servers"]["fe2"]["levels"]}
        if not args.skip_routing:
            summary["routing"] = routing(model, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary["env"].update(bc.machine_info("end"))
    bc.emit(summary, args.out)
    return 0


if __name__ == "__main__":
    bc.run_main(main)
