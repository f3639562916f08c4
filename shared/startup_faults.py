"""Start-up faults that a restart cannot heal, told apart from those it can.

A model whose weights are truncated, a model directory without tokenizer files, a file
that is not a GGUF, a setting that can never work: starting again finds the same files
and fails the same way, so the supervisor must stop, not restart for ever. Each such
fault is a :class:`StartupFault` naming the file and the problem in one line; a process
that meets one prints that line and exits :data:`EXIT_CONFIG` (sysexits' ``EX_CONFIG``),
which ``tickserve serve`` does not restart. Anything else that stops a start (memory
that ran out, a killed process) is transient: the process exits non-zero with its
traceback and the supervisor restarts it with backoff.

The checks read headers only (a safetensors file's first bytes, a GGUF's magic): they
cost milliseconds, so ``tickserve serve`` runs them before it starts anything, and the
engine and frontend again before they load (a child started on its own has no serve
before it). :func:`classify` turns what a loader raised into a fault where the cause is
in the files.

No torch here: the supervisor imports this module.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
import sys
from pathlib import Path

EXIT_CONFIG = 78
"""Exit status of a process that cannot start with its configuration or its files."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken", "qwen.tiktoken")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
GGUF_MAGIC = b"GGUF"
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own bound on its JSON header

# errno values of a file that is missing, unreadable or of the wrong kind: a restart finds it so again
_FILE_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ELOOP,
                errno.ENAMETOOLONG, errno.EINVAL}


class StartupFault(Exception):
    """A fault in the configuration or the files that a restart cannot heal.

    ``path``: the file or directory at fault; ``problem``: what is wrong with it. ``str()``
    is the one line to print."""

    def __init__(self, path: str | os.PathLike, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = str(path), problem


def check_gguf(path: str | os.PathLike) -> None:
    """Raises :class:`StartupFault` unless ``path`` is a readable file that starts like a
    GGUF file (magic ``GGUF``, version 1 to 3)."""
    head = _head(path, 8)
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise StartupFault(path, f"not a GGUF file (it starts with {head[:4]!r}, a GGUF file with b'GGUF')")
    version = struct.unpack("<I", head[4:8])[0]
    if not 1 <= version <= 3:
        raise StartupFault(path, f"GGUF version {version} is not one this build reads (1 to 3)")


def check_model_dir(path: str | os.PathLike, weights: bool = True, tokenizer: bool = True) -> None:
    """Raises :class:`StartupFault` for the first thing in the Hugging Face directory
    ``path`` that cannot load: ``config.json`` unreadable or not a JSON object, weight
    files missing, unreadable or truncated (``weights``), no tokenizer files or a
    ``tokenizer.json`` that does not parse (``tokenizer``)."""
    root = Path(path)
    try:
        names = set(os.listdir(root))
    except OSError as exc:
        raise StartupFault(root, f"cannot be read ({exc.strerror or exc})") from None
    if "config.json" not in names:
        raise StartupFault(root, "not a Hugging Face model directory (no config.json)")
    _check_json(root / "config.json")
    if weights:
        _check_weights(root, names)
    if tokenizer:
        if not names & set(TOKENIZER_FILES):
            raise StartupFault(root, "has no tokenizer files (none of " + ", ".join(TOKENIZER_FILES[:4])
                               + "); copy the model's tokenizer into it")
        if "tokenizer.json" in names:  # the tokenizers library fails on a bad one with a bare Exception
            _check_json(root / "tokenizer.json")


def _check_json(path: Path) -> None:
    try:
        parsed = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise StartupFault(path, f"cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise StartupFault(path, f"is not valid JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise StartupFault(path, "is not a JSON object")


def _check_weights(root: Path, names: set[str]) -> None:
    index = root / "model.safetensors.index.json"
    if index.name in names:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StartupFault(index, f"is not a readable safetensors index ({exc})") from None
        for shard in shards:
            check_safetensors(root / shard)
        return
    files = sorted(f for pattern in WEIGHT_PATTERNS for f in root.glob(pattern))
    if not files:
        raise StartupFault(root, "has no weights (model.safetensors or pytorch_model.bin)")
    for f in files:
        if f.suffix == ".safetensors":
            check_safetensors(f)
        elif not _head(f, 1):
            raise StartupFault(f, "is empty")


def check_safetensors(path: str | os.PathLike) -> None:
    """Raises :class:`StartupFault` unless ``path`` is a readable safetensors file whose
    header parses and whose tensors all lie inside the file (format: an 8-byte
    little-endian header length, a JSON header of ``name → {dtype, shape,
    data_offsets}``, then the data; huggingface/safetensors, README "Format")."""
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= min(MAX_SAFETENSORS_HEADER, size - 8):
                raise StartupFault(path, f"is not a safetensors file, or is truncated ({size:,} bytes)")
            header = json.loads(fh.read(n))
    except OSError as exc:
        raise StartupFault(path, f"cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise StartupFault(path, f"has a corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise StartupFault(path, "has a corrupt safetensors header (not a JSON object)")
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise StartupFault(path, "has a corrupt safetensors header (a tensor without data_offsets)") from None
    if 8 + n + end > size:
        raise StartupFault(path, f"is truncated: its header places tensors up to byte {8 + n + end:,}, "
                                 f"the file has {size:,}")


def _head(path: str | os.PathLike, n: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(n)
    except OSError as exc:
        raise StartupFault(path, f"cannot be read ({exc.strerror or exc})") from None


def classify(exc: BaseException, path: str | os.PathLike, weights: bool = True,
             tokenizer: bool = True) -> StartupFault | None:
    """The :class:`StartupFault` behind ``exc``, raised while loading from ``path`` (a model
    directory or a GGUF file), or ``None`` when a restart may heal it.

    The header checks run again first, so a fault they can see is named exactly (which
    file, what is wrong); otherwise an error that says the files are unusable -- a parse
    error, a missing or unreadable file, a library the files need that is not installed,
    a value the loader refuses -- is a fault of ``path`` with the error's first line."""
    if isinstance(exc, StartupFault):
        return exc
    try:
        if Path(path).is_dir():
            check_model_dir(path, weights=weights, tokenizer=tokenizer)
        elif Path(path).suffix == ".gguf":
            check_gguf(path)
    except StartupFault as fault:
        return fault
    if isinstance(exc, OSError) and exc.errno is not None and exc.errno not in _FILE_ERRNOS:
        return None  # out of space, too many open files, I/O error: may pass
    if isinstance(exc, (OSError, ValueError, KeyError, IndexError, struct.error, ImportError, NotImplementedError)) \
            or type(exc).__name__ == "SafetensorError":
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return StartupFault(path, f"cannot be loaded ({type(exc).__name__}: {first[:300]})")
    return None


@contextlib.contextmanager
def faults_of(path: str | os.PathLike, weights: bool = True, tokenizer: bool = True):
    """Run a loader of ``path``: what it raises comes out as a :class:`StartupFault` where
    :func:`classify` finds one, unchanged otherwise."""
    try:
        yield
    except Exception as exc:
        fault = classify(exc, path, weights=weights, tokenizer=tokenizer)
        if fault is None or fault is exc:
            raise
        raise fault from None


def report(prog: str, fault: StartupFault) -> int:
    """Print ``fault`` as the one line ``prog: <path>: <problem>`` on stderr; returns
    :data:`EXIT_CONFIG`."""
    print(f"{prog}: {fault}", file=sys.stderr, flush=True)
    return EXIT_CONFIG
