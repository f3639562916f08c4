"""The KV pool's pages are mapped ahead of use without changing what the pool holds."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from engine_proc import kv_prefault
from engine_proc.kv_cache import PagedKVCache

pytestmark = pytest.mark.skipif(not kv_prefault.supported(), reason="needs MADV_POPULATE_WRITE (Linux 5.14+)")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_fraction(t: torch.Tensor) -> float:
    """Share of the pages holding ``t`` that are mapped in this process (mincore(2))."""
    page = mmap.PAGESIZE
    lo = t.data_ptr() // page * page
    hi = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
    vec = (ctypes.c_ubyte * ((hi - lo) // page))()
    assert _libc.mincore(lo, hi - lo, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / len(vec)


MADV_DONTNEED = 4


def big_cache() -> PagedKVCache:
    """A 256 MiB pool whose pages are not mapped (as a fresh pool's are not): the allocator
    may hand out memory an earlier test touched, so its whole pages are dropped first
    (MADV_DONTNEED: they read back as zeros, mapped again at the next write)."""
    cache = PagedKVCache(num_layers=2, num_blocks=16384, block_size=16, num_kv_heads=2, head_dim=64,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    for t in cache.keys + cache.values:
        start = t.data_ptr()
        assert kv_prefault._madvise(kv_prefault._libc(), start, start + t.numel() * t.element_size(),
                                    MADV_DONTNEED) == 0
    return cache


def test_prefault_maps_every_page_and_keeps_the_contents():
    cache = big_cache()
    assert cache.keys[0].numel() * 2 >= 64 << 20
    assert resident_fraction(cache.values[1]) < 0.1  # nothing written yet: nothing mapped
    written = torch.randn(5, 2, 64).to(torch.bfloat16)
    slots = torch.tensor([3, 17, 40000, 131071, 262000])
    for layer in range(2):  # written before and while the walk runs: kept
        cache.write(layer, slots, written.unsqueeze(0).transpose(1, 2), written.unsqueeze(0).transpose(1, 2))
    prefaulter = cache.start_prefault()
    assert prefaulter is not None
    assert prefaulter.wait(timeout=30), prefaulter.state
    assert prefaulter.blocks_done == cache.null_block + 1
    for t in cache.keys + cache.values:
        assert resident_fraction(t) == 1.0
    for layer in range(2):
        k, v = cache.gather(layer, torch.tensor([[3 // 16, 17 // 16, 40000 // 16, 131071 // 16, 262000 // 16]]))
        for i, s in enumerate(slots.tolist()):
            pos = i * 16 + s % 16
            assert torch.equal(k[0, :, pos], written[i]) and torch.equal(v[0, :, pos], written[i])
    assert not cache.keys[0][cache.null_block].any()  # the null block stays zeros


def test_a_stopped_prefault_ends_early_and_says_so():
    cache = big_cache()
    prefaulter = kv_prefault.KVPrefaulter(cache.keys + cache.values, chunk_bytes=1 << 20)
    prefaulter._stop.set()  # before the first chunk
    prefaulter.start()
    assert not prefaulter.wait(timeout=10)
    assert prefaulter.state == "stopped" and prefaulter.blocks_done == 0
    assert resident_fraction(cache.keys[1]) < 0.1


def test_the_served_backend_prefaults_its_pool(tiny_llama):
    from tests.helpers import make_scheduler

    sched = make_scheduler(tiny_llama, record=False)
    prefaulter = sched.backend.kv_prefaulter
    assert prefaulter is not None and prefaulter.wait(timeout=30), prefaulter.state
    assert make_scheduler(tiny_llama, record=False, kv_prefault=False).backend.kv_prefaulter is None
