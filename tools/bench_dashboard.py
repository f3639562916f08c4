"""Does watching the dashboard slow the engine? Output tokens/s at C streams with 0 and
with V open stats streams (what each open /dashboard holds), in the same run.

Starts ``tickserve serve`` on the default model (or uses ``--url``), warms up (one level
at the same concurrency, discarded), then runs
three levels of the same load (``--concurrency`` streaming completions, ``--num-requests``
of them, ``ignore_eos``, ``--max-tokens`` each, as ``tools/bench_http.py`` sends them):

1. no viewers (the baseline);
2. ``--viewers`` clients reading ``GET /scheduler/stats/stream`` the whole time, as many
   open dashboards would (each one also parses every event, as the page does);
3. no viewers again, so drift of the machine over the run shows up as well.

Reports output tokens/s of each level, ``ratio_viewers_vs_baseline`` (level 2 / level 1),
``ratio_baseline_again`` (level 3 / level 1: the noise floor of this machine) and the
events each viewer received per second. Prints one JSON summary on stdout.

Usage:
    python tools/bench_dashboard.py                      # 64 streams, 10 viewers
    python tools/bench_dashboard.py --concurrency 32 --viewers 10 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as bc  # noqa: E402
from bench_http import Server, check_loopback, free_port, one_request, run_level  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=64, help="streams in flight")
    ap.add_argument("--num-requests", type=int, default=0, help="requests per level; 0 → 2 · concurrency")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (ignore_eos)")
    ap.add_argument("--viewers", type=int, default=10, help="open stats streams in the middle level")
    ap.add_argument("--prompt-words", type=int, default=130, help="random words per prompt (as bench_compare)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random-word prompts")
    ap.add_argument("--model", default="", help="model name sent in each request; empty → none")
    ap.add_argument("--url", help="use this running server (loopback only)")
    ap.add_argument("--server-args", default="", help="extra flags for `tickserve serve`")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--level-timeout", type=float, default=600)
    ap.add_argument("--out", help="also write the JSON summary here")
    return ap.parse_args(argv)


async def viewer(url: str, counts: list, index: int, stop: asyncio.Event) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=30.0), trust_env=False) as client:
        async with client.stream("GET", f"{url}/scheduler/stats/stream") as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])  # the page parses every event too
                    counts[index] += 1
                if stop.is_set():
                    return


async def run(url: str, args) -> dict:
    import httpx

    n = args.num_requests or 2 * args.concurrency
    async with httpx.AsyncClient(timeout=args.request_timeout, trust_env=False) as client:
        warm = await one_request(client, url, "Warm-up: say hello.", 8)
    if warm.get("error"):
        raise RuntimeError(f"warm-up failed: {warm['error']}")
    await run_level(url, args.concurrency, args.concurrency, args)  # every engine warm, pools touched
    base = await run_level(url, args.concurrency, n, args)
    stop = asyncio.Event()
    counts = [0] * args.viewers
    tasks = [asyncio.create_task(viewer(url, counts, i, stop)) for i in range(args.viewers)]
    await asyncio.sleep(1.0)
    before = sum(counts)
    t0 = time.perf_counter()
    watched = await run_level(url, args.concurrency, n, args)
    events = sum(counts) - before
    watched_s = time.perf_counter() - t0
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    again = await run_level(url, args.concurrency, n, args)
    return {"baseline": base, "viewers": watched, "baseline_again": again,
            "events_per_viewer_per_s": round(events / max(1, args.viewers) / watched_s, 2)}


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.sigterm_as_interrupt()
    server = None
    try:
        if args.url:
            url = args.url.rstrip("/")
            check_loopback(url)
        else:
            server = Server(free_port(), shlex.split(args.server_args))
            server.wait_healthy(args.startup_timeout)
            url = server.url
        levels = asyncio.run(run(url, args))
    finally:
        if server is not None:
            code = server.stop()
            if code not in (0, -signal.SIGTERM):
                bc.log("server log tail:\n" + server.log_tail())
            else:
                server.log_path.unlink(missing_ok=True)
    rate = {k: levels[k]["output_tokens_per_s"] for k in ("baseline", "viewers", "baseline_again")}
    summary = {
        "benchmark": "dashboard_viewers",
        "server_args": args.server_args,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "viewers": args.viewers,
        "output_tokens_per_s": rate,
        "ratio_viewers_vs_baseline": bc.ratio(rate["viewers"], rate["baseline"]),
        "ratio_baseline_again": bc.ratio(rate["baseline_again"], rate["baseline"]),
        "events_per_viewer_per_s": levels["events_per_viewer_per_s"],
        "levels": levels,
    }
    bc.emit(summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
