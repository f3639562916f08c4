"""Stream one chat completion from a running tickserve server and print it token by token.

Usage:
    python tools/demo_stream.py --url http://127.0.0.1:8000 [--wait 300] [--prompt "..."]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request


def wait_healthy(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--wait", type=float, default=0, help="seconds to wait for /health first")
    ap.add_argument("--prompt", default="Write a haiku about a busy kitchen.")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.wait and not wait_healthy(args.url, args.wait):
        print(f"server at {args.url} did not become healthy in {args.wait:.0f}s", file=sys.stderr)
        return 1
    body = json.dumps({"messages": [{"role": "user", "content": args.prompt}],
                       "max_tokens": args.max_tokens, "stream": True}).encode()
    req = urllib.request.Request(f"{args.url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    print(f"> {args.prompt}\n< ", end="", flush=True)
    start = time.monotonic()
    first = None
    n = 0
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    first = first or time.monotonic()
                    n += 1
                    print(text, end="", flush=True)
    total = time.monotonic() - start
    print(f"\n[{n} chunks, time to first token {((first or start) - start) * 1000:.0f} ms, {total:.2f} s total]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
