"""The converted-model cache: one float32 safetensors directory per model *content*.

A GGUF file is de-quantized once into ``<cache>/models/<stem>-<sha256[:16]>/``, where the
key is the SHA-256 of the GGUF file's bytes. Two clones, two virtualenvs or two copies of
the same file therefore share one converted directory. Hashing ~100 MB takes about half a
second, so each file's digest is remembered in ``<cache>/index.json`` by path, size and
mtime (nanoseconds) and recomputed only when one of those changes.

Layout (``<cache>`` is ``TICKSERVE_CACHE_DIR``, default ``~/.cache/tickserve``)::

    index.json                 path → {size, mtime_ns, sha256}     (rewritten atomically)
    index.lock                 flock(2) guarding index.json's read-modify-write
    models/<stem>-<key>/       config.json, model.safetensors, tokenizer files,
                               tickserve-source.json {sha256, converted_from}

A conversion writes into a fresh temporary directory beside the target and renames it into
place, so two processes converting at once both end with one complete directory (the
loser's copy is discarded). Directories without ``tickserve-source.json`` are copies from
the earlier, path-keyed layout; :func:`prune` removes them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from shared.cache_dir import cache_root

SOURCE_FILE = "tickserve-source.json"
KEY_CHARS = 16  # hex digits of the SHA-256 in a directory name


@contextlib.contextmanager
def _index_locked(root: Path) -> Iterator[dict]:
    """The digest index under an exclusive lock; changes to the yielded dict are saved."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "index.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = root / "index.json"
        try:
            index = json.loads(path.read_text())
            if not isinstance(index, dict):
                index = {}
        except (OSError, ValueError):
            index = {}
        before = json.dumps(index, sort_keys=True)
        yield index
        if json.dumps(index, sort_keys=True) != before:
            fd, tmp = tempfile.mkstemp(prefix=".index-", dir=root)
            with os.fdopen(fd, "w") as f:
                json.dump(index, f, indent=1, sort_keys=True)
            os.replace(tmp, path)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def content_digest(path: Path, root: Path | None = None) -> str:
    """SHA-256 (hex) of ``path``'s bytes, remembered in the index by path, size and mtime.

    Raises ``OSError`` when the file cannot be read.
    """
    root = cache_root() if root is None else root
    path = path.resolve()
    st = path.stat()
    with _index_locked(root) as index:
        entry = index.get(str(path))
        if isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
            return entry["sha256"]
    digest = _sha256_file(path)  # outside the lock: other processes need not wait for it
    with _index_locked(root) as index:
        index[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    return digest


def converted_dir(gguf: Path, root: Path | None = None) -> Path:
    """Where ``gguf``'s converted copy lives (whether or not it exists yet)."""
    root = cache_root() if root is None else root
    return root / "models" / f"{gguf.stem}-{content_digest(gguf, root)[:KEY_CHARS]}"


def convert_cached(gguf: Path, convert: Callable[[Path, Path], None], root: Path | None = None) -> Path:
    """The converted directory of ``gguf``, calling ``convert(gguf, out_dir)`` only when no
    copy of the same content exists yet. ``convert`` must write a complete Hugging Face
    directory (``config.json`` included) into ``out_dir``; it runs in a temporary directory
    that is renamed into place, so a crash leaves no half-written cache entry.
    """
    root = cache_root() if root is None else root
    target = converted_dir(gguf, root)
    digest = content_digest(gguf, root)
    if (target / "config.json").exists():
        if not (target / SOURCE_FILE).exists():  # made by an older layout with the same key
            _write_source(target, digest, gguf)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert(gguf, tmp)
        if not (tmp / "config.json").exists():
            raise RuntimeError(f"converting {gguf} produced no config.json")
        _write_source(tmp, digest, gguf)
        try:
            os.rename(tmp, target)
        except OSError:  # another process renamed its copy into place first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_source(directory: Path, digest: str, gguf: Path) -> None:
    (directory / SOURCE_FILE).write_text(json.dumps({"sha256": digest, "converted_from": str(gguf.resolve())}))


@dataclass(frozen=True)
class CachedModel:
    path: Path
    bytes: int
    content_keyed: bool  # False: a copy from the older per-path layout, removable by prune


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def list_models(root: Path | None = None) -> list[CachedModel]:
    """Every converted directory in the cache (leftover temporary directories excluded)."""
    root = cache_root() if root is None else root
    models = root / "models"
    if not models.is_dir():
        return []
    return [CachedModel(d, _size(d), (d / SOURCE_FILE).exists())
            for d in sorted(models.iterdir()) if d.is_dir() and not d.name.startswith(".")]


def prune(root: Path | None = None) -> list[CachedModel]:
    """Remove the copies left by the older per-path layout (one per clone or virtualenv)
    and temporary directories of conversions interrupted over an hour ago; returns what
    was removed. Content-keyed copies stay: a model used again is found without converting."""
    root = cache_root() if root is None else root
    removed = [m for m in list_models(root) if not m.content_keyed]
    for m in removed:
        shutil.rmtree(m.path, ignore_errors=True)
    models = root / "models"
    if models.is_dir():
        for d in models.glob(".convert-*"):
            if d.is_dir() and time.time() - d.stat().st_mtime > 3600:
                removed.append(CachedModel(d, _size(d), False))
                shutil.rmtree(d, ignore_errors=True)
    return removed
