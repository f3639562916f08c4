"""HTTP serving benchmark: streaming /v1/completions at several concurrency levels.

Starts ``python -m shared.cli serve`` on the default model on a free loopback port
(or uses ``--url`` of a server that is already running), then for each
``--concurrency`` value C sends N streaming completions (distinct short prompts,
``ignore_eos``, fixed ``max_tokens``, greedy) keeping C in flight, and reports:

* output tokens/s — completion tokens of the level (from the usage chunk) over its wall
  time, first request sent → last response finished;
* TTFT p50/p99 — request sent → first SSE chunk with text;
* ITL p50/p99 — gaps between consecutive text chunks of one response (pooled over all
  responses). One chunk is one engine tick's text for that request: normally one token,
  but two in the first chunk (a promoted row also decodes in its prefill tick) and more
  when the detokenizer holds back partial text; ``tokens_per_chunk`` shows the mix;
* the throughput ratio of every level against the lowest one (concurrency 1 by default:
  the baseline, in the same run) — ``ratio_highest_vs_baseline`` is the headline.

Usage:
    python tools/bench_http.py                                  # --concurrency 1 16
    python tools/bench_http.py --concurrency 1 4 16 --num-requests 32 --max-tokens 64 \\
        --out bench-results/http.json
    python tools/bench_http.py --url http://127.0.0.1:8000      # a server you started
    python tools/bench_http.py --server-args "--max-batch-size 16 --policy fair"
    python tools/bench_http.py --concurrency 1 16 64 --prompt-words 100 --max-tokens 128 \\
        --url http://127.0.0.1:8001 --model "$MODEL_DIR"          # vLLM, or any OpenAI server

``--prompt-words W`` sends prompts of W random words (seeded, distinct per request;
100 words are ~130 SmolLM2 tokens: the issue's speed workload), and the report gives
the prompt tokens the server counted. ``--model`` is the name sent in each request
(vLLM refuses a request without its served name; tickserve accepts none).

N is ``--num-requests`` or, when 0, max(8, 2·C). Prints one JSON summary on stdout
(progress on stderr). Loopback only; every request and every level has a timeout; the
server this script starts is stopped (SIGTERM, then SIGKILL) on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import _bench_common as bc

TOPICS = ["the sea", "a lighthouse", "winter", "a library", "trains", "bees", "a market", "the moon",
          "rivers", "a violin", "deserts", "a bakery", "volcanoes", "owls", "a city at night", "glaciers"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="in-flight requests per level")
    ap.add_argument("--num-requests", type=int, default=0, help="requests per level; 0 → max(8, 2·C)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    ap.add_argument("--prompt-words", type=int, default=0,
                    help="prompts of this many random words (seeded); 0 → one short sentence per request")
    ap.add_argument("--model", default="", help="model name sent in each request; empty → none")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random-word prompts")
    ap.add_argument("--url", help="benchmark this running server instead of starting one (loopback only)")
    ap.add_argument("--port", type=int, default=0, help="port for the started server; 0 → a free one")
    ap.add_argument("--server-args", default="", help="extra flags for `tickserve serve` (one string)")
    ap.add_argument("--startup-timeout", type=float, default=300, help="seconds to wait for /health")
    ap.add_argument("--request-timeout", type=float, default=120, help="seconds without a byte → give up")
    ap.add_argument("--level-timeout", type=float, default=300, help="seconds for one concurrency level")
    ap.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up request")
    ap.add_argument("--out", help="also write the JSON summary here")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------- the server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``tickserve serve`` in its own process group, logging to a temporary file."""

    def __init__(self, port: int, extra: list[str]):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        fd, name = tempfile.mkstemp(prefix="bench-http-server-", suffix=".log")
        self.log_path = Path(name)
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=str(bc.REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "shared.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *extra]
        bc.log(f"starting: {' '.join(cmd)} (log {self.log_path})")
        with os.fdopen(fd, "wb") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=str(bc.REPO), env=env, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float) -> None:
        import httpx

        deadline = bc.Deadline(timeout)
        while not deadline.expired():
            if not self.alive():
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy within {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """SIGTERM the whole group (supervisor, engine, frontend), SIGKILL what is
        left after 20 s. Idempotent."""
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        if self.alive():
            _signal_group(pgid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                bc.log("server did not stop in 20s: SIGKILL")
            except KeyboardInterrupt:  # a second Ctrl-C: do not wait for the drain
                _signal_group(pgid, signal.SIGKILL)
                raise
        _signal_group(pgid, signal.SIGKILL)  # stragglers (no-op when the group is gone)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        return self.proc.returncode


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------- the client

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education foot boy age policy music market sense nation plan college "
         "interest death experience effect use class control care field development role effort rate heart "
         "drug show leader light voice wife police mind price report decision son view relationship town road "
         "arm difference value building action model season society tax director position player record paper "
         "space ground form event official matter center couple site project activity star table need court "
         "oil situation cost industry figure street image phone data picture practice piece land product doctor "
         "wall patient worker news test movie north love support technology step baby computer type attention "
         "film tree source organization hair window evidence population site blue green quickly river mountain").split()


def prompt_for(level: int, i: int, words: int = 0, seed: int = 0) -> str:
    """Request ``i`` of a level: a short sentence, or ``words`` random words (seeded by
    ``seed``, the level and ``i``, so every server gets the same prompts)."""
    if words:
        import random
        rng = random.Random(f"{seed}-{level}-{i}")
        return " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Request {i} at concurrency {level}: write a few lines about {TOPICS[i % len(TOPICS)]}."


async def one_request(client, url: str, prompt: str, max_tokens: int, model: str = "") -> dict:
    """Stream one completion. Returns times (perf_counter seconds) and counts."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    sent = time.perf_counter()
    chunks: list[float] = []
    usage, finish, error = None, None, None
    max_events = 4 * max_tokens + 64  # bound: one event per token, plus usage and [DONE]
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                return {"sent": sent, "done": time.perf_counter(), "error": f"HTTP {resp.status_code}: {text}"}
            events = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if events > max_events:
                    error = "too many SSE events"
                    break
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    error = obj["error"].get("message", "error")
                    break
                if obj.get("usage"):
                    usage = obj["usage"]
                for choice in obj.get("choices", []):
                    if choice.get("text"):
                        chunks.append(now)
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        error = f"{type(exc).__name__}: {exc}"
    return {"sent": sent, "done": time.perf_counter(), "chunks": chunks, "finish": finish,
            "completion_tokens": (usage or {}).get("completion_tokens"),
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "error": error}


async def run_level(url: str, concurrency: int, n: int, args) -> dict:
    import httpx

    timeout = httpx.Timeout(connect=10.0, read=args.request_timeout, write=10.0, pool=args.level_timeout)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    results: list[dict] = []
    next_index = iter(range(n))

    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        async def worker():
            for i in next_index:  # shared iterator: each index is taken once
                prompt = prompt_for(concurrency, i, args.prompt_words, args.seed)
                results.append(await one_request(client, url, prompt, args.max_tokens, args.model))

        start = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        done, pending = await asyncio.wait(tasks, timeout=args.level_timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            bc.log(f"concurrency {concurrency}: level timeout, {n - len(results)} requests not finished")

    ok = [r for r in results if not r.get("error") and r.get("chunks")]
    errors = [r["error"] for r in results if r.get("error")]
    end = max((r["done"] for r in ok), default=time.perf_counter())
    wall = end - start
    tokens = sum(r["completion_tokens"] if r["completion_tokens"] is not None else len(r["chunks"]) for r in ok)
    n_chunks = sum(len(r["chunks"]) for r in ok)
    prompt_tokens = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens")]
    ttft = [(r["chunks"][0] - r["sent"]) * 1e3 for r in ok]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    level = {
        "concurrency": concurrency,
        "num_requests": n,
        "completed": len(ok),
        "errors": len(errors) + (n - len(results)),
        "error_samples": errors[:3],
        "finish_reasons": sorted({r["finish"] for r in ok if r["finish"]}),
        "output_tokens": tokens,
        "prompt_tokens_mean": round(sum(prompt_tokens) / len(prompt_tokens), 1) if prompt_tokens else None,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "tokens_per_chunk": round(tokens / n_chunks, 3) if n_chunks else None,
        "ttft_ms": bc.summarize(ttft),
        "itl_ms": bc.summarize(itl),
    }
    bc.log(f"concurrency {concurrency}: {len(ok)}/{n} ok, {level['output_tokens_per_s']} tok/s, "
           f"TTFT p50 {level['ttft_ms']['p50']} ms, ITL p50 {level['itl_ms']['p50']} ms")
    return level


async def run_all(url: str, args) -> list[dict]:
    import httpx

    if not args.no_warmup:
        async with httpx.AsyncClient(timeout=args.request_timeout, trust_env=False) as client:
            warm = await one_request(client, url, "Warm-up: say hello.", min(8, args.max_tokens), args.model)
        if warm.get("error"):
            raise RuntimeError(f"warm-up request failed: {warm['error']}")
    levels = []
    for c in args.concurrency:
        n = args.num_requests or max(8, 2 * c)
        levels.append(await run_level(url, c, n, args))
    return levels


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"--url must be a loopback address, not {host!r}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if any(c < 1 for c in args.concurrency):
        raise SystemExit("--concurrency values must be at least 1")
    args.concurrency = sorted(set(args.concurrency))
    bc.sigterm_as_interrupt()
    env = bc.machine_info("start")
    server = None
    try:
        if args.url:
            url = args.url.rstrip("/")
            check_loopback(url)
        else:
            server = Server(args.port or free_port(), shlex.split(args.server_args))
            t0 = time.perf_counter()
            server.wait_healthy(args.startup_timeout)
            bc.log(f"server healthy in {time.perf_counter() - t0:.1f}s at {server.url}")
            url = server.url
        levels = asyncio.run(run_all(url, args))
    finally:
        if server is not None:
            code = server.stop()
            bc.log(f"server stopped (exit {code})")
            if code not in (0, -signal.SIGTERM):
                bc.log("server log tail:\n" + server.log_tail())
            else:
                server.log_path.unlink(missing_ok=True)

    base = levels[0]
    top = levels[-1]
    summary = {
        "benchmark": "http_streaming_completions",
        "url": url if args.url else "started by this script (tickserve serve, default model)",
        "server_args": args.server_args,
        "max_tokens": args.max_tokens,
        "baseline_concurrency": base["concurrency"],
        "throughput_ratio_vs_baseline": {str(lv["concurrency"]): bc.ratio(lv["output_tokens_per_s"],
                                                                          base["output_tokens_per_s"])
                                         for lv in levels},
        "ratio_highest_vs_baseline": bc.ratio(top["output_tokens_per_s"], base["output_tokens_per_s"]),
        "ttft_p50_ratio_highest_vs_baseline": bc.ratio(top["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
        "itl_p50_ratio_highest_vs_baseline": bc.ratio(top["itl_ms"]["p50"], base["itl_ms"]["p50"]),
        "env": {**env, **bc.machine_info("end")},
        "levels": levels,
    }
    bc.emit(summary, args.out)
    return 0 if all(lv["errors"] == 0 for lv in levels) else 1


if __name__ == "__main__":
    bc.run_main(main)
