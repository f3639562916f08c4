"""Shared memory against ZeroMQ, in one run, alternating A/B/A/B:

1. **The transport alone**: an "engine" (this process) publishes the frames a tick
   would — one ``StepOutput`` per tick holding one token for each of S streams — through
   the real carrier classes to a "frontend" in a child process, which decodes each frame
   and records the one-way latency (both read ``CLOCK_MONOTONIC``). Paced (one frame
   every ``--tick-ms``, the reader asleep between frames: the engine's pattern) for the
   latency, unpaced for frames/s; CPU seconds of both sides per 1,000 frames.
2. **End to end over HTTP** on the real model: ``tickserve serve`` with
   ``TICKSERVE_TRANSPORT=shm`` and with ``=zmq``, the same streaming workload as
   ``tools/bench_http.py`` at each ``--http-concurrency``, levels interleaved: ITL p50/p99,
   output tokens/s, and the engine's plus the frontend's CPU seconds per 1,000 tokens.

Prints one JSON document with ratios shm/zmq per figure and per round.

Usage:
    python tools/bench_transport.py                        # streams 1 16 64 256; HTTP 1 16 64
    python tools/bench_transport.py --skip-http --frames 5000
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as bc  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--frames", type=int, default=2000, help="frames per transport measurement")
    ap.add_argument("--tick-ms", type=float, default=2.0, help="pace of the paced measurement")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--http-concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-words", type=int, default=130)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", help="also write the JSON summary here")
    return ap.parse_args(argv)


# ---------------------------------------------------------------- the transport alone


def _step_frame(streams: int, sent_ns: int) -> bytes:
    from shared import codec
    from shared import protocol as p

    outs = [p.RequestOutput(f"fe-0-{i}", [1234], None, None, 130, 0, None, None) for i in range(streams)]
    outs[0] = p.RequestOutput(str(sent_ns), [1234], None, None, 130, 0, None, None)  # the send time rides along
    return codec.encode(p.StepOutput(outs))


def _receiver(carrier: str, run_dir: str, frames: int, ready, results) -> None:
    """The child: connect, say ready, receive ``frames`` frames, report latencies and CPU."""
    import zmq

    from shared import shm_channel
    from shared.transport import ClientChannel, topic_for

    topic = topic_for("bench-fe")
    if carrier == "shm":
        chan = shm_channel.ShmChannel(run_dir, "bench-fe", topic, b"*")
        while not chan.connect():
            time.sleep(0.01)
    else:
        chan = ClientChannel(zmq.Context.instance(), f"ipc://{run_dir}/in.sock", f"ipc://{run_dir}/out.sock",
                             topic, b"*")
        time.sleep(0.3)  # let the subscription reach the publisher
    from shared import codec

    ready.set()
    latencies, got, last = [], 0, 0
    cpu0 = time.process_time()
    while got < frames:  # the frame's bytes in hand is "received"; decoding them comes after
        if not chan.poll(1000):
            break
        while True:
            payload = _next_payload(chan)
            if payload is None:
                break
            last = time.monotonic_ns()
            sent = int(codec.decode(payload, "frontend").outputs[0].request_id)
            latencies.append((last - sent) / 1e3)
            got += 1
    results.put({"latencies_us": latencies, "cpu_s": time.process_time() - cpu0, "last_ns": last})
    chan.close()


def _next_payload(chan) -> bytes | None:
    """The next frame's bytes from either carrier, not yet decoded."""
    import zmq

    from shared import shm_channel

    if isinstance(chan, shm_channel.ShmChannel):  # its poll() drained the doorbell
        rec = chan.inbound.read()
        return None if rec is None else rec[3]
    try:
        return chan.sub.recv_multipart(zmq.NOBLOCK)[2]
    except zmq.Again:
        return None


