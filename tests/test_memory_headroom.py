"""The memory a process may take is capped by its memory cgroup (a container's limit),
not only the host's MemAvailable: the KV pool is sized from it and then mapped whole."""

from __future__ import annotations

from pathlib import Path

from shared import placement

GiB = 1 << 30


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_minus_working_set_tightest_level_wins(tmp_path):
    root = tmp_path / "cg"
    write(root / "cgroup.controllers", "cpu memory\n")
    pod, ctr = root / "kubepods" / "pod1", root / "kubepods" / "pod1" / "ctr"
    write(pod / "memory.max", f"{6 * GiB}\n")
    write(pod / "memory.current", f"{2 * GiB}\n")
    write(ctr / "memory.max", "max\n")  # no limit of its own: the pod's applies
    write(ctr / "memory.current", f"{1 * GiB}\n")
    write(pod / "memory.stat", f"anon 1\ninactive_file {1 * GiB}\nactive_file 5\n")
    proc = tmp_path / "cgroup"
    write(proc, "0::/kubepods/pod1/ctr\n")
    assert placement.cgroup_memory_headroom(proc, root) == 6 * GiB - (2 * GiB - 1 * GiB)
    write(ctr / "memory.max", f"{2 * GiB}\n")  # now the container's own limit is tighter
    assert placement.cgroup_memory_headroom(proc, root) == 1 * GiB


def test_cgroup_v1_and_no_limit(tmp_path):
    root = tmp_path / "cg"
    d = root / "memory" / "docker" / "abc"
    write(d / "memory.limit_in_bytes", f"{4 * GiB}\n")
    write(d / "memory.usage_in_bytes", f"{3 * GiB}\n")
    write(d / "memory.stat", f"cache 7\ntotal_inactive_file {GiB // 2}\n")
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "unlimited"
    write(root / "memory" / "memory.usage_in_bytes", f"{20 * GiB}\n")
    proc = tmp_path / "cgroup"
    write(proc, "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert placement.cgroup_memory_headroom(proc, root) == 4 * GiB - (3 * GiB - GiB // 2)
    write(proc, "4:memory:/\n0::/\n")  # a host process: the root cgroup sets no limit
    assert placement.cgroup_memory_headroom(proc, root) is None
    assert placement.cgroup_memory_headroom(tmp_path / "missing", root) is None


def test_available_memory_takes_the_smaller_of_host_and_cgroup(monkeypatch):
    assert placement.host_memory_available() > 0  # this test host has /proc/meminfo
    # the host's figure pinned: the real one moves while other tests run
    monkeypatch.setattr(placement, "host_memory_available", lambda: 8 * GiB)
    monkeypatch.setattr(placement, "cgroup_memory_headroom", lambda: 3 * GiB)
    assert placement.available_memory_bytes() == 3 * GiB
    monkeypatch.setattr(placement, "cgroup_memory_headroom", lambda: None)
    assert placement.available_memory_bytes() == 8 * GiB
    monkeypatch.setattr(placement, "host_memory_available", lambda: None)
    assert placement.available_memory_bytes() is None
