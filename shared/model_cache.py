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
loser's copy is discarded). A conversion's temporary directory carries ``.tickserve-convert``
from its first moment, so an interrupted one is recognisably tickserve's.

:func:`prune` deletes only what is positively tickserve's: copies of the earlier, path-keyed
layout (which wrote no marker) are recognised by their exact shape -- a ``<stem>-<16 hex>``
name holding ``config.json`` and nothing but the files a conversion writes, as regular files
-- and interrupted conversions by their marker. A directory of the user's (``my-finetune``,
one with a file of its own, a symbolic link) is listed and left alone. Nothing here follows a
symbolic link: sizes count a link as itself, and a linked entry is never deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from shared.cache_dir import cache_root

SOURCE_FILE = "tickserve-source.json"
CONVERT_MARKER = ".tickserve-convert"  # in a conversion's temporary directory from its start
KEY_CHARS = 16  # hex digits of the SHA-256 in a directory name
# What a conversion writes (save_pretrained of the model and its tokenizer): a directory of
# the old layout holds nothing else.
CONVERTED_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "tokenizer.model", "added_tokens.json", "vocab.json", "merges.txt", SOURCE_FILE})
_KEYED_NAME = re.compile(rf".+-[0-9a-f]{{{KEY_CHARS}}}")


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
        (tmp / CONVERT_MARKER).write_text(json.dumps({"converting": str(gguf.resolve()), "pid": os.getpid()}))
        convert(gguf, tmp)
        (tmp / CONVERT_MARKER).unlink()
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


def add_files(entry: Path, write: Callable[[Path], None], names: tuple[str, ...]) -> None:
    """Add the files ``names`` to the cache entry ``entry`` unless all are there already:
    ``write(tmp)`` writes them into a temporary directory beside it, then each is renamed
    into place, under the entry's lock (a second process waits, then finds them made). A
    crash leaves no half-written file in the entry."""
    if all((entry / n).exists() for n in names):
        return
    with open(entry.parent / f".{entry.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all((entry / n).exists() for n in names):
            return
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=entry.parent))
        try:
            (tmp / CONVERT_MARKER).write_text(json.dumps({"adding to": str(entry), "pid": os.getpid()}))
            write(tmp)
            for n in names:
                os.replace(tmp / n, entry / n)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_source(directory: Path, digest: str, gguf: Path) -> None:
    (directory / SOURCE_FILE).write_text(json.dumps({"sha256": digest, "converted_from": str(gguf.resolve())}))


@dataclass(frozen=True)
class CachedModel:
    path: Path
    bytes: int
    content_keyed: bool  # False: not a content-keyed copy (see ``removable``)
    removable: bool = False  # positively tickserve's and prune's to delete: an old-layout copy
    note: str = ""  # why it is left alone, for one that is neither


def tree_bytes(top: Path) -> int:
    """Bytes of the regular files under ``top`` (itself included), never following a
    symbolic link (a link counts as its own size). Unreadable entries count 0."""
    try:
        st = os.lstat(top)
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _old_layout_copy(d: Path) -> bool:
    """Whether ``d`` (a real directory) has the exact shape of an old path-keyed copy."""
    if not _KEYED_NAME.fullmatch(d.name) or (d / SOURCE_FILE).exists():
        return False
    try:
        entries = list(os.scandir(d))
    except OSError:
        return False
    names = {e.name for e in entries}
    return ("config.json" in names and names <= CONVERTED_FILES
            and all(e.is_file(follow_symlinks=False) for e in entries))


def _interrupted_conversion(d: Path) -> bool:
    marker = d / CONVERT_MARKER
    return d.name.startswith(".convert-") and marker.is_file() and not marker.is_symlink()


def list_models(root: Path | None = None) -> list[CachedModel]:
    """Every entry of ``<cache>/models`` (temporary directories excluded), sized without
    following links, each marked content-keyed, removable by :func:`prune`, or neither (with
    why it stays)."""
    root = cache_root() if root is None else root
    models = root / "models"
    if not models.is_dir() or models.is_symlink():
        return []
    out = []
    for d in sorted(models.iterdir()):
        if d.name.startswith("."):
            continue
        if d.is_symlink():
            out.append(CachedModel(d, tree_bytes(d), False, note="a symbolic link: not followed, left alone"))
        elif d.is_dir():
            keyed = (d / SOURCE_FILE).is_file()
            old = not keyed and _old_layout_copy(d)
            note = "" if keyed or old else "not a tickserve conversion: left alone"
            out.append(CachedModel(d, tree_bytes(d), keyed, removable=old, note=note))
    return out


def _remove(d: Path) -> int:
    """Delete the real directory ``d``; the bytes actually freed (what was there before less
    what is left, should some of it refuse to go)."""
    before = tree_bytes(d)
    shutil.rmtree(d, ignore_errors=True)  # rmtree does not follow links inside the tree
    return before - (tree_bytes(d) if os.path.lexists(d) else 0)


def prune(root: Path | None = None) -> list[CachedModel]:
    """Remove the copies left by the older per-path layout (one per clone or virtualenv)
    and temporary directories of conversions interrupted over an hour ago -- only those
    positively tickserve's (see the module docstring), never through a link. Returns what
    was removed, ``bytes`` being what its removal actually freed. Content-keyed copies
    stay: a model used again is found without converting."""
    root = cache_root() if root is None else root
    removed = []
    for m in list_models(root):
        if m.removable and not m.path.is_symlink():
            removed.append(CachedModel(m.path, _remove(m.path), False))
    models = root / "models"
    if models.is_dir() and not models.is_symlink():
        for d in models.glob(".convert-*"):
            if (not d.is_symlink() and d.is_dir() and _interrupted_conversion(d)
                    and time.time() - d.stat().st_mtime > 3600):
                removed.append(CachedModel(d, _remove(d), False))
    return removed
