"""Paged backend benchmarks: prefix caching on vs off, and decode paged vs hf.

In-process on the real model (SmolLM2-135M-Instruct unless ``--model``), built exactly
as the engine builds it (``engine_proc.factory.build_scheduler``); no HTTP, no ZeroMQ.
Prompts are seeded random token ids and every request ignores EOS, so each mode does
the same work. A token's time is when ``Scheduler.step()`` returns the tick that made it.

1. ``prefix``: ``--num-requests`` (32) requests share a ``--system-len`` (1,000) token
   system prompt, each followed by its own 16..64-token user part, ``--prefix-max-tokens``
   (8) tokens out. ``--arrivals together`` (default): all arrive in the same tick, so
   later rows reuse the blocks request 0 commits chunk by chunk; ``staggered``: request
   0 first, the others when it streams its first token. Chunked prefill, engine defaults. Baseline: the same
   paged backend with ``prefix_caching`` off. Reports TTFT (mean, p50, p99) and
   throughput, and ``ratios`` (off / on for TTFT, on / off for throughput).
2. ``decode``: ``--streams`` (32) requests with mixed prompt lengths (``--decode-prompt-min``
   .. ``--decode-prompt-max`` tokens) and 75..100 % of ``--decode-max-tokens`` (32) out,
   all admitted in the first tick (monolithic prefill) so they decode together.
   Baseline: the ``hf`` backend (left-padded ``DynamicCache``), its ticks alternating
   with the paged run's so both see the same machine load. Reports decode tokens/s
   over every decode step and over full-batch steps only, and ``ratios`` (paged / hf).

Usage:
    .venv/bin/python tools/bench_paged.py                      # both (about 4-5 min on 2 cores)
    .venv/bin/python tools/bench_paged.py --only prefix        # about 2-3 min
    .venv/bin/python tools/bench_paged.py --only decode --streams 16 --out bench-results/paged.json

Prints one JSON object on stdout (progress on stderr). ``--torch-threads 0`` is the
engine's default (all cores but one); timings on a shared machine move with its load
(``machine`` records the load average at start and end), ratios from one run less so.
"""

from __future__ import annotations

import argparse
import random
import time

import _bench_common as bc


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["prefix", "decode"], help="run one benchmark (default: both)")
    ap.add_argument("--model", default="", help="model directory or .gguf; empty → SmolLM2-135M-Instruct")
    ap.add_argument("--num-requests", type=int, default=32, help="prefix: requests sharing the system prompt")
    ap.add_argument("--system-len", type=int, default=1000, help="prefix: tokens in the shared system prompt")
    ap.add_argument("--prefix-max-tokens", type=int, default=8, help="prefix: tokens generated per request")
    ap.add_argument("--prefill-chunk-size", type=int, default=256, help="prefix: PREFILL_CHUNK_SIZE")
    ap.add_argument("--arrivals", choices=["together", "staggered"], default="together",
                    help="prefix: all requests in one tick, or the rest after request 0's first token")
    ap.add_argument("--streams", type=int, default=32, help="decode: concurrent streams")
    ap.add_argument("--decode-prompt-min", type=int, default=64, help="decode: shortest prompt (tokens)")
    ap.add_argument("--decode-prompt-max", type=int, default=640, help="decode: longest prompt (tokens)")
    ap.add_argument("--decode-max-tokens", type=int, default=32, help="decode: most tokens per stream")
    ap.add_argument("--torch-threads", type=int, default=0, help="0 → the engine's default (cores - 1)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON summary here")
    return ap.parse_args(argv)


def engine_config(args, **overrides):
    from shared.config import EngineConfig

    base = dict(model=args.model, device=args.device, torch_threads=args.torch_threads, seed=args.seed,
                max_batch_size=max(args.num_requests, args.streams), max_model_len=2048)
    config = EngineConfig(**{**base, **overrides})
    problems = config.problems()
    if problems:
        raise SystemExit("bad configuration: " + "; ".join(problems))
    return config


