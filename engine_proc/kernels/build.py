"""Compile ``cpu_kernels.c`` for this CPU at run time, cache the shared library, load it.

The library is built once per (source, CPU, dtype, head_dim, group, block_size) with
``cc -O3 -march=native -fopenmp`` (about a second) and kept in the kernel cache
(:mod:`shared.native_build`: looked up without a compiler, checked before it is loaded, rebuilt
when it is damaged, built by one process while the others wait). gcc and clang both
build it; clang's OpenMP code needs LLVM's runtime (libomp), whose idle threads are told
not to spin (``KMP_BLOCKTIME=0``) so they leave the cores to torch's own pool.

:func:`load` raises :class:`KernelsUnavailable` (no compiler and no cached build, a failed
build, an unwritable cache, a dtype the C code does not handle) in one line; callers then
fall back to :mod:`engine_proc.kernels.torch_ops`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.native_build import BuildFailed, cached_library, compiler, entry_of

log = logging.getLogger(__name__)

__all__ = ["KernelShape", "KernelsUnavailable", "build", "compiler", "load", "load_qmatmul"]

SOURCE = Path(__file__).with_name("cpu_kernels.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
          "-std=gnu11", "-ffp-contract=fast", "-Wall", "-Werror=implicit-function-declaration")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
BUILDING = "building C kernels for this CPU (first start on this host, a few seconds; cached afterwards)"


class KernelsUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here (the message says why)."""


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


def build(shape: KernelShape) -> Path:
    """The checked library for ``shape`` from the kernel cache, built if it lacks one.

    Raises :class:`KernelsUnavailable` when there is none and none can be built."""
    if shape.dtype not in DTYPES:
        raise KernelsUnavailable(f"no C kernels for {shape.dtype} (float32 and bfloat16 only)")
    if shape.head_dim % 16 or shape.block_size % 16:
        raise KernelsUnavailable(f"head_dim ({shape.head_dim}) and block_size ({shape.block_size}) must be "
                                 "multiples of 16")
    if platform.system() != "Linux":
        raise KernelsUnavailable(f"C kernels are built on Linux only, not {platform.system()}")
    flags = CFLAGS + tuple(shape.defines())
    try:
        return cached_library("cpu_kernels", SOURCE.read_bytes(), flags, tuple(SIGNATURES),
                              lambda cc, clang, src, out: [cc, *flags, src, "-o", out, "-lm"], what=BUILDING)
    except BuildFailed as exc:
        raise KernelsUnavailable(str(exc)) from None


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I = ctypes.c_int
_F = ctypes.c_float
SIGNATURES = {
    "decode_attention": [_P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I, _I, _F, _I, _P, _P, _I64, _P],
    "rope_write_kv": [_P, _I64, _I, _I, _I, _P, _P, _P, _P, _P, _I, _I],
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F, _I],
    "silu_and_mul": [_P, _P, _I, _I, _I],
    "argmax_rows": [_P, _I64, _I, _I, _P, _I],
    "decode_attention_isa": [],
    "decode_layers": [_P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _P, _F, _I],
}
RESTYPES = {"decode_attention_isa": ctypes.c_char_p, "decode_layers": _I}


QMATMUL_SOURCE = Path(__file__).with_name("qmatmul.c")
QMATMUL_SIGNATURES = {
    "qmatmul": ([_I, _P, _I, _I, _P, _I64, _I, _P, _P, _I64, _I, _I], _I),
    "qmatmul_isa": ([], ctypes.c_char_p),
    "qmatmul_tile_rows": ([], _I),
}


def load(shape: KernelShape) -> ctypes.CDLL:
    """Build (if needed) and load the library for ``shape``; its functions carry their
    argument types. A library that passed the cache's checks but still does not load is
    rebuilt once. Raises :class:`KernelsUnavailable`."""
    return _load(lambda: build(shape), {name: (args, RESTYPES.get(name)) for name, args in SIGNATURES.items()})


def load_qmatmul(dtype: torch.dtype) -> ctypes.CDLL:
    """Build (if needed) and load ``qmatmul.c`` for activations of ``dtype`` (the low-bit
    matmul of :class:`~engine_proc.kernels.QMatmul`). Raises :class:`KernelsUnavailable`."""
    if dtype not in DTYPES:
        raise KernelsUnavailable(f"no low-bit matmul for {dtype} activations (float32 and bfloat16 only)")
    if platform.system() != "Linux":
        raise KernelsUnavailable(f"C kernels are built on Linux only, not {platform.system()}")
    flags = CFLAGS + (f"-DSCALAR_BF16={DTYPES[dtype]}",)

    def build_qmatmul() -> Path:
        try:
            return cached_library("qmatmul", QMATMUL_SOURCE.read_bytes(), flags, tuple(QMATMUL_SIGNATURES),
                                  lambda cc, clang, src, out: [cc, *flags, src, "-o", out, "-lm"],
                                  what=BUILDING.replace("C kernels", "the C low-bit matmul"))
        except BuildFailed as exc:
            raise KernelsUnavailable(str(exc)) from None

    return _load(build_qmatmul, QMATMUL_SIGNATURES)


def _load(build_library, signatures: dict) -> ctypes.CDLL:
    for attempt in range(2):
        path = build_library()
        try:
            if entry_of(path).get("clang"):
                os.environ.setdefault("KMP_BLOCKTIME", "0")  # LLVM's OpenMP threads: sleep when idle
            lib = ctypes.CDLL(str(path))
            for name, (argtypes, restype) in signatures.items():
                fn = getattr(lib, name)
                fn.argtypes = argtypes
                fn.restype = restype
            return lib
        except (OSError, AttributeError, ValueError) as exc:
            if attempt:
                raise KernelsUnavailable(f"loading {path} failed: {exc}") from None
            log.warning("loading %s failed (%s); rebuilding it", path, exc)
            for stale in (path, path.with_suffix(".json")):
                stale.unlink(missing_ok=True)
    raise AssertionError("unreachable")
