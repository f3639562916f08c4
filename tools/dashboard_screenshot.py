"""Screenshot of /dashboard under load, for the README (``docs/dashboard.png``).

Starts ``tickserve serve`` on the default model with its defaults (bfloat16 where the CPU
has it, fcfs, shared memory, one engine per core), a small queue so that the gates have
work (or uses ``--url``), sends a steady load from a few sessions of different appetites (streaming
completions, ``ignore_eos``), plus a burst past the queue so the gates have something to
show, waits ``--warm-s`` seconds for the charts to fill, and saves a screenshot taken by
headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by selenium).

Usage:
    python tools/dashboard_screenshot.py                       # → docs/dashboard.png
    python tools/dashboard_screenshot.py --out /tmp/d.png --warm-s 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as bc  # noqa: E402
from bench_http import Server, check_loopback, free_port  # noqa: E402

SESSIONS = {"alice": 6, "bob": 3, "carol": 1}  # session → streams it keeps in flight


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(bc.REPO / "docs" / "dashboard.png"))
    ap.add_argument("--url", help="use this running server (loopback only)")
    ap.add_argument("--server-args", default="--max-queue-size 12",
                    help="extra flags for `tickserve serve`")
    ap.add_argument("--warm-s", type=float, default=40.0, help="seconds of load before the screenshot")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1250)
    return ap.parse_args(argv)


def browser(width: int, height: int):
    os.environ.setdefault("SE_OFFLINE", "true")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        raise SystemExit("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--hide-scrollbars"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver), options=opts)


async def load(url: str, max_tokens: int, stop: threading.Event) -> None:
    import httpx

    async def stream(client, session: str, i: int):
        body = {"prompt": f"Story {i} for {session}: once upon a time", "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True, "user": session}
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                async for _ in resp.aiter_lines():
                    pass
        except httpx.HTTPError:
            await asyncio.sleep(0.5)

    async def worker(client, session: str, k: int):
        i = 0
        while not stop.is_set():
            i += 1
            await stream(client, session, k * 1000 + i)

    async def burst(client):  # a few at once past the queue: some 429s and soft-holds
        while not stop.is_set():
            await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
                "prompt": "burst", "max_tokens": 4, "user": "burst"}) for _ in range(12)),
                return_exceptions=True)
            await asyncio.sleep(3.0)

    async with httpx.AsyncClient(timeout=120, trust_env=False,
                                 limits=httpx.Limits(max_connections=64)) as client:
        tasks = [asyncio.create_task(worker(client, s, k)) for s, n in SESSIONS.items() for k in range(n)]
        tasks.append(asyncio.create_task(burst(client)))
        while not stop.is_set():
            await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.sigterm_as_interrupt()
    server, driver, stop = None, None, threading.Event()
    loader = None
    try:
        if args.url:
            url = args.url.rstrip("/")
            check_loopback(url)
        else:
            server = Server(free_port(), shlex.split(args.server_args))
            server.wait_healthy(300)
            url = server.url
        loader = threading.Thread(target=lambda: asyncio.run(load(url, args.max_tokens, stop)), daemon=True)
        loader.start()
        driver = browser(args.width, args.height)
        driver.get(f"{url}/dashboard")
        bc.log(f"loading {url} for {args.warm_s:.0f}s")
        stop.wait(args.warm_s)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
        bc.log(f"wrote {out}")
    finally:
        stop.set()
        if driver is not None:
            driver.quit()
        if loader is not None:
            loader.join(10)
        if server is not None:
            code = server.stop()
            if code not in (0, -signal.SIGTERM):
                bc.log("server log tail:\n" + server.log_tail())
            else:
                server.log_path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
