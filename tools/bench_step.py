"""Where a decode step's time goes: one step of the paged backend at several batch
sizes, through tickserve's Llama runner and through transformers' forward (the path
every model took before), timed and profiled with ``torch.profiler``.

For each batch size B: B rows are prefilled with ``--context`` tokens each, then
decode steps are timed (minimum of ``--repeats`` runs of ``--steps`` steps: the floor
of a noisy machine) and one more run is profiled. The C kernels are ctypes calls the
profiler cannot see by itself; here each is wrapped in a ``record_function`` of its
name for the profiled run only. Reports per mode: ms per step, tokens/s, the ratio
against transformers' forward in the same run, and the profile's top entries by self
CPU time (matmuls, kernels, the rest). Prints one JSON document.

With ``--quantization auto|int8|int4`` a third mode, ``served``, builds the backend as an
engine does (``engine_proc.factory``: the GGUF's low-bit weights, the host's measured
low-bit/dense crossover) and profiles the low-bit matmul (``tickserve::qmatmul``) too. Where
its decode steps run their layers in one C call (``engine_proc.backends.decode_loop``), the
step is also timed with the layers' calls made from Python (``ms_per_step_python_layers``),
and that is the run profiled (the C loop is one opaque call to the profiler).

Usage:
    python tools/bench_step.py                                  # batch 1 and 64, bfloat16
    python tools/bench_step.py --batch 1 16 64 --dtype float32 --threads 1
    python tools/bench_step.py --batch 64 128 --threads 1 --quantization auto   # as `tickserve serve` runs
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as bc  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model directory or .gguf; empty → the embedded SmolLM2")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 → every usable CPU")
    ap.add_argument("--context", type=int, default=200, help="tokens of KV per row when decoding starts")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=12, help="profile rows to report")
    ap.add_argument("--quantization", default="", help="also profile the served path with these weights (auto, int8, int4)")
    ap.add_argument("--out", help="also write the JSON summary here")
    return ap.parse_args(argv)


def _profiled_kernels(kernels):
    """Wrap the kernels' methods in record_function (profiled run only)."""
    import torch

    originals = {}
    for name in ("decode_attention", "rope_write_kv", "add_rms_norm", "silu_and_mul", "argmax"):
        fn = getattr(kernels, name)
        originals[name] = fn

        def wrapped(*a, _fn=fn, _name=name, **kw):
            with torch.profiler.record_function(f"tickserve::{_name}"):
                return _fn(*a, **kw)
        setattr(kernels, name, wrapped)
    return originals


def _profiled_qmatmul(backend):
    """Wrap the low-bit matmul of every layer in record_function (profiled run only)."""
    import torch

    if backend.qmatmul is None:
        return
    inner = backend.qmatmul

    def wrapped(*a, **kw):
        with torch.profiler.record_function("tickserve::qmatmul"):
            return inner(*a, **kw)
    for layer in backend.runner.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if lin.qmatmul is not None:
                lin.qmatmul = wrapped
    if backend.runner.lm_head.qmatmul is not None:
        backend.runner.lm_head.qmatmul = wrapped


def run_mode(model, batch: int, args, runner: bool, engine_config=None) -> dict:
    import torch

    from engine_proc.backends.base import PrefillChunk
    from engine_proc.backends.paged import PagedBackend
    from engine_proc.block_pool import BlockPool

    pool = BlockPool(batch * (-(-(args.context + 4 * args.steps * (args.repeats + 2)) // 16) + 1), 16)
    if engine_config is not None:  # as an engine builds it
        from engine_proc.factory import make_backend

        backend = make_backend(engine_config, model, 4096, pool)
    else:
        backend = PagedBackend(model, 4096, pool, runner=None if runner else False)
    rows = [f"r{i}" for i in range(batch)]
    for r in rows:
        pool.allocate(r, [], args.context + 4 * args.steps * (args.repeats + 2))
    prompt = list(range(100, 100 + args.context))
    for i in range(0, batch, 8):
        backend.prefill_chunks([PrefillChunk(r, prompt, 0, True) for r in rows[i:i + 8]])
    for r in rows:
        backend.promote(r)
    pos = [args.context]

    def step():
        backend.decode_step_batched(rows, [5] * batch, [pos[0]] * batch)
        pos[0] += 1

    def timed() -> float:
        step()
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            best = min(best, (time.perf_counter() - t0) / args.steps)
        return best

    loop = getattr(backend.runner, "decode_loop", None)
    loop_used = loop is not None and loop.applies(batch)
    best = timed()
    extra = {}
    if loop_used:  # the same step with the layers' calls made from Python; that loop is also the one profiled
        backend.runner.decode_loop = None
        extra = {"ms_per_step_python_layers": round(timed() * 1e3, 2)}
    originals = _profiled_kernels(backend.kernels) if backend.runner is not None else {}
    if engine_config is not None:
        _profiled_qmatmul(backend)  # the backend is not used after this run
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    for name, fn in originals.items():
        setattr(backend.kernels, name, fn)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) or 1
    top = [{"op": e.key, "ms_per_step": round(e.self_cpu_time_total / 1e3 / args.steps, 3),
            "share": round(e.self_cpu_time_total / total, 3), "calls_per_step": e.count // args.steps}
           for e in events[:args.top]]
    return {"runner": backend.model_runner, "kernels": backend.kernels.name, "matmul": backend.matmul_plan,
            "weights": getattr(backend, "weights_precision", "") or "dense", "ms_per_step": round(best * 1e3, 2),
            "tokens_per_s": round(batch / best, 1), "decode_layers_in_c": loop_used, **extra, "profile_top": top}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from engine_proc.backends.base import pick_device, pick_dtype
    from shared.models import hf_directory
    from engine_proc.threads import usable_cpus
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads or usable_cpus())
    dtype = pick_dtype(args.dtype, pick_device("cpu"))
    model_dir = str(hf_directory(args.model))
    results = []
    for batch in args.batch:
        row = {"batch": batch}
        for runner in (False, True):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
            row["tickserve" if runner else "transformers"] = run_mode(model, batch, args, runner)
        row["speedup_vs_transformers"] = round(row["transformers"]["ms_per_step"] / row["tickserve"]["ms_per_step"], 2)
        bc.log(f"B={batch}: transformers {row['transformers']['ms_per_step']} ms, "
               f"tickserve {row['tickserve']['ms_per_step']} ms ({row['speedup_vs_transformers']}x)")
        if args.quantization:
            from engine_proc.factory import load_model
            from shared import config as cfg

            engine_config = cfg.build(cfg.EngineConfig, {}, {}, model=args.model, dtype=args.dtype,
                                      quantization=args.quantization, torch_threads=torch.get_num_threads())
            served, _ = load_model(engine_config)
            row["served"] = run_mode(served, batch, args, True, engine_config)
            row["served_vs_tickserve"] = round(row["tickserve"]["ms_per_step"] / row["served"]["ms_per_step"], 2)
            bc.log(f"B={batch}: served ({row['served']['matmul']}) {row['served']['ms_per_step']} ms")
        results.append(row)
    bc.emit({"benchmark": "decode_step_profile", "model": model_dir, "dtype": str(dtype).removeprefix("torch."),
             "context": args.context, "env": {**bc.torch_info(), **bc.machine_info("end")}, "results": results},
            args.out)
    return 0


if __name__ == "__main__":
    bc.run_main(main)
