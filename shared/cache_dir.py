"""Where tickserve keeps what it builds once per machine: converted models
(:mod:`shared.model_cache`) and compiled C libraries (:mod:`shared.native_build`).

``TICKSERVE_CACHE_DIR``, default ``~/.cache/tickserve``; every clone and virtualenv on
the machine shares it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(environ: os._Environ | dict | None = None) -> Path:
    """``TICKSERVE_CACHE_DIR``, or ``~/.cache/tickserve``."""
    environ = os.environ if environ is None else environ
    return Path(environ.get("TICKSERVE_CACHE_DIR") or Path.home() / ".cache" / "tickserve")
