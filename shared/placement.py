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
    """Memory this process may still take, bytes: ``MemAvailable`` from ``/proc/meminfo``,
    capped by its memory cgroup's headroom (:func:`cgroup_memory_headroom`: a container's
    limit, not the host's free memory); ``None`` where neither is known."""
    known = [m for m in (host_memory_available(), cgroup_memory_headroom()) if m is not None]
    return min(known) if known else None


def host_memory_available() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``, bytes; ``None`` where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def cgroup_memory_headroom(proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
                           root: str | os.PathLike = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroups still allow, the tightest over the process's
    cgroup and its ancestors: ``limit − (usage − inactive file cache)`` (the working set, as
    the kubelet counts it: inactive page cache is reclaimed before the limit bites).
    cgroup v2 (``memory.max``, ``memory.current``, ``memory.stat`` ``inactive_file``) or v1
    (``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``total_inactive_file``).
    ``None`` where no level sets a limit or nothing can be read."""
    root = Path(root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        parts = [p for p in path.strip().split("/") if p]
        if hierarchy == "0" and controllers == "":  # v2 (under unified/ on a hybrid host)
            top = root if (root / "cgroup.controllers").exists() else root / "unified"
            names = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            top, names = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        for depth in range(len(parts), -1, -1):  # the process's cgroup, then each ancestor
            headroom = _level_headroom(top.joinpath(*parts[:depth]), *names)
            if headroom is not None:
                best = headroom if best is None else min(best, headroom)
    return best


def _level_headroom(d: Path, limit_name: str, usage_name: str, inactive_name: str) -> int | None:
    try:
        raw = (d / limit_name).read_text().strip()
        if raw == "max" or int(raw) >= _UNLIMITED:
            return None
        limit, usage = int(raw), int((d / usage_name).read_text().strip())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        for line in (d / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_name:
                inactive = int(value)
                break
    except (OSError, ValueError):
        pass
    return max(0, limit - max(0, usage - inactive))


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