class TimedBackend:
    """Wraps a backend; records ``(batch, seconds)`` of every decode step."""

    def __init__(self, inner):
        self.inner = inner
        self.decode_steps: list[tuple[int, float]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode_step_batched(self, row_ids, token_ids, positions):
        t0 = time.perf_counter()
        out = self.inner.decode_step_batched(row_ids, token_ids, positions)
        self.decode_steps.append((len(row_ids), time.perf_counter() - t0))
        return out


def drive(sched, first: list, rest: list, rest_after_first_token: bool, max_ticks: int = 100_000) -> dict:
    """Tick until idle. ``first`` arrive at once; ``rest`` when ``first[0]`` streams its
    first token (or with ``first`` when not ``rest_after_first_token``). Returns per
    request: arrival, first-token and finish times (perf_counter seconds)."""
    times = {}
    t0 = time.perf_counter()
    for req in first + ([] if rest_after_first_token else rest):
        sched.add_request(req)
        times[req.request_id] = {"arrival": t0, "req": req}
    pending_rest = rest if rest_after_first_token else []
    for _ in range(max_ticks):
        if not sched.has_work() and not pending_rest:
            break
        outputs = sched.step()
        now = time.perf_counter()
        for _, out in outputs:
            rec = times[out.request_id]
            if out.token_ids and "first" not in rec:
                rec["first"] = now
            if out.finish_reason is not None:
                rec["finish"] = now
        if pending_rest and "first" in times[first[0].request_id]:
            for req in pending_rest:
                sched.add_request(req)
                times[req.request_id] = {"arrival": now, "req": req}
            pending_rest = []
    return times


def summarize_run(times: dict, wall_s: float) -> dict:
    reqs = [rec["req"] for rec in times.values()]
    ttft = [rec["first"] - rec["arrival"] for rec in times.values()]
    out_tokens = sum(r.num_output_tokens for r in reqs)
    prompt_tokens = sum(r.prompt_len for r in reqs)
    return {
        "requests": len(reqs),
        "ttft_s": bc.summarize(ttft, 3),
        "wall_s": round(wall_s, 2),
        "output_tokens_per_s": round(out_tokens / wall_s, 2),
        "requests_per_s": round(len(reqs) / wall_s, 3),
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": sum(r.num_cached_tokens for r in reqs),
    }


def bench_prefix(model, args) -> dict:
    """Benchmark 1: a shared system prompt, prefix caching on vs off."""
    from engine_proc.factory import build_scheduler

    vocab = model.config.vocab_size
    results = {}
    for caching in (False, True):
        rng = random.Random(args.seed)  # same prompts in both modes
        system = bc.random_prompt(rng, args.system_len, vocab)
        prompts = [system + bc.random_prompt(rng, rng.randint(16, 64), vocab) for _ in range(args.num_requests)]
        reqs = [bc.make_request(p, args.prefix_max_tokens) for p in prompts]
        sched = build_scheduler(engine_config(args, backend="paged", prefix_caching=caching,
                                              prefill_chunk_size=args.prefill_chunk_size), model)
        t0 = time.perf_counter()
        times = drive(sched, reqs[:1], reqs[1:], rest_after_first_token=args.arrivals == "staggered")
        wall = time.perf_counter() - t0
        name = "caching_on" if caching else "caching_off"
        results[name] = summarize_run(times, wall)
        results[name]["prefix_hit_rate"] = round(sched.block_pool.stats()["prefix_hit_rate"], 3)
        bc.log(f"prefix {name}: TTFT mean {results[name]['ttft_s']['mean']} s, wall {wall:.1f} s")
    on, off = results["caching_on"], results["caching_off"]
    results["ratios"] = {
        "ttft_mean_off_over_on": bc.ratio(off["ttft_s"]["mean"], on["ttft_s"]["mean"]),
        "ttft_p50_off_over_on": bc.ratio(off["ttft_s"]["p50"], on["ttft_s"]["p50"]),
        "output_throughput_on_over_off": bc.ratio(on["output_tokens_per_s"], off["output_tokens_per_s"]),
    }
    results["setup"] = {"system_len": args.system_len, "num_requests": args.num_requests,
                        "user_len": "16..64", "max_tokens": args.prefix_max_tokens,
                        "prefill_chunk_size": args.prefill_chunk_size,
                        "arrivals": args.arrivals}
    return results


def bench_decode(model, args) -> dict:
    """Benchmark 2: decode throughput, paged vs hf, ``--streams`` concurrent streams.

    Both schedulers get the same requests and their ticks alternate (hf, paged, hf, ...),
    so load from other processes on a shared machine hits both alike. Each backend's
    wall time is the sum of its own ticks."""
    from engine_proc.factory import build_scheduler

    vocab = model.config.vocab_size
    lo_out = max(1, args.decode_max_tokens * 3 // 4)
    rng = random.Random(args.seed + 1)
    specs = [(bc.random_prompt(rng, rng.randint(args.decode_prompt_min, args.decode_prompt_max), vocab),
              rng.randint(lo_out, args.decode_max_tokens)) for _ in range(args.streams)]
    runs = {}
    for backend in ("hf", "paged"):
        sched = build_scheduler(engine_config(args, backend=backend, prefill_mode="monolithic",
                                              prefill_chunk_size=0), model)
        sched.backend = TimedBackend(sched.backend)
        reqs = [bc.make_request(prompt, max_tokens) for prompt, max_tokens in specs]
        for req in reqs:
            sched.add_request(req)
        runs[backend] = {"sched": sched, "reqs": reqs, "busy_s": 0.0, "first_tick_s": None}
    while any(run["sched"].has_work() for run in runs.values()):
        for run in runs.values():
            if run["sched"].has_work():
                t0 = time.perf_counter()
                run["sched"].step()
                dt = time.perf_counter() - t0
                run["busy_s"] += dt
                if run["first_tick_s"] is None:
                    run["first_tick_s"] = dt
    results = {}
    for backend, run in runs.items():
        steps = run["sched"].backend.decode_steps
        full = [(b, s) for b, s in steps if b == args.streams]
        out_tokens = sum(r.num_output_tokens for r in run["reqs"])
        results[backend] = {
            "requests": len(run["reqs"]),
            "prefill_tick_s": round(run["first_tick_s"], 2),  # every prompt, monolithic, in tick 1
            "busy_s": round(run["busy_s"], 2),
            "output_tokens_per_s": round(out_tokens / run["busy_s"], 2),
            "decode_steps": len(steps),
            "decode_tokens_per_s": round(sum(b for b, _ in steps) / sum(s for _, s in steps), 2),
            "full_batch_steps": len(full),
            "full_batch_tokens_per_s": round(sum(b for b, _ in full) / sum(s for _, s in full), 2) if full else None,
            "full_batch_step_ms": bc.summarize([s * 1e3 for _, s in full], 1),
        }
        bc.log(f"decode {backend}: {results[backend]['decode_tokens_per_s']} tok/s over {len(steps)} steps")
    paged, hf = results["paged"], results["hf"]
    results["ratios"] = {
        "decode_tokens_per_s_paged_over_hf": bc.ratio(paged["decode_tokens_per_s"], hf["decode_tokens_per_s"]),
        "full_batch_tokens_per_s_paged_over_hf": bc.ratio(paged["full_batch_tokens_per_s"],
                                                          hf["full_batch_tokens_per_s"]),
        "busy_hf_over_paged": bc.ratio(hf["busy_s"], paged["busy_s"]),
    }
    results["setup"] = {"streams": args.streams,
                        "prompt_len": f"{args.decode_prompt_min}..{args.decode_prompt_max}",
                        "max_tokens": f"{lo_out}..{args.decode_max_tokens}",
                        "prefill_mode": "monolithic", "ticks": "alternating hf / paged"}
    return results


def warm_up(model, args) -> None:
    """A short unrecorded run on each backend: the first forwards in a process are slower."""
    from engine_proc.factory import build_scheduler

    rng = random.Random(args.seed + 99)
    for backend in ("hf", "paged"):
        sched = build_scheduler(engine_config(args, backend=backend, prefill_mode="monolithic",
                                              prefill_chunk_size=0), model)
        reqs = [bc.make_request(bc.random_prompt(rng, 256, model.config.vocab_size), 4) for _ in range(4)]
        drive(sched, reqs, [], rest_after_first_token=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.sigterm_as_interrupt()
    summary = {"benchmark": "bench_paged", "machine": bc.machine_info("start")}
    model = bc.load_real_model(engine_config(args))
    summary["torch"] = bc.torch_info()
    t0 = time.perf_counter()
    warm_up(model, args)
    bc.log(f"warm-up {time.perf_counter() - t0:.1f} s")
    if args.only in (None, "prefix"):
        summary["prefix"] = bench_prefix(model, args)
    if args.only in (None, "decode"):
        summary["decode"] = bench_decode(model, args)
    summary["machine"].update(bc.machine_info("end"))
    bc.emit(summary, args.out)
    return 0


if __name__ == "__main__":
    bc.run_main(main)
