"""The forward-pass kernels: the C kernels against the torch ops, the torch ops against
plain SDPA, the KV-cache layout helpers, packed linears, the thread plan and dtype
selection; and the lean Llama runner against transformers' forward, through the paged
backend, on the C kernels (block size 16)."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from engine_proc.backends.base import cpu_has_native_bf16, pick_dtype
from engine_proc.backends.llama_runner import Linear, rope_table
from engine_proc.backends.prefill_attention import (KERNEL_PROBES, MATMUL_PROBES, SDPA_ONLY, PrefillAttentionPlan,
                                                    matmul_attention, measure, sdpa_attention)
from engine_proc.kernels import CKernels, TorchKernels, select_kernels
from engine_proc.kernels.build import KernelsUnavailable
from shared.native_build import compiler
from engine_proc.kv_cache import PagedKVCache, gather_blocks, write_slots
from engine_proc.threads import ThreadPlan
from tests.helpers import assert_matches_reference, make_request, make_scheduler, run_until_idle, tokens_of

HAVE_CC = compiler() is not None
needs_c = pytest.mark.skipif(not HAVE_CC and not os.environ.get("TICKSERVE_REQUIRE_C_KERNELS"),
                             reason="no C compiler: the C kernels cannot be built here")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _cache(num_blocks, bs, kvh, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, num_blocks, bs, kvh, d, dtype, torch.device("cpu"))
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=g))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=g))
    return cache


def _tables(lens, bs, num_blocks, seed=0):
    rng = random.Random(seed)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    width = max(-(-n // bs) for n in lens)
    rows, at = [], 0
    for n in lens:
        need = -(-n // bs)
        rows.append(blocks[at:at + need] + [num_blocks] * (width - need))
        at += need
    return torch.tensor(rows, dtype=torch.int32)


def _sdpa_reference(q, cache, tables, lens, heads, kvh, d, scale):
    """Decode attention the slow, obvious way: per row, its own keys, SDPA in float32."""
    out = []
    for b, n in enumerate(lens):
        k, v = cache.gather_row(0, tables[b].long()[: -(-n // cache.block_size)], n)
        qb = q[b].float().view(kvh, heads // kvh, d)
        out.append(F.scaled_dot_product_attention(qb, k.float(), v.float(), scale=scale).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,group", [(16, 2), (64, 3), (64, 1)])
def test_torch_decode_attention_matches_sdpa(dtype, d, group):
    kvh, bs = 2, 16
    heads = kvh * group
    lens = [1, 15, 16, 17, 40, 100]
    cache = _cache(40, bs, kvh, d, dtype)
    tables = _tables(lens, bs, 40)
    q = torch.randn(len(lens), heads * d).to(dtype)
    got = TorchKernels(d, group, bs).decode_attention(q, cache.keys[0], cache.values[0], tables,
                                                      torch.tensor(lens, dtype=torch.int32), d ** -0.5)
    want = _sdpa_reference(q, cache, tables, lens, heads, kvh, d, d ** -0.5)
    assert (got.float() - want).abs().max().item() < TOL[dtype]


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,group,bs", [(16, 2, 16), (64, 3, 16), (64, 1, 32), (128, 4, 16)])
def test_c_decode_attention_matches_torch(dtype, d, group, bs):
    kvh = 2
    heads = kvh * group
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 200]
    cache = _cache(60, bs, kvh, d, dtype, seed=1)
    tables = _tables(lens, bs, 60, seed=1)
    # q as a row-strided view, as the runner passes it (the Q part of a fused QKV row)
    qkv = torch.randn(len(lens), (heads + 2 * kvh) * d).to(dtype)
    q = qkv[:, : heads * d]
    lens_t = torch.tensor(lens, dtype=torch.int32)
    c = CKernels(dtype, d, group, bs, num_threads=2)
    got = c.decode_attention(q, cache.keys[0], cache.values[0], tables, lens_t, d ** -0.5)
    want = _sdpa_reference(q, cache, tables, lens, heads, kvh, d, d ** -0.5)
    assert got.shape == (len(lens), heads * d)
    assert (got.float() - want).abs().max().item() < TOL[dtype]
    c.num_threads = 1  # the same numbers on one thread
    assert torch.equal(got, c.decode_attention(q, cache.keys[0], cache.values[0], tables, lens_t, d ** -0.5))
    c.num_threads = 5  # more threads than work items: some take empty runs of items
    assert torch.equal(got[:1], c.decode_attention(q[:1], cache.keys[0], cache.values[0], tables[:1], lens_t[:1],
                                                   d ** -0.5))


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [20, 21])
def test_c_decode_attention_ignores_garbage_past_a_rows_length(dtype, n):
    """The unwritten tail of a row's last block is read but masked: NaN there changes nothing
    (an odd length leaves a bfloat16 value pair half unwritten)."""
    d, group, bs, kvh = 64, 3, 16, 2
    cache = _cache(8, bs, kvh, d, dtype)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    q = torch.randn(1, kvh * group * d).to(dtype)
    c = CKernels(dtype, d, group, bs, num_threads=1)
    lens = torch.tensor([n], dtype=torch.int32)
    clean = c.decode_attention(q, cache.keys[0], cache.values[0], tables, lens, 0.125)
    k, v = cache.keys[0], cache.values[0]
    for t in range(n - bs, bs):  # the tokens of block 1 past the row's length, in either layout
        if k.dim() == 5:  # bfloat16 pairs: K [.., D/2, bs, 2], V [.., bs/2, D, 2]
            k[1, :, :, t, :] = float("nan")
            v[1, :, t // 2, :, t % 2] = float("nan")
        else:
            k[1, :, :, t] = float("nan")
            v[1, :, t, :] = float("nan")
    got = c.decode_attention(q, cache.keys[0], cache.values[0], tables, lens, 0.125)
    assert not got.isnan().any()
    assert torch.equal(clean, got)


@needs_c
def test_c_decode_attention_long_and_short_rows_in_one_batch():
    """Rows of up to 4,096 keys keep their scores (two-pass softmax); longer rows take the
    online form: both, side by side in one call, match SDPA."""
    d, group, bs, kvh, dtype = 64, 3, 16, 1, torch.bfloat16
    lens = [4096, 4097, 5000, 33]
    nb = sum(-(-n // bs) for n in lens) + 1
    cache = _cache(nb, bs, kvh, d, dtype, seed=2)
    tables = _tables(lens, bs, nb, seed=2)
    q = torch.randn(len(lens), kvh * group * d).to(dtype)
    c = CKernels(dtype, d, group, bs, num_threads=2)
    got = c.decode_attention(q, cache.keys[0], cache.values[0], tables, torch.tensor(lens, dtype=torch.int32),
                             d ** -0.5)
    want = _sdpa_reference(q, cache, tables, lens, kvh * group, kvh, d, d ** -0.5)
    assert (got.float() - want).abs().max().item() < TOL[dtype]


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_rope_write_kv_matches_torch(dtype):
    d, group, bs, kvh = 64, 3, 16, 3
    heads = kvh * group
    c, t = CKernels(dtype, d, group, bs, 2), TorchKernels(d, group, bs)
    qkv = torch.randn(37, (heads + 2 * kvh) * d).to(dtype)
    positions = torch.randint(0, 500, (37,))
    slots = torch.randperm(20 * bs)[:37]
    cos_sin = torch.randn(512, d)
    outs = []
    for k in (c, t):
        x = qkv.clone()
        cache = PagedKVCache(1, 20, bs, kvh, d, dtype, torch.device("cpu"))
        cache.zero_blocks(range(20))  # compare written slots only: the rest is uninitialised
        k.rope_write_kv(x, heads, kvh, positions, cos_sin, slots, cache.keys[0], cache.values[0])
        outs.append((x, cache.keys[0], cache.values[0]))
    for a, b in zip(*outs):
        assert (a.float() - b.float()).abs().max().item() <= TOL[dtype] * 4
    # V is copied untouched, to the slots named
    _, v = gather_blocks(outs[0][1], outs[0][2], slots // bs)  # [kvh, 37 · bs, d]: each slot's block
    picked = v[:, torch.arange(37) * bs + slots % bs].transpose(0, 1)
    assert torch.equal(picked, qkv[:, (heads + kvh) * d:].view(37, kvh, d))


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_written_by_their_own_attention_match_a_separate_write(dtype):
    """rope_write_kv(first_write=B) + decode_attention(new_kv=...) — the decode rows' keys
    and values written by the attention that reads them — leave the same cache bytes and
    give the same output as writing every token first, on the C kernels and the torch
    ones; the C kernels take the attention path of this host (AMX tiles where it has them)."""
    from engine_proc.kernels import NewKV

    d, group, bs, kvh = 64, 3, 16, 3
    heads = kvh * group
    hd, kvd = heads * d, kvh * d
    lens = [1, 17, 40, 235, 16]  # a row's first token; block-boundary rows; a long row
    tables = _tables(lens, bs, 40, seed=3)
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens)])
    positions = torch.tensor([n - 1 for n in lens])
    cos_sin = torch.randn(512, d)
    qkv = torch.randn(len(lens), hd + 2 * kvd).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    for kern in (CKernels(dtype, d, group, bs, 2), TorchKernels(d, group, bs)):
        results = []
        for fused in (False, True):
            cache = _cache(41, bs, kvh, d, dtype, seed=5)
            x = qkv.clone()
            kern.rope_write_kv(x, heads, kvh, positions, cos_sin, slots, cache.keys[0], cache.values[0],
                               first_write=len(lens) if fused else 0)
            new_kv = NewKV(x[:, hd:hd + kvd], x[:, hd + kvd:], slots) if fused else None
            out = kern.decode_attention(x[:, :hd], cache.keys[0], cache.values[0], tables, lens_t, d ** -0.5, new_kv)
            results.append((out, cache.keys[0].clone(), cache.values[0].clone()))
        for a, b in zip(*results):
            assert torch.equal(a, b), kern.name
        untouched = _cache(41, bs, kvh, d, dtype, seed=5)
        assert not torch.equal(untouched.keys[0], results[1][1])  # the new keys did land


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_norm_silu_argmax_match_torch(dtype):
    c, t = CKernels(dtype, 64, 3, 16, 2), TorchKernels(64, 3, 16)
    for rows in (1, 5, 100):
        x = torch.randn(rows, 584).to(dtype)  # 584: a tail after the last 16-wide vector
        w = torch.randn(584).to(dtype)
        r1, r2 = torch.randn(rows, 584).to(dtype), None
        r2 = r1.clone()
        a, b = c.add_rms_norm(x, r1, w, 1e-5), t.add_rms_norm(x, r2, w, 1e-5)
        assert torch.equal(r1, r2)  # the residual sum is rounded once, as torch rounds
        assert (a.float() - b.float()).abs().max().item() <= TOL[dtype] * 4
        assert (c.add_rms_norm(x, None, w, 1e-6).float() - t.add_rms_norm(x, None, w, 1e-6).float()).abs().max() \
            <= TOL[dtype] * 4
        gu = (torch.randn(rows, 2 * 200) * 6).to(dtype)
        assert (c.silu_and_mul(gu).float() - t.silu_and_mul(gu).float()).abs().max().item() <= TOL[dtype] * 8
    logits = torch.randn(9, 1000)
    logits[2, 10] = logits[2, 700] = 99.0  # a tie: the first index wins, as in torch.argmax
    logits[5, -1] = 99.0  # the maximum in the scalar tail
    assert torch.equal(c.argmax(logits), logits.argmax(-1)) and c.argmax(logits)[2].item() == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,start,group", [(7, 0, 3), (5, 11, 3), (16, 40, 1), (1, 9, 2)])
def test_prefill_attention_paths_match_a_float64_reference(dtype, n, start, group):
    """Queries at positions [start, start + n) over start + n keys, causal, grouped-query
    heads: the matmul path and SDPA agree with the obvious per-head float64 softmax."""
    kvh, d = 2, 16
    heads, length = kvh * group, start + n
    g = torch.Generator().manual_seed(n * 100 + start)
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for shape in [(heads, n, d), (kvh, length, d), (kvh, length, d)])
    scores = torch.einsum("hnd,hld->hnl", q.double(), k.double().repeat_interleave(group, 0)) * d ** -0.5
    future = torch.arange(length)[None, :] > torch.arange(start, length)[:, None]
    want = torch.einsum("hnl,hld->hnd", scores.masked_fill(future, float("-inf")).softmax(-1),
                        v.double().repeat_interleave(group, 0))
    for path in (matmul_attention, sdpa_attention):
        got = path(q, k, v, start, d ** -0.5)
        assert got.shape == (heads, n, d)
        assert (got.double() - want).abs().max().item() < 10 * TOL[dtype], path.__name__


@needs_c
def test_prefill_attention_plan_is_measured_from_its_probes():
    """The thresholds come from the probe shapes (0 or a probe's query-key pairs); a pool
    too small for a probe stops the search there; torch kernels measure nothing."""
    kernels = select_kernels(torch.device("cpu"), torch.float32, 16, 2, 16, "c")
    plan = measure(kernels, _cache(300, 16, 2, 16, torch.float32), heads=4, head_dim=16)
    assert plan.kernel_pairs in {0} | {int(n * (s + n / 2)) for n, s in KERNEL_PROBES}
    assert plan.matmul_pairs in {0} | {n * (s + n) for n, s in MATMUL_PROBES}
    assert plan.measured_ms > 0
    small = measure(kernels, _cache(2, 16, 2, 16, torch.float32), heads=4, head_dim=16)  # 32 tokens fit
    assert small.kernel_pairs <= 32 * 16 and small.matmul_pairs <= 32 * 64
    assert measure(TorchKernels(16, 2, 16), _cache(300, 16, 2, 16, torch.float32), 4, 16) is SDPA_ONLY
    assert plan.uses_kernel(1, 0) == (plan.kernel_pairs > 0) and not SDPA_ONLY.uses_matmul(1, 1)


def test_kv_layout_round_trip():
    cache = PagedKVCache(1, 6, 4, 2, 8, torch.float32, torch.device("cpu"))
    slots = torch.tensor([0, 5, 6, 13, 23])
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    write_slots(cache.keys[0], cache.values[0], slots, k, v)
    gk, gv = gather_blocks(cache.keys[0], cache.values[0], torch.arange(6))  # [2, 24, 8]
    assert torch.equal(gk[:, slots].transpose(0, 1), k) and torch.equal(gv[:, slots].transpose(0, 1), v)
    assert cache.keys[0][6].abs().sum() == 0  # the null block stays zero


def test_select_kernels_falls_back_and_refuses_loudly():
    assert select_kernels(torch.device("cpu"), torch.float32, 16, 2, 16, prefer="torch").name == "torch"
    assert select_kernels(torch.device("cpu"), torch.float32, 8, 2, 16).name == "torch"  # head_dim 8: no C kernel
    with pytest.raises(KernelsUnavailable):
        select_kernels(torch.device("cpu"), torch.float32, 8, 2, 16, prefer="c")
    with pytest.raises(KernelsUnavailable):
        select_kernels(torch.device("cpu"), torch.float16, 64, 2, 16, prefer="c")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_equals_f_linear(dtype):
    w, b = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
    lin = Linear(w, b, pack=True)
    x = torch.randn(7, 64).to(dtype)
    assert (lin(x).float() - F.linear(x, w, b).float()).abs().max().item() < (1e-4 if dtype == torch.float32 else 0.1)
    assert Linear(w, None, pack=False).packed is None


def test_thread_plan_one_thread_for_small_passes():
    before = torch.get_num_threads()
    try:
        plan = ThreadPlan(max_threads=2, single_thread_below=32)
        assert plan.threads_for(1) == 1 and plan.threads_for(31) == 1 and plan.threads_for(32) == 2
        assert plan.apply(64) == 2 and torch.get_num_threads() == 2
        assert plan.apply(3) == 1 and torch.get_num_threads() == 1
        assert ThreadPlan(max_threads=2, single_thread_below=0).threads_for(1) == 2
    finally:
        torch.set_num_threads(before)


def test_auto_dtype_follows_the_cpu():
    assert pick_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert pick_dtype("float32", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="int8"):
        pick_dtype("int8", torch.device("cpu"))


def test_rope_table_is_the_models_rotary_embedding(tiny_llama):
    table = rope_table(tiny_llama.model.rotary_emb, 100, 16, torch.device("cpu"))
    cos, sin = tiny_llama.model.rotary_emb(torch.zeros(1), torch.arange(100)[None])
    assert torch.allclose(table[:, :8], cos[0, :, :8]) and torch.allclose(table[:, 8:], sin[0, :, :8])


PREFILL_PATHS = {"kernel": PrefillAttentionPlan(kernel_pairs=1 << 40), "matmul": PrefillAttentionPlan(matmul_pairs=1 << 40),
                 "sdpa": SDPA_ONLY, "measured": None}


@needs_c
@pytest.mark.parametrize("path", sorted(PREFILL_PATHS))
@pytest.mark.parametrize("mode", ["chunked", "mixed_batch"])
def test_runner_on_c_kernels_matches_transformers(tiny_llama, mode, path, monkeypatch):
    """Block size 16 and the tiny Llama's head_dim 16: the C kernels run. Rows joining and
    leaving, sharing a prefix, mixed with prefill: every step's logits equal transformers'
    teacher-forced forward, whichever path prefill attention takes (``measured``: the
    plan the backend measured at construction); a forced path is the one taken."""
    from engine_proc.backends import llama_runner

    sched = make_scheduler(tiny_llama, kv_block_size=16, prefill_mode=mode, prefill_chunk_size=24)
    assert sched.backend.kernels.name == "c" and sched.backend.runner is not None
    calls = {"matmul": 0, "sdpa": 0}
    for name, fn in (("matmul", matmul_attention), ("sdpa", sdpa_attention)):
        monkeypatch.setattr(llama_runner, f"{name}_attention",
                            lambda *a, _fn=fn, _name=name: calls.__setitem__(_name, calls[_name] + 1) or _fn(*a))
    if PREFILL_PATHS[path] is not None:
        sched.backend.runner.prefill_plan = PREFILL_PATHS[path]
    rng = random.Random(3)
    system = [rng.randrange(3, 49152) for _ in range(40)]
    prompts = [(system if i % 2 else []) + [rng.randrange(3, 49152) for _ in range(5 + 9 * i)] for i in range(6)]
    reqs = [make_request(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, [30, 4, 17, 1, 25, 9])]
    outs = run_until_idle(sched, {0: reqs[:2], 3: reqs[2:4], 7: reqs[4:]})
    for req in reqs:
        toks = tokens_of(outs[req.request_id])
        assert len(toks) == req.params.max_tokens
        assert_matches_reference(tiny_llama, req.prompt_token_ids, toks, sched.backend.logits[req.request_id])
    if path != "measured":
        assert {k for k, v in calls.items() if v} == ({path} if path != "kernel" else set()), calls


@needs_c
def test_transformers_path_on_c_kernels_matches_the_runner():
    """Models the runner does not take run transformers' forward with the paged attention
    function over the same C decode kernel. In float32 both paths give the same logits;
    in bfloat16 (pairs layout) both stay as close to float32 as each other."""
    from engine_proc.backends.base import PrefillChunk
    from engine_proc.backends.paged import PagedBackend
    from engine_proc.block_pool import BlockPool
    from tests.conftest import make_tiny_llama

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 23, 40)]

    def run(dtype, runner):
        model = make_tiny_llama().to(dtype)
        pool = BlockPool(40, 16)
        backend = PagedBackend(model, 256, pool, runner=None if runner else False)
        assert (backend.runner is not None) == runner and backend.kernels.name == "c"
        rows = [f"r{i}" for i in range(len(prompts))]
        for r, prompt in zip(rows, prompts):
            pool.allocate(r, [], len(prompt) + 8)
        out = [torch.stack(backend.prefill_chunks([PrefillChunk(r, pr, 0, True) for r, pr in zip(rows, prompts)]))]
        for r in rows:
            backend.promote(r)
        for step in range(6):
            out.append(backend.decode_step_batched(rows, [7 + step] * 3, [len(pr) + step for pr in prompts]))
        return torch.cat(out)

    truth = run(torch.float32, True)
    assert (run(torch.float32, False) - truth).abs().max().item() < 1e-4 * truth.abs().max().item()
    err = {runner: (run(torch.bfloat16, runner) - truth).abs().mean().item() for runner in (True, False)}
    assert err[True] <= 1.5 * err[False] + 1e-3, err