def transport_once(carrier: str, streams: int, frames: int, pace_s: float) -> dict:
    import zmq

    from engine_proc.shm_frontends import ShmFrontends
    from shared.transport import EngineOutbound, RoutedOutbound, topic_for

    run_dir = tempfile.mkdtemp(prefix="ts-bt-", dir="/tmp")
    ctx = zmq.Context.instance()
    outbound = RoutedOutbound(EngineOutbound(ctx, f"ipc://{run_dir}/out.sock"))
    frontends = ShmFrontends(run_dir, 1, outbound) if carrier == "shm" else None
    poller = zmq.Poller()
    if frontends:
        frontends.register(poller)
    mpctx = mp.get_context("spawn")
    ready, results = mpctx.Event(), mpctx.Queue()
    child = mpctx.Process(target=_receiver, args=(carrier, run_dir, frames, ready, results), daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not ready.is_set() and time.monotonic() < deadline:
            if frontends:
                events = dict(poller.poll(10))
                frontends.handle(events, time.monotonic() + 0.01, lambda *a: None, lambda *a: None)
            else:
                time.sleep(0.01)
        topic = topic_for("bench-fe")
        cpu0, t0 = time.process_time(), time.monotonic_ns()
        for i in range(frames):
            outbound.publish_frame(topic, _step_frame(streams, time.monotonic_ns()))
            if pace_s:
                time.sleep(pace_s)
        cpu = time.process_time() - cpu0
        got = results.get(timeout=60)
        span_s = max(1e-9, (got["last_ns"] - t0) / 1e9)  # first send → last frame in the receiver's hands
    finally:
        child.join(10)
        if frontends:
            frontends.close()
        outbound.close()
        import shutil
        shutil.rmtree(run_dir, ignore_errors=True)
    lat = got["latencies_us"]
    return {"received": len(lat), "latency_us": bc.summarize(lat), "frames_per_s": round(len(lat) / span_s, 1),
            "cpu_s_per_1000_frames": round((cpu + got["cpu_s"]) * 1000 / max(1, len(lat)), 4)}


def transport_alone(args) -> list[dict]:
    rows = []
    for streams in args.streams:
        row = {"streams": streams, "paced": {"shm": [], "zmq": []}, "unpaced": {"shm": [], "zmq": []}}
        for rep in range(args.reps):
            for carrier in (("shm", "zmq") if rep % 2 == 0 else ("zmq", "shm")):
                row["paced"][carrier].append(transport_once(carrier, streams, args.frames, args.tick_ms / 1000))
                row["unpaced"][carrier].append(transport_once(carrier, streams, args.frames, 0.0))
        med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
        row["ratios_shm_vs_zmq"] = {
            "paced_latency_p50": med([a["latency_us"]["p50"] / b["latency_us"]["p50"]
                                      for a, b in zip(row["paced"]["shm"], row["paced"]["zmq"])]),
            "paced_latency_p99": med([a["latency_us"]["p99"] / b["latency_us"]["p99"]
                                      for a, b in zip(row["paced"]["shm"], row["paced"]["zmq"])]),
            "unpaced_frames_per_s": med([a["frames_per_s"] / b["frames_per_s"]
                                         for a, b in zip(row["unpaced"]["shm"], row["unpaced"]["zmq"])]),
            "cpu_per_frame": med([a["cpu_s_per_1000_frames"] / b["cpu_s_per_1000_frames"]
                                  for a, b in zip(row["paced"]["shm"], row["paced"]["zmq"])]),
        }
        bc.log(f"{streams} streams: {row['ratios_shm_vs_zmq']}")
        rows.append(row)
    return rows


# ---------------------------------------------------------------- end to end


def _cpu_of_children(pid: int) -> float:
    """CPU seconds (user + system) of the processes whose parent is ``pid``."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def end_to_end(args) -> list[dict]:
    from bench_compare import MODEL_NAME, Target
    from bench_http import free_port, run_level

    class LevelArgs:
        prompt_words, seed, max_tokens, model = args.prompt_words, 0, args.max_tokens, MODEL_NAME
        request_timeout, level_timeout = 300, 900

    targets = {}
    for carrier in ("shm", "zmq"):
        port = free_port()
        cmd = [sys.executable, "-m", "shared.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", MODEL_NAME]
        targets[carrier] = Target(carrier, "tickserve", f"http://127.0.0.1:{port}", cmd, str(bc.REPO),
                                  {"PYTHONPATH": str(bc.REPO), "TICKSERVE_TRANSPORT": carrier})
    rows = []
    try:
        for t in targets.values():
            t.start()
            t.wait_healthy(300)
        for c in args.http_concurrency:
            row = {"concurrency": c, "shm": [], "zmq": []}
            for rep in range(args.reps):
                for carrier in (("shm", "zmq") if rep % 2 == 0 else ("zmq", "shm")):
                    t = targets[carrier]
                    cpu0 = _cpu_of_children(t.proc.pid)
                    level = asyncio.run(run_level(t.url, c, max(8, 2 * c), LevelArgs))
                    cpu = _cpu_of_children(t.proc.pid) - cpu0
                    tokens = level["output_tokens"] or 1
                    row[carrier].append({"output_tokens_per_s": level["output_tokens_per_s"],
                                         "itl_ms": level["itl_ms"], "cpu_s_per_1000_tokens": round(cpu * 1000 / tokens, 3)})
            med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
            row["ratios_shm_vs_zmq"] = {
                "output_tokens_per_s": med([a["output_tokens_per_s"] / b["output_tokens_per_s"]
                                            for a, b in zip(row["shm"], row["zmq"])]),
                "itl_p50": med([a["itl_ms"]["p50"] / b["itl_ms"]["p50"] for a, b in zip(row["shm"], row["zmq"])]),
                "itl_p99": med([a["itl_ms"]["p99"] / b["itl_ms"]["p99"] for a, b in zip(row["shm"], row["zmq"])]),
                "cpu_per_token": med([a["cpu_s_per_1000_tokens"] / b["cpu_s_per_1000_tokens"]
                                      for a, b in zip(row["shm"], row["zmq"])]),
            }
            bc.log(f"HTTP {c} streams: {row['ratios_shm_vs_zmq']}")
            rows.append(row)
    finally:
        for t in targets.values():
            t.stop()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.sigterm_as_interrupt()
    summary = {"benchmark": "transport_shm_vs_zmq", "env": bc.machine_info("start"),
               "transport_alone": transport_alone(args)}
    if not args.skip_http:
        summary["end_to_end"] = end_to_end(args)
    summary["env"].update(bc.machine_info("end"))
    bc.emit(summary, args.out)
    return 0


if __name__ == "__main__":
    bc.run_main(main)
