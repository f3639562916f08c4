"""Disaggregated prefill and decode against the one-engine modes: running streams' pace
while a long prompt arrives, that prompt's first token, and the handover itself.

Over HTTP (``--part http``), each layout on its own ``tickserve serve`` at its defaults
otherwise (SmolLM2, default context length): 8 greedy streams decode, and once each has
20 chunks a ~1,600-token prompt is sent (``tools/bench_itl.py``'s measurement: SSE chunk
arrival times at the client; the window runs from its sending to 1 s after its first
chunk, "steady" is the same streams before it). Layouts:

* ``monolithic``: ``--prefill-mode monolithic``, one engine per core (the TTFT baseline);
* ``default``: the default server (chunked, one engine per core);
* ``disaggregated``: ``--prefill-mode disaggregated`` at its defaults (1 prefill + 1
  decode engine on 2 cores).

Targets: the disaggregated streams' window ITL p99 ≤ 2× their steady ITL p50, and the
prompt's TTFT ≤ 1.3× monolithic's, both in the same run.

Handover time (``--part handover``): two KV caches of the model's shape (its dtype on
this host) and the real carriers in one process: a row of N tokens (100, 1,000, 4,000)
is copied out of one cache's blocks into the handover (a sealed memfd over the unix
socket, or metadata + KV frames over loopback tcp), received, validated and copied into
the other cache's blocks; the time from the first byte copied out to the last copied in
(median of ``--repeats``). Carriers: ``shm-staging`` (the connection's staging area, as
the engines use it; after the first handover its pages are mapped), ``shm-memfd`` (a
fresh sealed memfd per handover, the fallback for a row that does not fit), ``tcp``.

Usage:
    python tools/bench_disagg.py --out bench-results/disagg.json
    python tools/bench_disagg.py --part handover            # a few seconds
Prints one JSON summary on stdout (progress on stderr); servers it starts are stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time

import _bench_common as bc


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["http", "handover", "both"], default="both")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-prompt-len", type=int, default=32)
    ap.add_argument("--http-long-len", type=int, default=1600)
    ap.add_argument("--http-tail-s", type=float, default=1.0)
    ap.add_argument("--lengths", type=int, nargs="*", default=[100, 1000, 4000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=900)
    ap.add_argument("--out")
    return ap.parse_args(argv)


LAYOUTS = [("monolithic", ["--prefill-mode", "monolithic"]), ("default", []),
           ("disaggregated", ["--prefill-mode", "disaggregated"])]


def run_http(args, deadline: bc.Deadline) -> dict:
    import httpx
    from bench_http import Server, free_port
    from bench_itl import _http_measure

    results = {}
    for name, flags in LAYOUTS:
        if deadline.expired():
            bc.log(f"out of time, skipping {name}")
            continue
        server = Server(free_port(), flags)
        try:
            server.wait_healthy(300)
            time.sleep(3)  # every engine up (health is 200 with the first)
            res = asyncio.run(_http_measure(server.url, args, 49152))
            stats = httpx.get(f"{server.url}/scheduler/stats", timeout=10).json()
        finally:
            server.stop()
        w, b = res["itl_window_ms"], res["itl_before_ms"]
        res["window_p99_over_steady_p50"] = bc.ratio(w["p99"], b["p50"])
        if "handovers" in stats:
            res["handovers"] = stats["handovers"]
        bc.log(f"{name}: TTFT {res['long_ttft_s']} s, window ITL p99 {w['p99']} ms, steady p50 {b['p50']} ms")
        results[name] = res
    out = {"layouts": results}
    d, m, dflt = (results.get(k) for k in ("disaggregated", "monolithic", "default"))
    if d and m:
        out["disaggregated_vs"] = {
            "itl_window_p99_over_steady_p50": d["window_p99_over_steady_p50"],
            "ttft_over_monolithic": bc.ratio(d["long_ttft_s"], m["long_ttft_s"]),
            "ttft_over_default": bc.ratio(d["long_ttft_s"], dflt["long_ttft_s"]) if dflt else None,
        }
        v = out["disaggregated_vs"]
        v["meets_itl_target"] = v["itl_window_p99_over_steady_p50"] is not None and \
            v["itl_window_p99_over_steady_p50"] <= 2.0
        v["meets_ttft_target"] = v["ttft_over_monolithic"] is not None and v["ttft_over_monolithic"] <= 1.3
    return out


def run_handover(args) -> dict:
    import torch

    from engine_proc.backends.base import pick_dtype
    from engine_proc.handover import kv_layout
    from engine_proc.handover_link import as_tensor
    from engine_proc.kv_cache import PagedKVCache
    from shared import handover_wire as hw
    from shared.handover_client import HandoverClient
    from shared.handover_transport import HandoverServer
    from shared.protocol import RequestOutput, SamplingParams

    dtype = pick_dtype("auto", torch.device("cpu"))
    layers, kv_heads, head_dim, bs = 30, 3, 64, 16  # SmolLM2-135M
    longest = max(args.lengths)
    nb = -(-longest // bs) + 1
    src = PagedKVCache(layers, nb, bs, kv_heads, head_dim, dtype, torch.device("cpu"))
    dst = PagedKVCache(layers, nb, bs, kv_heads, head_dim, dtype, torch.device("cpu"))
    for t in src.keys + src.values:
        t.copy_(torch.randn(t.shape).to(dtype))
    layout = kv_layout(src)
    out = {"dtype": str(dtype).removeprefix("torch."), "block_nbytes": layout.block_nbytes, "carriers": {}}
    for carrier in ("shm-staging", "shm-memfd", "tcp"):
        run = tempfile.mkdtemp(prefix="ts-ho-")
        from bench_http import free_port

        addr = f"tcp://127.0.0.1:{free_port()}"
        shm = carrier.startswith("shm")
        server = HandoverServer(hw.DecodeHello("bench", layout), run_dir=run if shm else "",
                                tcp_addr=addr if not shm else "", max_kv_bytes=1 << 31)
        staging = 2 * nb * layout.block_nbytes + (16 << 20) if carrier == "shm-staging" else 0
        client = HandoverClient(run if shm else addr, staging_bytes=staging)
        got: list = []
        stop = threading.Event()

        def serve():
            while not stop.is_set():
                got.extend(server.poll(1))

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        deadline = bc.Deadline(10)
        while not client.ready and not deadline.expired():
            client.connect()
            client.receive()
            time.sleep(0.01)
        per_len = {}
        for n in args.lengths:
            blocks = list(range(-(-n // bs)))
            times = []
            for i in range(args.repeats):
                h = hw.Handover(f"r{n}-{i}", "fe", [1] * n, [2], SamplingParams(max_tokens=8), "", 0, 0, None,
                                RequestOutput(f"r{n}-{i}", [2]), layout, n, len(blocks),
                                len(blocks) * layout.block_nbytes, time.time())
                got.clear()
                t0 = time.perf_counter()
                client.send_handover(h, lambda view: src.copy_blocks_out(blocks, as_tensor(view)))
                while not got:
                    time.sleep(0.0002)
                item = got[0]
                assert hw.layout_problem(item.msg, len(item.payload), layout) is None
                dst.copy_blocks_in(blocks, as_tensor(item.payload))
                times.append(time.perf_counter() - t0)
                got.clear()
                client.receive()
                client._extents.clear()  # what KVReleased does (nothing else holds the room here)
            assert torch.equal(dst.keys[-1][blocks[-1]], src.keys[-1][blocks[-1]])
            per_len[n] = {"ms_median": round(sorted(times)[len(times) // 2] * 1e3, 2),
                          "ms_min": round(min(times) * 1e3, 2), "mb": round(len(blocks) * layout.block_nbytes / 1e6, 1)}
            bc.log(f"handover {carrier} {n} tokens: {per_len[n]}")
        stop.set()
        thread.join(2)
        client.disconnect()
        server.close()
        out["carriers"][carrier] = per_len
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.sigterm_as_interrupt()
    env = bc.machine_info("start")
    deadline = bc.Deadline(args.max_seconds)
    summary = {"benchmark": "disaggregated_prefill_decode", "baseline": "monolithic, one engine per core (same run)"}
    if args.part in ("handover", "both"):
        summary["handover"] = run_handover(args)
    if args.part in ("http", "both"):
        summary["http"] = run_http(args, deadline)
    summary["env"] = {**env, **bc.machine_info("end"), **bc.torch_info()}
    bc.emit(summary, args.out)
    return 0


if __name__ == "__main__":
    bc.run_main(main)
