"""Compile a C source for this machine at run time into a shared library, cached.

A library is kept under ``<cache>/kernels/`` (``<cache>``: :func:`shared.cache_dir.cache_root`),
named after what changes its machine code, and built only when absent. A build writes a
temporary file beside its target and renames it into place, so two processes building
at once both end with one complete library. Used by the engine's C kernels
(:mod:`engine_proc.kernels.build`) and the shared-memory rings' memory fence
(:mod:`shared.shm`). Every failure is :class:`KernelsUnavailable`.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from shared.cache_dir import cache_root


class KernelsUnavailable(RuntimeError):
    """The C kernels (or a native helper) cannot be built or loaded here (the message says why)."""


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc`` or ``gcc`` on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def cpu_flags() -> str:
    """This CPU's feature flags as ``/proc/cpuinfo`` lists them (a cache key: a library
    built with ``-march=native`` runs only where they match)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def compiler_version(cc: str) -> str:
    """The first line of ``cc --version`` (a cache key), or ``""``."""
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return ""


def compile_library(path: Path, what: str, command, source: str | None = None, timeout: float = 120) -> None:
    """Run ``command(output)`` into a temporary file beside ``path`` and rename it into
    place (so two processes building at once both end with one complete library);
    ``source``, if given, is written to a temporary ``.c`` file first and
    ``command(output, source_file)`` gets its name. Raises :class:`KernelsUnavailable`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    src = tmp[:-3] + ".c"
    try:
        if source is not None:
            Path(src).write_text(source)
        cmd = command(tmp) if source is None else command(tmp, src)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise KernelsUnavailable(f"building {what} failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelsUnavailable(f"building {what} failed: {exc}") from None
    finally:
        for leftover in (tmp, src):
            if os.path.exists(leftover):
                os.unlink(leftover)


def build_source(name: str, source: str) -> Path:
    """Compile a small C ``source`` (no kernel shapes) into a cached shared library named
    after ``name`` and its content; the path. Raises :class:`KernelsUnavailable`."""
    cc = compiler()
    if cc is None:
        raise KernelsUnavailable("no C compiler (cc or gcc) on PATH")
    h = hashlib.sha256(f"{source}\0{compiler_version(cc)}\0{platform.machine()}".encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"{name}-{h}.so"
    if not path.exists():
        compile_library(path, name, lambda out, src: [cc, "-O2", "-fPIC", "-shared", src, "-o", out], source=source)
    return path
