"""Small helpers shared by the ``tools/bench_*.py`` scripts (not a benchmark itself).

Percentiles, a wall-clock budget, JSON output (stdout and ``--out``), SIGTERM → the
same clean-up path as Ctrl-C, seeded random prompts, and requests built the way
``tests/helpers.py`` builds them. Importing this module puts the repository root on
``sys.path`` so the scripts run as ``python tools/bench_x.py`` from anywhere.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ---------------------------------------------------------------------- statistics

def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between closest
    ranks (numpy's default); ``None`` for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Iterable[float], ndigits: int = 2) -> dict[str, Any]:
    """``{n, p50, p99, mean, max}`` of ``values`` (same unit as the input)."""
    xs = list(values)
    if not xs:
        return {"n": 0, "p50": None, "p99": None, "mean": None, "max": None}
    return {"n": len(xs), "p50": round(percentile(xs, 50), ndigits), "p99": round(percentile(xs, 99), ndigits),
            "mean": round(sum(xs) / len(xs), ndigits), "max": round(max(xs), ndigits)}


def ratio(num: float | None, den: float | None, ndigits: int = 3) -> float | None:
    if num is None or not den:
        return None
    return round(num / den, ndigits)


# ---------------------------------------------------------------------- time bounds

class Deadline:
    """A wall-clock budget in seconds: ``expired()`` once it has run out."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end


def sigterm_as_interrupt() -> None:
    """Make SIGTERM (and SIGHUP) raise ``KeyboardInterrupt`` so the ``finally`` blocks
    that stop child processes run exactly as they do on Ctrl-C."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


# ---------------------------------------------------------------------- output

def emit(summary: dict, out: str | None) -> None:
    """Print ``summary`` as JSON on stdout; also write it to ``out`` if given."""
    text = json.dumps(summary, indent=2)
    print(text, flush=True)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        log(f"wrote {path}")


def log(msg: str) -> None:
    """Progress goes to stderr so stdout stays one JSON document."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# ---------------------------------------------------------------------- in-process engine

def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """``length`` token ids drawn from ``[100, vocab_size)`` (skips the special ids at
    the bottom of SmolLM2's vocabulary)."""
    return [rng.randrange(100, vocab_size) for _ in range(length)]


_ids = itertools.count()


def make_request(prompt: list[int], max_tokens: int, session_id: str = "", ignore_eos: bool = True,
                 request_id: str | None = None):
    """A greedy request, built like ``tests/helpers.py`` ``make_request``."""
    from engine_proc.request import Request
    from shared.protocol import SamplingParams

    return Request(request_id=request_id or f"b{next(_ids)}", frontend_id="bench",
                   prompt_token_ids=list(prompt), session_id=session_id,
                   params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos))


def load_real_model(config):
    """SmolLM2 (or ``config.model``) exactly as the engine loads it, with the engine's
    torch thread count and seed. Returns the model."""
    from engine_proc.factory import configure_torch, load_model

    configure_torch(config)
    t0 = time.perf_counter()
    model, model_dir = load_model(config)
    log(f"loaded {model_dir} in {time.perf_counter() - t0:.1f}s")
    return model


def load_tiny_model(config):
    """The tiny random Llama of ``tests/conftest.py`` (needs the test extras)."""
    from engine_proc.factory import configure_torch
    from tests.conftest import make_tiny_llama

    configure_torch(config)
    return make_tiny_llama()


def machine_info(when: str) -> dict:
    """CPU count and 1-minute load average, tagged ``when`` ("start" / "end"): other
    processes on a shared machine skew every timing."""
    return {"cpu_count": os.cpu_count(), f"loadavg_1m_at_{when}": round(os.getloadavg()[0], 2)}


def torch_info() -> dict:
    import torch
    return {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def save_figure(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def run_main(main) -> None:
    """Exit with ``main()``'s code; Ctrl-C (or SIGTERM, see :func:`sigterm_as_interrupt`) → 130."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)


class SessionOf:
    """Enough of a request for a policy's ``on_tokens_processed``: its ``session_id``."""

    def __init__(self, session_id: str):
        self.session_id = session_id
