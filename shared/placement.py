"""How many engines ``tickserve serve`` starts when ``--data-parallel-size`` is 0 (auto).

On a CPU host the engines split the cores: ``usable CPUs ÷ --torch-threads`` engines
(one thread each when ``--torch-threads`` is unset), at most :data:`MAX_AUTO_ENGINES`,
and no more than fit their weights in half the memory the host has available. On a
GPU (or MPS) one engine. One engine, too, when the engine is placed by address
(``--input-addr`` / ``--output-addr``).

Why several single-threaded engines rather than one engine on every core: a forward
pass on T threads waits at every operator for its slowest thread, and on a host whose
cores the frontends (tokenizing, detokenizing, SSE) and clients also use, one of those
threads is often descheduled — every other thread waits for it, dozens of times per
layer. An engine of one thread never waits for a sibling. Measured with
``tools/bench_scale.py`` and ``tools/bench_compare.py`` on a 2-core host (SmolLM2-135M,
bfloat16, 130-token prompts, 128 output tokens): two one-thread engines served 1.36×
the output tokens/s of one two-thread engine at 64 streams, 1.06× at 16, the same at
1 (a lone prompt's prefill runs on one core instead of two: TTFT 1.3×). The costs:
each engine holds its own weights and a share of the KV memory cap, and each has its
own prefix cache (requests are routed by affinity so that shared prefixes meet).
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_AUTO_ENGINES = 8  # beyond this, measure first: every frontend talks to every engine


def cpu_share(cpus: list[int], index: int, count: int) -> list[int]:
    """Engine ``index``'s share of ``cpus`` when ``count`` engines split them (all of them
    when there are fewer CPUs than engines)."""
    share = max(1, len(cpus) // count)
    return cpus[index * share:(index + 1) * share] or cpus


def available_memory_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``; ``None`` where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def weights_bytes(model_dir: str | os.PathLike) -> int:
    """Bytes of the model's weight files (``*.safetensors``, ``*.bin``): an upper bound
    of one engine's weights in memory (they load at the model's dtype or smaller)."""
    root = Path(model_dir)
    return sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin") for p in root.glob(pattern))


def auto_data_parallel_size(*, device: str, torch_threads: int, cpus: int, by_address: bool,
                            model_dir: str | os.PathLike, accelerator: bool) -> int:
    """The number of engines for ``--data-parallel-size 0``, by the rule in the module
    docstring; always at least 1. ``accelerator``: whether ``--device auto`` would pick a
    GPU or MPS here."""
    if by_address or device != "cpu" and (device != "auto" or accelerator):
        return 1
    n = max(1, cpus // max(1, torch_threads))
    memory, weights = available_memory_bytes(), weights_bytes(model_dir)
    if memory and weights:
        n = min(n, max(1, memory // 2 // weights))
    return max(1, min(n, MAX_AUTO_ENGINES))
