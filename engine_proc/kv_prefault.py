"""Fault the KV pool's host pages in ahead of use, on an idle-priority thread.

A CPU KV pool is ``torch.empty``: anonymous memory whose pages the kernel maps at the first
write. The block pool hands out never-used blocks in id order and keeps freed ones for the
prefix cache, so through a pool's first pass every new row's blocks (zeroed at allocation)
and every K/V write land on pages never touched before: a page fault per 4 KiB, in the tick
thread, inside the forward pass. Measured on a 2-core VM (Firecracker, 4 KiB pages; no
transparent huge pages granted): writing 1 GiB of fresh pages 1.3–2.5 s, of faulted ones
0.15 s; a 3-prompt prefill's RoPE + KV write 53 ms fresh against 5 ms faulted.

:class:`KVPrefaulter` asks the kernel to map the pages without touching them
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14): the contents are unchanged, so it is safe
beside the tick thread's writes. It walks the pool in block-id order (the order the free
queue hands never-used blocks out), a chunk of blocks across every layer at a time, on a
``SCHED_IDLE`` thread: it takes only a core that nothing else wants, and under full load the
tick thread faults its pages itself, as without it. The pool's memory is then resident, as
vLLM's and SGLang's pools are from start-up. Each range is also advised ``MADV_HUGEPAGE``
(fewer TLB misses where the kernel grants huge pages; ignored where it does not).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import threading
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable, contents unchanged
CHUNK_BYTES = 64 << 20  # per step, summed over every layer's K and V


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _madvise(libc, start: int, end: int, advice: int, outward: bool = False) -> int:
    """``madvise`` over the pages inside byte addresses ``[start, end)`` (``outward``: every
    page holding one of those bytes, which is mapped if the bytes are); 0 or an errno."""
    if outward:
        lo, hi = start // _PAGE * _PAGE, -(-end // _PAGE) * _PAGE
    else:
        lo, hi = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if hi <= lo:
        return 0
    if libc.madvise(lo, hi - lo, advice) != 0:
        return ctypes.get_errno() or errno.EINVAL
    return 0


def supported() -> bool:
    """Whether this host can populate pages without writing them (Linux ≥ 5.14)."""
    libc = _libc()
    if libc is None:
        return False
    buf = (ctypes.c_char * (2 * _PAGE))()
    start = ctypes.addressof(buf)
    return _madvise(libc, start, start + 2 * _PAGE, MADV_POPULATE_WRITE, outward=True) == 0


class KVPrefaulter:
    """Populate the pages of ``tensors`` (each ``[num_blocks, …]``, contiguous, on the CPU)
    block range by block range, on a daemon thread at ``SCHED_IDLE``.

    ``start()`` returns at once; ``wait(timeout)`` says whether every page is mapped;
    ``stop()`` ends the walk after its current chunk. Holds the tensors until it ends.
    ``state``: ``"running"``, ``"done"``, ``"stopped"``, or ``"failed: <errno name>"``.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], chunk_bytes: int = CHUNK_BYTES):
        for t in tensors:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("KVPrefaulter takes contiguous CPU tensors")
        self._tensors = list(tensors)  # held so that the memory stays mapped while the walk runs
        self._spans = [(t.data_ptr(), t[0].numel() * t.element_size()) for t in self._tensors]  # (base, bytes a block)
        self.num_blocks = self._tensors[0].shape[0] if self._tensors else 0
        self._blocks_per_chunk = max(1, chunk_bytes // max(1, sum(row for _, row in self._spans)))
        self._stop = threading.Event()
        self._done = threading.Event()
        self.state = "idle"
        self.blocks_done = 0
        self._thread: threading.Thread | None = None

    def start(self) -> KVPrefaulter:
        self.state = "running"
        self._thread = threading.Thread(target=self._run, name="kv-prefault", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """Whether the walk is still mapping pages (it has been started and has not ended)."""
        return self.state == "running"

    def wait(self, timeout: float | None = None) -> bool:
        """True once every block's pages are mapped (False on timeout, stop or failure)."""
        self._done.wait(timeout)
        return self.state == "done"

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        except (OSError, AttributeError):
            pass
        libc = _libc()
        try:
            if libc is None:
                self.state = "failed: no libc"
                return
            for base, row in self._spans:
                _madvise(libc, base, base + self.num_blocks * row, MADV_HUGEPAGE)
            step = self._blocks_per_chunk
            for lo in range(0, self.num_blocks, step):
                if self._stop.is_set():
                    self.state = "stopped"
                    return
                hi = min(self.num_blocks, lo + step)
                for base, row in self._spans:
                    err = _madvise(libc, base + lo * row, base + hi * row, MADV_POPULATE_WRITE,
                                   outward=True)
                    if err:
                        self.state = f"failed: {errno.errorcode.get(err, err)}"
                        log.info("KV prefault stopped at block %d of %d: %s", lo, self.num_blocks, self.state)
                        return
                self.blocks_done = hi
            self.state = "done"
        finally:
            self._tensors = []
            self._done.set()
