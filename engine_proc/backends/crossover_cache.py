"""The low-bit/dense crossover (:func:`~engine_proc.backends.linear.measure_crossover`)
measured once per host, not once per engine.

Timed separately, two engines starting together on one host time each other's load and
can pick different crossovers (seen: 128 rows on one, 32 on the other). The numbers a
pass computes depend on which matmul it takes (the low-bit one quantizes activations to
int8), so two engines of one server could then give one greedy request two answers.
The first engine to start measures under a file lock and writes the answer into the
kernel cache; the others, and later starts, read it.

    <TICKSERVE_CACHE_DIR>/kernels/matmul-crossover-<key>.json   {"quantized_below": N, "key": …}
    <TICKSERVE_CACHE_DIR>/kernels/matmul-crossover-<key>.lock   flock(2) held while one process measures

The key covers what the answer depends on: the CPU (``shared.native_build.cpu_signature``),
the torch version, the caller's parts (layer shape, dtype, low-bit format, kernel ISA and
source digest, threads). A file that does not parse, or holds anything but a positive row count, is
measured again and replaced; an unwritable cache only costs the measurement.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from shared.cache_dir import cache_root
from shared.native_build import cpu_signature

log = logging.getLogger(__name__)

LOCK_WAIT_S = 120.0  # a measurement takes tens of milliseconds; a holder this long is stuck
MAX_ROWS = 1 << 30


def crossover_path(parts: Sequence[str]) -> Path:
    """The cache file for a crossover keyed on ``parts`` (and this CPU and torch)."""
    text = "\n".join([cpu_signature(), torch.__version__, *map(str, parts)])
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"matmul-crossover-{key}.json"


def _read(path: Path) -> int | None:
    try:
        value = json.loads(path.read_text()).get("quantized_below")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_ROWS:
        return value
    return None


def host_crossover(measure: Callable[[], int], parts: Sequence[str]) -> int:
    """``measure()``'s answer for this host and ``parts``: from the cache, or measured now
    under the lock (other processes wait, then read it) and written. Never raises for the
    cache's sake: where it cannot be read or written, the answer is measured here."""
    path = crossover_path(parts)
    cached = _read(path)
    if cached is not None:
        return cached
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")
    except OSError as exc:
        log.debug("matmul crossover cache %s not writable (%s); measuring here only", path.parent, exc)
        return measure()
    with lock:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("the matmul crossover lock %s is held too long; measuring here only", lock.name)
                    return measure()
                time.sleep(0.02)
        cached = _read(path)  # measured by another process while this one waited
        if cached is not None:
            return cached
        value = int(measure())
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"quantized_below": value, "key": list(map(str, parts))}))
            os.replace(tmp, path)
        except OSError as exc:
            log.debug("matmul crossover %s not written (%s)", path, exc)
        return value
