"""Compile ``cpu_kernels.c`` for this CPU at run time, cache the shared library, load it.

The library is built once per (source, compiler, CPU features, dtype, head_dim, group,
block_size) with ``cc -O3 -march=native -fopenmp`` (about a second) and kept under
``<cache>/kernels/<key>.so`` (``<cache>`` as for converted models: ``TICKSERVE_CACHE_DIR``,
default ``~/.cache/tickserve``) by :mod:`shared.native_build`, which writes a temporary
file and renames it into place, so two engines starting at once both end with one
complete library.

:func:`load` raises :class:`KernelsUnavailable` (no compiler, a failed build, a dtype the
C code does not handle); callers then fall back to :mod:`engine_proc.kernels.torch_ops`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.cache_dir import cache_root
from shared.native_build import KernelsUnavailable, compile_library, compiler, compiler_version, cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
          "-std=gnu11", "-ffp-contract=fast", "-Wall", "-Werror=implicit-function-declaration")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class KernelShape:
    """The constants one library is compiled for."""

    dtype: torch.dtype
    head_dim: int
    group: int  # query heads per KV head
    block_size: int  # tokens per KV block

    def defines(self) -> list[str]:
        return [f"-DSCALAR_BF16={DTYPES[self.dtype]}", f"-DHEAD_DIM={self.head_dim}", f"-DGROUP={self.group}",
                f"-DBLOCK_SIZE={self.block_size}"]


def library_path(shape: KernelShape, cc: str) -> Path:
    """Where the library for ``shape`` lives in the cache (keyed on everything that
    changes the machine code)."""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS + tuple(shape.defines())).encode(),
                 compiler_version(cc).encode(), cpu_flags().encode(), platform.machine().encode()):
        h.update(part + b"\0")
    return cache_root() / "kernels" / f"cpu_kernels-{h.hexdigest()[:16]}.so"


def build(shape: KernelShape) -> Path:
    """The compiled library for ``shape``, building it if the cache lacks it.

    Raises :class:`KernelsUnavailable` when there is no compiler or the build fails."""
    if shape.dtype not in DTYPES:
        raise KernelsUnavailable(f"no C kernels for {shape.dtype} (float32 and bfloat16 only)")
    if shape.head_dim % 16 or shape.block_size % 16:
        raise KernelsUnavailable(f"head_dim ({shape.head_dim}) and block_size ({shape.block_size}) must be "
                                 "multiples of 16")
    if platform.system() != "Linux":
        raise KernelsUnavailable(f"C kernels are built on Linux only, not {platform.system()}")
    cc = compiler()
    if cc is None:
        raise KernelsUnavailable("no C compiler (cc or gcc) on PATH")
    path = library_path(shape, cc)
    if not path.exists():
        compile_library(path, "the C kernels",
                        lambda out: [cc, *CFLAGS, *shape.defines(), str(SOURCE), "-o", out, "-lm"], timeout=300)
        log.info("built the C kernels for %s into %s", shape, path)
    return path


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I = ctypes.c_int
_F = ctypes.c_float
SIGNATURES = {
    "decode_attention": [_P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I, _I, _F, _I],
    "rope_write_kv": [_P, _I64, _I, _I, _I, _P, _P, _P, _P, _P, _I],
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F, _I],
    "silu_and_mul": [_P, _P, _I, _I, _I],
    "argmax_rows": [_P, _I64, _I, _I, _P, _I],
}


def load(shape: KernelShape) -> ctypes.CDLL:
    """Build (if needed) and load the library for ``shape``; its functions carry their
    argument types. Raises :class:`KernelsUnavailable`."""
    path = build(shape)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelsUnavailable(f"loading {path} failed: {exc}") from None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = None
    return lib
