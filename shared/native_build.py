"""The cache of compiled C libraries (the engine's kernels, the shared-memory rings'
fence): looked up without a compiler, checked before ``dlopen``, rebuilt when anything
is wrong, built once per host.

Layout (``<cache>/kernels``, ``<cache>`` as for converted models)::

    <name>-<key>.so      the library
    <name>-<key>.json    its entry: sha256 and size of the .so, its symbols, the target
                         ``-march=native`` resolved to, the compiler, the CPU signature
    <name>-<key>.lock    flock(2) held while one process builds it (the others wait)

``key`` hashes what decides the machine code and needs no compiler to know: the source,
the flags, the machine, and the CPU's features read from CPUID (:func:`cpu_signature` --
the inputs gcc's and clang's ``-march=native`` detection reads, so one key means one
resolved target). The compiler runs only on a miss, and then also resolves
``-march=native`` once (``cc -### -march=native``) and stores the answer in the entry.

Before a library is loaded, :func:`_check` verifies its entry, size, ELF header (64-bit,
this machine, a shared object), checksum and dynamic symbols: a truncated library would
die of SIGBUS inside ``dlopen``, a foreign one under the expected name would lack the
functions. Any failure rebuilds it (under the lock); :class:`BuildFailed` when that is
impossible (no compiler, the build fails, the cache cannot be written) -- the caller
then falls back to torch ops. A build writes temporary files and renames them into
place, library first, entry last.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import mmap
import os
import platform
import shlex
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from shared.cache_dir import cache_root

log = logging.getLogger(__name__)

LOCK_WAIT_S = 600.0  # longest wait for another process's build (a build times out at 300 s)


class BuildFailed(RuntimeError):
    """No usable library: it cannot be built or written here (the message says why, in one line)."""


# ---------------------------------------------------------------- the key

# x86-64 SysV machine code: cpuid(leaf=edi, subleaf=esi) → out[4] at rdx (eax, ebx, ecx, edx)
_CPUID = bytes.fromhex("53" "89f8" "89f1" "4989d0" "0fa2" "418900" "41895804" "41894808" "4189500c" "5b" "c3")
# xgetbv(0) → rax: the register state the OS saves (AVX, AVX-512 enabled or not)
_XGETBV = bytes.fromhex("31c9" "0f01d0" "48c1e220" "4809d0" "c3")
# (leaf, subleaf, mask of eax, ebx, ecx, edx): what -march=native detection reads; the
# masks drop what differs between cores of one machine (APIC ids, core counts)
_LEAVES = ((1, 0, (0x0FFF3FFF, 0x0000FF00, 0xFFFFFFFF, 0xFFFFFFFF)), (7, 0, None), (7, 1, None), (0xD, 1, None),
           (0x14, 0, None), (0x19, 0, None), (0x80000001, 0, None), (0x80000005, 0, None),
           (0x80000006, 0, None), (0x80000008, 0, (0, 0xFFFFFFFF, 0, 0)))

_signature: str | None = None


def cpu_signature() -> str:
    """The CPU as ``-march=native`` sees it: CPUID's vendor, family/model/stepping and
    feature leaves plus the OS-enabled register state (XCR0) on x86-64; elsewhere (or
    where executable memory is refused) ``/proc/cpuinfo``'s identity and feature lines."""
    global _signature
    if _signature is None:
        try:
            _signature = _cpuid_signature()
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            log.debug("CPUID not readable (%s); keying kernels on /proc/cpuinfo", exc)
            _signature = _cpuinfo_signature()
    return _signature


def _cpuid_signature() -> str:
    if platform.machine().lower() not in ("x86_64", "amd64") or not sys.platform.startswith("linux"):
        raise ValueError("not x86-64 Linux")
    code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    try:
        code.write(_CPUID + b"\x90" * (64 - len(_CPUID)) + _XGETBV)
        buf = ctypes.c_char.from_buffer(code)
        base = ctypes.addressof(buf)
        out = (ctypes.c_uint32 * 4)()
        cpuid = ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p)(base)

        def leaf(n: int, sub: int = 0) -> tuple[int, ...]:
            cpuid(n, sub, ctypes.addressof(out))
            return tuple(out)

        max_basic, b, c, d = leaf(0)
        vendor = struct.pack("<III", b, d, c).decode("ascii", "replace")
        max_ext = leaf(0x80000000)[0]
        parts = [vendor]
        for n, sub, masks in _LEAVES:
            if n > (max_ext if n >= 0x80000000 else max_basic):
                continue
            regs = leaf(n, sub)
            if masks:
                regs = tuple(r & m for r, m in zip(regs, masks))
            parts.append(f"{n:x}.{sub}:" + ",".join(f"{r:08x}" for r in regs))
        if leaf(1)[2] & (1 << 27):  # OSXSAVE: xgetbv is allowed
            xcr0 = ctypes.CFUNCTYPE(ctypes.c_uint64)(base + 64)()
            parts.append(f"xcr0:{xcr0:x}")
        del cpuid, buf
    finally:
        try:
            code.close()
        except BufferError:  # a ctypes view still alive: the page goes with the process
            pass
    return "cpuid " + " ".join(parts)


