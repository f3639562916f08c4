"""Decode attention, one layer, SmolLM2's shapes (9 query heads on 3 KV heads, head_dim
64, block size 16): milliseconds per layer for every way the paged backend can attend,
at several batch sizes, with uniform and skewed row lengths, in float32 and bfloat16.

Modes (``engine_proc.backends.paged_attention.DecodeAttention``), all over the same paged cache
with rows' blocks scattered through it, as a busy pool leaves them:

* ``kernel (c)``: the C kernel reading blocks in place (the CPU default);
* ``kernel (torch)``: the same contract in torch ops (gather, two matmuls; the
  fallback without a C compiler, and the non-CPU path);
* ``batched``: one SDPA call over gathered, padded KV with a key mask;
* ``per_row``: one SDPA call per row (the CPU default before the C kernel).

Each figure is the minimum over ``--repeats`` timings of ``--iters`` calls (the floor of
a noisy machine); ratios are against ``per_row`` in the same run. Prints one JSON
document.

Usage:
    python tools/bench_attention.py                          # batch 16 64 128, 1 and 2 threads
    python tools/bench_attention.py --batch 64 --dtypes bfloat16 --threads 1
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as bc  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--uniform-len", type=int, default=200, help="tokens per row, uniform case")
    ap.add_argument("--skew", type=int, nargs=2, default=[50, 1000], help="row lengths drawn from this range")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="also write the JSON summary here")
    return ap.parse_args(argv)


def case(batch: int, lens: list[int], dtype, kernels):
    """A paged cache holding ``batch`` rows of ``lens`` tokens, blocks shuffled, and
    each mode's decode metadata for it."""
    import torch

    from engine_proc.backends.paged_attention import DecodeAttention, PagedForward
    from engine_proc.kv_cache import PagedKVCache

    need = [-(-n // BLOCK) for n in lens]
    cache = PagedKVCache(1, sum(need), BLOCK, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"))
    cache.keys[0].normal_()
    cache.values[0].normal_()
    cache.zero_blocks([cache.null_block])
    blocks = list(range(sum(need)))
    random.Random(batch).shuffle(blocks)
    width = max(need)
    tables, at = [], 0
    for k in need:
        tables.append(blocks[at:at + k] + [cache.null_block] * (width - k))
        at += k
    block_tables = torch.tensor(tables, dtype=torch.int32)
    seq_lens = torch.tensor(lens)
    metas = {}
    for mode in DecodeAttention:
        meta = PagedForward(cache=cache, slots=torch.zeros(batch, dtype=torch.long), block_tables=block_tables,
                            seq_lens=list(lens), is_prefill=False, decode_attention=mode, kernels=kernels,
                            kernel_lens=seq_lens.to(torch.int32))
        if mode is DecodeAttention.BATCHED:
            meta.key_mask = (torch.arange(width * BLOCK)[None, :] < seq_lens[:, None])[:, None, None, :]
        metas[mode] = meta
    return metas


def time_call(fn, iters: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e3


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from engine_proc.backends.paged_attention import DecodeAttention, decode_attention
    from engine_proc.kernels import CKernels, KernelsUnavailable, TorchKernels

    results = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        kernel_sets = [TorchKernels(HEAD_DIM, HEADS // KV_HEADS, BLOCK)]
        try:
            kernel_sets.insert(0, CKernels(dtype, HEAD_DIM, HEADS // KV_HEADS, BLOCK, 1))
        except KernelsUnavailable as exc:
            bc.log(f"no C kernels: {exc}")
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.batch:
                rng = random.Random(batch)
                for shape, lens in (("uniform", [args.uniform_len] * batch),
                                    ("skewed", [rng.randint(*args.skew) for _ in range(batch)])):
                    query = torch.randn(batch, HEADS, 1, HEAD_DIM).to(dtype)
                    row = {"dtype": dtype_name, "threads": threads, "batch": batch, "lengths": shape,
                           "mean_len": round(sum(lens) / batch), "ms_per_layer": {}}
                    for kernels in kernel_sets:
                        if hasattr(kernels, "num_threads"):
                            kernels.num_threads = threads
                        metas = case(batch, lens, dtype, kernels)
                        row["ms_per_layer"][f"kernel ({kernels.name})"] = round(time_call(
                            lambda: decode_attention(metas[DecodeAttention.KERNEL], 0, query, HEAD_DIM ** -0.5),
                            args.iters, args.repeats), 3)
                    for mode in (DecodeAttention.BATCHED, DecodeAttention.PER_ROW):
                        row["ms_per_layer"][mode.value] = round(time_call(
                            lambda: decode_attention(metas[mode], 0, query, HEAD_DIM ** -0.5),
                            args.iters, args.repeats), 3)
                    base = row["ms_per_layer"]["per_row"]
                    row["speedup_vs_per_row"] = {k: round(base / v, 2) for k, v in row["ms_per_layer"].items()}
                    bc.log(f"{dtype_name} {threads}t B={batch} {shape}: {row['ms_per_layer']}")
                    results.append(row)
    bc.emit({"benchmark": "decode_attention_per_layer", "shape": {"heads": HEADS, "kv_heads": KV_HEADS,
             "head_dim": HEAD_DIM, "block_size": BLOCK}, "env": bc.machine_info("end"), "results": results},
            args.out)
    return 0


if __name__ == "__main__":
    bc.run_main(main)
