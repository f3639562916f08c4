"""The paths a host without AVX-512 (or without AMX) takes, tested on any x86 host that can run AVX2:
``cpu_kernels.c`` compiled for x86-64-v3 (AVX2, FMA; no AVX-512, no native bf16)
against the torch ops, and a whole engine pass with torch itself held to AVX2
(``ATEN_CPU_CAPABILITY=avx2``) giving the same greedy tokens as the default."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from engine_proc.kernels import CKernels, TorchKernels
from engine_proc.kernels.build import CFLAGS, DTYPES, RESTYPES, SIGNATURES, SOURCE, KernelShape
from shared.native_build import compiler
from tests.test_kernels import TOL, _cache, _sdpa_reference, _tables


def _has_avx2() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma", "f16c"} <= set(flags)


pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or compiler() is None or not _has_avx2(),
                                reason="needs an x86-64 host with AVX2 and a C compiler")


def _avx2_kernels(tmp_path, dtype, d, group, bs, march=("-march=x86-64-v3",)) -> CKernels:
    """CKernels whose library is built for x86-64-v3 (or ``march``) instead of the host."""
    out = tmp_path / f"cpu_kernels-{abs(hash(march))}-{DTYPES[dtype]}-{d}-{group}-{bs}.so"
    flags = [f for f in CFLAGS if not f.startswith("-march")] + list(march)
    subprocess.run([compiler(), *flags, *KernelShape(dtype, d, group, bs).defines(), str(SOURCE), "-o", str(out),
                    "-lm"], check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(out))
    for name, args in SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = RESTYPES.get(name)
    kernels = CKernels.__new__(CKernels)
    TorchKernels.__init__(kernels, d, group, bs)
    kernels.lib, kernels.dtype, kernels.num_threads = lib, dtype, 2
    kernels.attention_isa = lib.decode_attention_isa().decode()
    return kernels


def _has(*flags) -> bool:
    try:
        return set(flags) <= set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return False


@pytest.mark.skipif(not _has("amx_tile", "amx_bf16"), reason="needs a host with AMX (bf16 tiles)")
@pytest.mark.parametrize("d,group,bs", [(64, 3, 16), (64, 1, 32), (128, 4, 16)])
def test_decode_attention_on_amx_tiles_matches_the_vector_path(tmp_path, d, group, bs):
    """On an AMX host the host build multiplies in tiles; the same source built without AMX
    takes vdpbf16ps. Both agree with SDPA, on lengths that end mid-block, mid-pair and on a
    block edge, and past the two-pass limit (online softmax, vectors in both)."""
    kvh, dtype = 2, torch.bfloat16
    heads = kvh * group
    tiles = CKernels(dtype, d, group, bs, num_threads=2)
    vectors = _avx2_kernels(tmp_path, dtype, d, group, bs,
                            march=("-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"))
    assert (tiles.attention_isa, vectors.attention_isa) == ("amx-bf16", "avx512-bf16")
    lens = [1, 2, 15, 16, 17, 31, 33, 200, 4097]
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    cache = _cache(num_blocks, bs, kvh, d, dtype, seed=5)
    tables = _tables(lens, bs, num_blocks, seed=5)
    q = torch.randn(len(lens), heads * d).to(dtype)
    args = (q, cache.keys[0], cache.values[0], tables, torch.tensor(lens, dtype=torch.int32), d ** -0.5)
    want = _sdpa_reference(q, cache, tables, lens, heads, kvh, d, d ** -0.5)
    got_tiles, got_vectors = tiles.decode_attention(*args), vectors.decode_attention(*args)
    assert (got_tiles.float() - want).abs().max().item() < TOL[dtype]
    assert (got_vectors.float() - want).abs().max().item() < TOL[dtype]
    assert (got_tiles.float() - got_vectors.float()).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_build_of_the_c_kernels_matches_torch(tmp_path, dtype):
    d, group, bs, kvh = 64, 3, 16, 2
    heads = kvh * group
    c, t = _avx2_kernels(tmp_path, dtype, d, group, bs), TorchKernels(d, group, bs)
    lens = [1, 15, 16, 17, 200, 333]
    cache = _cache(60, bs, kvh, d, dtype, seed=3)
    tables = _tables(lens, bs, 60, seed=3)
    q = torch.randn(len(lens), heads * d).to(dtype)
    got = c.decode_attention(q, cache.keys[0], cache.values[0], tables, torch.tensor(lens, dtype=torch.int32),
                             d ** -0.5)
    want = _sdpa_reference(q, cache, tables, lens, heads, kvh, d, d ** -0.5)
    assert (got.float() - want).abs().max().item() < TOL[dtype]
    x, res, w = torch.randn(7, 576).to(dtype), torch.randn(7, 576).to(dtype), torch.randn(576).to(dtype)
    res_c, res_t = res.clone(), res.clone()  # residual += x happens in place
    torch.testing.assert_close(c.add_rms_norm(x, res_c, w, 1e-5).float(), t.add_rms_norm(x, res_t, w, 1e-5).float(),
                               atol=TOL[dtype] * 10, rtol=TOL[dtype])
    torch.testing.assert_close(res_c.float(), res_t.float(), atol=TOL[dtype], rtol=TOL[dtype])
    gate_up = torch.randn(5, 2 * 96).to(dtype)
    torch.testing.assert_close(c.silu_and_mul(gate_up).float(), t.silu_and_mul(gate_up).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


_GENERATE = """
import json, sys, torch
from tests.conftest import make_tiny_llama
from tests.helpers import make_request, make_scheduler, run_until_idle, tokens_of
model = make_tiny_llama(vocab_size=512)
sched = make_scheduler(model, record=False, prefill_mode="chunked", prefill_chunk_size=8)
reqs = [make_request(p, max_tokens=8, ignore_eos=True) for p in ([5, 17, 99, 123, 7], list(range(40, 75)))]
outs = run_until_idle(sched, {0: reqs})
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "kernels": sched.backend.kernels.name,
                  "tokens": [tokens_of(outs[r.request_id]) for r in reqs]}))
"""


def test_torch_held_to_avx2_generates_the_same_greedy_tokens(tmp_path):
    """The tiny float32 Llama through the paged backend, once as the host runs it and once
    with ``ATEN_CPU_CAPABILITY=avx2`` (torch's own kernels without AVX-512): the same tokens."""
    runs = {}
    for label, extra in (("host", {}), ("avx2", {"ATEN_CPU_CAPABILITY": "avx2"})):
        env = {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(sys.path)}
        done = subprocess.run([sys.executable, "-c", _GENERATE], env=env, capture_output=True, text=True, timeout=180,
                              cwd=str(tmp_path))
        assert done.returncode == 0, done.stderr[-2000:]
        runs[label] = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["avx2"]["capability"] == "AVX2"
    assert runs["avx2"]["tokens"] == runs["host"]["tokens"]
    assert all(len(t) == 8 for t in runs["host"]["tokens"])