def _cpuinfo_signature() -> str:
    keys = ("vendor_id", "cpu family", "model", "stepping", "flags", "Features", "CPU implementer",
            "CPU architecture", "CPU variant", "CPU part", "CPU revision")
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if not line.strip():
                    if found:
                        break  # the first processor's block is enough
                    continue
                k, _, v = line.partition(":")
                if k.strip() in keys:
                    found.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return "cpuinfo " + (json.dumps(found, sort_keys=True) if found else platform.processor())


def lookup_key(name: str, source: bytes, flags: Sequence[str]) -> str:
    """The cache key of a build (16 hex digits): needs no compiler."""
    h = hashlib.sha256()
    for part in (name.encode(), source, "\0".join(flags).encode(), platform.machine().encode(),
                 cpu_signature().encode()):
        h.update(part + b"\0")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- checks

_EM = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "ppc64le": 21, "s390x": 22, "riscv64": 243}


def elf_problem(path: Path, symbols: Sequence[str]) -> str | None:
    """Why ``path`` is not a 64-bit little-endian shared object for this machine that
    exports ``symbols`` (read from its ``.dynsym``; the file is read, never loaded), or
    ``None``. ELF layout: System V ABI, "Object Files" (ELF-64 header and section headers)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return "is not an ELF file"
    if data[4] != 2 or data[5] != 1:
        return "is not a 64-bit little-endian ELF file"
    e_type, e_machine = struct.unpack_from("<HH", data, 16)
    if e_type != 3:
        return f"is not a shared object (ELF type {e_type})"
    want = _EM.get(platform.machine().lower())
    if want is not None and e_machine != want:
        return f"is built for another machine (ELF machine {e_machine}, this one is {want})"
    shoff, = struct.unpack_from("<Q", data, 40)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    if shoff + shnum * shentsize > len(data) or shentsize < 64:
        return "is truncated (its section headers lie past its end)"
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names: set[str] = set()
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != 11 or not entsize:  # SHT_DYNSYM
            continue
        if offset + size > len(data) or link >= len(sections):
            return "is truncated (its symbol table lies past its end)"
        str_off, str_size = sections[link][4], sections[link][5]
        strtab = data[str_off:str_off + str_size]
        for k in range(size // entsize):
            st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", data, offset + k * entsize)
            if st_shndx and st_info & 0xF == 2:  # defined functions (STT_FUNC)
                names.add(strtab[st_name:strtab.find(b"\0", st_name)].decode("ascii", "replace"))
    missing = [s for s in symbols if s not in names]
    return f"lacks the functions {', '.join(missing)}" if missing else None


def _check(lib: Path, entry_path: Path, symbols: Sequence[str]) -> str | None:
    """Why the cached ``lib`` must not be loaded, or ``None`` (see the module docstring)."""
    try:
        entry = json.loads(entry_path.read_text())
        size, digest = int(entry["size"]), str(entry["sha256"])
    except FileNotFoundError:
        return "has no entry beside it"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"has an unreadable entry ({exc})"
    try:
        st = lib.stat()
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if st.st_size != size:
        return f"is {st.st_size:,} bytes, its entry says {size:,}"
    problem = elf_problem(lib, symbols)
    if problem:
        return problem
    if hashlib.sha256(lib.read_bytes()).hexdigest() != digest:
        return "does not match the checksum in its entry"
    return None


# ---------------------------------------------------------------- building

def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc`` or ``gcc`` on PATH."""
    import shutil

    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def compiler_identity(cc: str) -> tuple[str, bool]:
    """``(first line of cc --version, is it clang)``."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    first = out.split("\n")[0]
    return first, "clang" in out.lower()


def resolve_native(cc: str) -> str:
    """What ``-march=native`` resolves to for ``cc`` here: gcc's ``-march=``/``-mtune=``
    and ``-m`` feature switches, or clang's ``-target-cpu`` and ``-target-feature`` list,
    from the driver's dry run (``cc -### -march=native``). Empty if it says nothing."""
    try:
        done = subprocess.run([cc, "-###", "-march=native", "-x", "c", "-c", os.devnull, "-o", os.devnull],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    for line in done.stderr.splitlines():
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        if "-target-cpu" in words:  # clang
            cpu = words[words.index("-target-cpu") + 1]
            feats = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-target-feature"]
            return " ".join([f"cpu={cpu}"] + sorted(feats))
        march = [w for w in words if w.startswith(("-march=", "-mtune="))]
        if march and any(w.startswith("-march=") and w != "-march=native" for w in march):  # gcc's cc1
            return " ".join(march + sorted(w for w in words if w.startswith("-m") and w not in march))
    return ""


def cached_library(name: str, source: bytes, flags: Sequence[str], symbols: Sequence[str],
                   command: Callable[[str, bool, str, str], list[str]], timeout: float = 300,
                   what: str = "") -> Path:
    """The path of a checked library built from ``source`` with ``flags``, from the cache
    or built now (once per host: other processes wait on the lock, then find it).

    ``command(cc, is_clang, source_file, output)`` is the compiler command line.
    ``symbols``: functions the library must export. ``what``: the INFO line logged before a
    build (default ``building <name>``); a process that waits for another's build logs
    one line saying so. A cache hit logs nothing. Raises :class:`BuildFailed`."""
    root = _root()
    key = lookup_key(name, source, flags)
    lib, entry = root / f"{name}-{key}.so", root / f"{name}-{key}.json"
    problem = _check(lib, entry, symbols) if lib.exists() or entry.exists() else "missing"
    if problem is None:
        return lib
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{name}-{key}.lock", "a")
    except OSError as exc:
        raise BuildFailed(f"the kernel cache {root} cannot be written ({exc.strerror or exc})") from None
    with lock:
        _wait_for(lock, root, name)
        problem = _check(lib, entry, symbols) if lib.exists() or entry.exists() else "missing"
        if problem is None:  # another process built it while this one waited
            return lib
        if problem != "missing":
            log.warning("cached kernel library %s %s; rebuilding it", lib, problem)
        else:
            log.info("%s", what or f"building {name}")
        _build(name, key, source, symbols, command, lib, entry, timeout)
    return lib


def _wait_for(lock, root: Path, name: str) -> None:
    deadline = time.monotonic() + LOCK_WAIT_S
    told = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not told:
                log.info("another process is building %s; waiting for it (once per host)", name)
                told = True
            if time.monotonic() > deadline:
                raise BuildFailed(f"another process has held the kernel build lock in {root} "
                                  f"for over {LOCK_WAIT_S:.0f} s") from None
            time.sleep(0.05)


def _build(name: str, key: str, source: bytes, symbols: Sequence[str], command, lib: Path, entry: Path,
           timeout: float) -> None:
    cc = compiler()
    if cc is None:
        raise BuildFailed("no C compiler (cc or gcc, or $CC) on PATH, and no usable cached build")
    ident, clang = compiler_identity(cc)
    root = lib.parent
    try:
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{name}-", suffix=".so")
        os.close(fd)
    except OSError as exc:
        raise BuildFailed(f"the kernel cache {root} cannot be written ({exc.strerror or exc})") from None
    src, tmp_entry = tmp[:-3] + ".c", ""
    try:
        Path(src).write_bytes(source)
        cmd = command(cc, clang, src, tmp)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as exc:
            raise BuildFailed(f"{cc} could not run: {exc}") from None
        if done.returncode != 0:
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln.lower() or "cannot find" in ln]
            errors = errors or done.stderr.splitlines()
            first = errors[0].strip() if errors else f"exit {done.returncode}"
            hint = " (clang needs LLVM's OpenMP runtime: install libomp-dev, or unset CC)" \
                if clang and "omp" in done.stderr.lower() else ""
            raise BuildFailed(f"building {name} with {cc} failed: {first[:300]}{hint}")
        problem = elf_problem(Path(tmp), symbols)
        if problem:
            raise BuildFailed(f"{cc} built a {name} that {problem}")
        data = Path(tmp).read_bytes()
        record = {"name": name, "key": key, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                  "symbols": list(symbols), "target": resolve_native(cc), "compiler": ident, "clang": clang,
                  "cpu": cpu_signature(), "command": " ".join(cmd[:1] + [c for c in cmd[1:] if c.startswith("-")]),
                  "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        fd, tmp_entry = tempfile.mkstemp(dir=root, prefix=f".{name}-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh, indent=1)
        os.replace(tmp, lib)  # library first, entry last: an entry always describes the file beside it
        os.replace(tmp_entry, entry)
    except OSError as exc:
        raise BuildFailed(f"the kernel cache {root} cannot be written ({exc.strerror or exc})") from None
    finally:
        for leftover in (tmp, src, tmp_entry):
            if leftover and os.path.exists(leftover):
                os.unlink(leftover)
    log.info("built %s into %s (%s; -march=native → %s)", name, lib, ident, record["target"][:80] or "?")


def entry_of(lib: Path) -> dict:
    """The entry written beside ``lib`` (see the module docstring)."""
    return json.loads(lib.with_suffix(".json").read_text())


def _root() -> Path:
    return cache_root() / "kernels"


def build_source(name: str, source: str) -> Path:
    """Compile a small C ``source`` (no kernel shapes) into a cached shared library named
    after ``name`` and its content; the path. Raises :class:`BuildFailed`."""
    flags = ("-O2", "-fPIC", "-shared")
    return cached_library(name, source.encode(), flags, (),
                          lambda cc, clang, src, out: [cc, *flags, src, "-o", out], timeout=120)
