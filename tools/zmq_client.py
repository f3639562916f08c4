"""Talk to a running tickserve engine directly over ZeroMQ (no HTTP, no frontend).

Submits a prompt's token ids, prints the streamed token ids as they arrive, and
reports time to first token (TTFT) and decode tokens per second.

Usage:
    # against `tickserve serve` or `tickserve engine --run-dir DIR`:
    python tools/zmq_client.py --run-dir /tmp/tickserve-XXXX --prompt "Hello" --max-tokens 32
    python tools/zmq_client.py --input-addr tcp://127.0.0.1:5555 --output-addr tcp://127.0.0.1:5556 \\
        --token-ids 1,2,3 --max-tokens 8 --json

``--prompt`` needs ``--model`` (a model directory, or empty for the default) to
tokenize; ``--token-ids`` needs nothing. ``--json`` prints one JSON object at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared import protocol as p  # noqa: E402
from shared.transport import ClientChannel, topic_for  # noqa: E402


def handshake(channel: ClientChannel, frontend_id: str, timeout: float) -> p.Welcome:
    """Send Hello until the engine's Welcome arrives on our topic (slow-joiner safe)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        channel.send(p.Hello(frontend_id))
        if channel.poll(100):
            while (got := channel.recv()) is not None:
                if isinstance(got.msg, p.Welcome):
                    return got.msg
    raise TimeoutError("no Welcome from the engine")


def run(args: argparse.Namespace) -> dict:
    if args.token_ids:
        ids = [int(t) for t in args.token_ids.split(",")]
        tokenizer = None
    else:
        from transformers import AutoTokenizer

        from shared.models import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))
        ids = tokenizer.encode(args.prompt)
    input_addr = args.input_addr or f"ipc://{os.path.join(args.run_dir, 'input.sock')}"
    output_addr = args.output_addr or f"ipc://{os.path.join(args.run_dir, 'output.sock')}"
    frontend_id = f"zmq-client-{uuid.uuid4().hex[:8]}"
    channel = ClientChannel(zmq.Context.instance(), input_addr, output_addr, topic_for(frontend_id))
    try:
        handshake(channel, frontend_id, args.timeout)
        params = p.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                  seed=args.seed, ignore_eos=args.ignore_eos)
        request_id = uuid.uuid4().hex
        start = time.monotonic()
        channel.send(p.Submit(request_id, frontend_id, ids, params))
        tokens: list[int] = []
        first = last = None
        ack = None
        finish = None
        next_beat = time.monotonic()
        deadline = start + args.timeout
        while finish is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the request did not finish in time")
            if time.monotonic() >= next_beat:  # keep the engine from reaping us
                channel.send(p.Heartbeat(frontend_id))
                next_beat = time.monotonic() + 1.0
            if not channel.poll(100):
                continue
            while (got := channel.recv()) is not None:
                msg = got.msg
                if isinstance(msg, p.Ack) and msg.request_id == request_id:
                    ack = msg
                    if not msg.accepted:
                        return {"accepted": False, "reason": msg.reason.code.value,
                                "message": msg.reason.message}
                elif isinstance(msg, p.StepOutput):
                    for out in msg.outputs:
                        if out.request_id != request_id:
                            continue
                        now = time.monotonic()
                        if out.token_ids:
                            first = first or now
                            last = now
                            tokens += out.token_ids
                            if not args.json:
                                text = tokenizer.decode(out.token_ids) if tokenizer else " ".join(map(str, out.token_ids))
                                print(text, end=" " if tokenizer is None else "", flush=True)
                        if out.finish_reason is not None:
                            finish = out.finish_reason.value
        ttft = (first - start) if first else None
        decode_s = (last - first) if first and last and len(tokens) > 1 else None
        return {"accepted": ack is not None and ack.accepted, "token_ids": tokens, "finish_reason": finish,
                "ttft_s": ttft, "decode_tokens_per_s": (len(tokens) - 1) / decode_s if decode_s else None,
                "text": tokenizer.decode(tokens) if tokenizer else None}
    finally:
        try:
            channel.send(p.Goodbye(frontend_id), timeout_ms=200)
        except zmq.Again:
            pass  # no engine to say goodbye to
        channel.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default="")
    ap.add_argument("--input-addr", default="")
    ap.add_argument("--output-addr", default="")
    ap.add_argument("--model", default="", help="for tokenizing --prompt; empty → the default model")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--token-ids", default="", help="comma-separated prompt token ids")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not (args.run_dir or (args.input_addr and args.output_addr)):
        ap.error("give --run-dir or both --input-addr and --output-addr")
    try:
        result = run(args)
    except (zmq.Again, TimeoutError) as exc:
        where = args.input_addr or os.path.join(args.run_dir, "input.sock")
        print(f"no engine answered at {where} ({exc}); is `tickserve engine` or `tickserve serve` "
              "running with that run directory?", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print()
        if not result["accepted"]:
            print(f"rejected: {result['reason']}: {result['message']}")
            return 1
        ttft = result["ttft_s"]
        tps = result["decode_tokens_per_s"]
        print(f"[{len(result['token_ids'])} tokens, finish_reason={result['finish_reason']}, "
              f"TTFT {ttft * 1000:.0f} ms" + (f", {tps:.1f} tokens/s]" if tps else "]"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
