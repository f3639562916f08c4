"""Compare serving engines on one machine, in one run: tickserve configurations (this
checkout, or an older commit in a temporary git worktree), vLLM-CPU, or any running
OpenAI-compatible server, on the same streaming workload, interleaved A/B/A/B.

Every server is started first and left idle while the others are measured; then for
each ``--concurrency`` level, ``--reps`` rounds run the level once on every server, in
an order that rotates each round, so a machine whose speed drifts (shared hosts do)
hits every server alike. The workload is ``tools/bench_http.py``'s: streaming
``/v1/completions``, prompts of ``--prompt-words`` random words (130 words ≈ 130
SmolLM2 tokens), ``--max-tokens`` output tokens with ``ignore_eos``, temperature 0,
``2 × concurrency`` requests with ``concurrency`` in flight, all the first ones sent at
once.

Reports, per server and level, the median over rounds of output tokens/s, TTFT p50 and
ITL p50, and the ratio of each server to ``--baseline`` round by round (median, min,
max): the figure to quote. Prints one JSON document (progress on stderr).

Usage::

    # tickserve now, tickserve at its old defaults (main's commit abc123), vLLM-CPU
    python tools/bench_compare.py --concurrency 1 16 64 \\
        --tickserve new= --tickserve 'old@abc123=' \\
        --vllm vllm= --baseline vllm --out bench-results/compare.json
    # two configurations of this checkout
    python tools/bench_compare.py --tickserve 't1=--torch-threads 1' --tickserve 't2=--torch-threads 2'
    # a server that is already running (loopback only)
    python tools/bench_compare.py --url 'mine=http://127.0.0.1:8000' --tickserve new=

``--tickserve LABEL[@GITREF]=FLAGS``: ``tickserve serve`` with FLAGS (leading
``NAME=VALUE`` words set the server's environment, e.g. ``OMP_WAIT_POLICY=PASSIVE``); with ``@GITREF``,
from a worktree of that commit (made under a temporary directory and removed at the
end), run by this virtualenv's Python. ``--vllm LABEL=FLAGS``: vLLM's OpenAI server from
``--vllm-python`` (its own virtualenv, ``~/vllm-venv`` by default; the README's
"Real clients against tickserve" says how to make one) on the converted SmolLM2
directory, served under the same model name as tickserve. Servers listen on free loopback ports and are stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as bc  # noqa: E402
from bench_http import check_loopback, free_port, one_request, run_level  # noqa: E402

MODEL_NAME = "SmolLM2-135M-Instruct"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tickserve", action="append", default=[], metavar="LABEL[@GITREF]=FLAGS")
    ap.add_argument("--vllm", action="append", default=[], metavar="LABEL=FLAGS")
    ap.add_argument("--url", action="append", default=[], metavar="LABEL=URL")
    ap.add_argument("--vllm-python", default=str(Path.home() / "vllm-venv" / "bin" / "python"))
    ap.add_argument("--baseline", help="label the ratios are taken against; default: the first server")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=2, help="rounds per level (each server once per round)")
    ap.add_argument("--num-requests", type=int, default=0, help="requests per level; 0 → max(8, 2·C)")
    ap.add_argument("--prompt-words", type=int, default=130)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="", help="model path for vLLM; empty → tickserve's converted SmolLM2")
    ap.add_argument("--startup-timeout", type=float, default=900, help="seconds for one server's /health")
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--level-timeout", type=float, default=900)
    ap.add_argument("--out", help="also write the JSON summary here")
    return ap.parse_args(argv)


@dataclass
class Target:
    label: str
    kind: str  # tickserve | vllm | url
    url: str = ""
    cmd: list[str] = field(default_factory=list)
    cwd: str | None = None
    env: dict = field(default_factory=dict)
    flags: str = ""
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def start(self) -> None:
        fd, name = tempfile.mkstemp(prefix=f"bench-compare-{self.label}-", suffix=".log")
        self.log_path = Path(name)
        bc.log(f"{self.label}: starting {' '.join(self.cmd)} (log {self.log_path})")
        with os.fdopen(fd, "wb") as fh:
            self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.cwd, env={**os.environ, **self.env}, start_new_session=True)

    def wait_healthy(self, timeout: float) -> None:
        import httpx

        deadline = bc.Deadline(timeout)
        while not deadline.expired():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.label} not healthy within {timeout:.0f}s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:]) if self.log_path else ""
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the group
        except (ProcessLookupError, PermissionError):
            pass


def _split(spec: str, what: str) -> tuple[str, str]:
    if "=" not in spec:
        raise SystemExit(f"{what} takes LABEL=VALUE, not {spec!r}")
    label, value = spec.split("=", 1)
    if not label:
        raise SystemExit(f"{what}: empty label in {spec!r}")
    return label, value


def make_worktree(ref: str, root: Path) -> Path:
    """A detached worktree of ``ref`` under ``root`` (removed by :func:`remove_worktree`)."""
    path = root / f"tree-{ref.replace('/', '_')}"
    subprocess.run(["git", "-C", str(bc.REPO), "worktree", "add", "--detach", str(path), ref], check=True,
                   capture_output=True, text=True)
    return path


def remove_worktree(path: Path) -> None:
    subprocess.run(["git", "-C", str(bc.REPO), "worktree", "remove", "--force", str(path)], capture_output=True)


def build_targets(args, tmp: Path) -> tuple[list[Target], list[Path]]:
    targets, trees = [], []
    for spec in args.tickserve:
        label, flags = _split(spec, "--tickserve")
        label, _, ref = label.partition("@")
        tree = bc.REPO
        if ref:
            tree = make_worktree(ref, tmp)
            trees.append(tree)
        port = free_port()
        words = shlex.split(flags)
        env = {"PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        while words and "=" in words[0] and not words[0].startswith("-"):  # leading NAME=VALUE: environment
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        cmd = [sys.executable, "-m", "shared.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", MODEL_NAME, *words]
        targets.append(Target(label, "tickserve", f"http://127.0.0.1:{port}", cmd, str(tree), env, flags))
    for spec in args.vllm:
        label, flags = _split(spec, "--vllm")
        if not Path(args.vllm_python).exists():
            raise SystemExit(f"--vllm needs vLLM's Python at {args.vllm_python} (--vllm-python)")
        port = free_port()
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir(args),
               "--served-model-name", MODEL_NAME, "--max-model-len", "2048", "--host", "127.0.0.1",
               "--port", str(port), *shlex.split(flags)]
        targets.append(Target(label, "vllm", f"http://127.0.0.1:{port}", cmd, None,
                              {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}, flags))
    for spec in args.url:
        label, url = _split(spec, "--url")
        check_loopback(url)
        targets.append(Target(label, "url", url.rstrip("/")))
    labels = [t.label for t in targets]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"labels must differ: {labels}")
    if not targets:
        raise SystemExit("nothing to compare: give --tickserve, --vllm or --url")
    return targets, trees


def model_dir(args) -> str:
    if args.model:
        return args.model
    from shared.models import resolve_model

    return str(resolve_model(""))


async def measure(targets: list[Target], args) -> dict:
    class LevelArgs:  # what bench_http.run_level reads
        prompt_words, seed, max_tokens = args.prompt_words, args.seed, args.max_tokens
        request_timeout, level_timeout, model = args.request_timeout, args.level_timeout, MODEL_NAME

    import httpx

    for t in targets:  # one short request each: first-request costs stay out of the figures
        async with httpx.AsyncClient(timeout=args.request_timeout, trust_env=False) as client:
            warm = await one_request(client, t.url, "Warm-up: say hello.", 8, MODEL_NAME)
        if warm.get("error"):
            raise RuntimeError(f"{t.label}: warm-up failed: {warm['error']}")
    runs: dict[str, dict[int, list[dict]]] = {t.label: {} for t in targets}
    for c in args.concurrency:
        n = args.num_requests or max(8, 2 * c)
        for rep in range(args.reps):
            order = targets[rep % len(targets):] + targets[:rep % len(targets)]
            for t in order:
                bc.log(f"level {c}, round {rep + 1}/{args.reps}: {t.label}")
                level = await run_level(t.url, c, n, LevelArgs)
                level["round"] = rep
                runs[t.label].setdefault(c, []).append(level)
    return runs


def summarize(targets: list[Target], runs: dict, baseline: str, levels: list[int]) -> dict:
    def med(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 2) if xs else None

    out: dict = {}
    for t in targets:
        per_level = {}
        for c in levels:
            rs = runs[t.label][c]
            per_level[str(c)] = {
                "output_tokens_per_s": med([r["output_tokens_per_s"] for r in rs]),
                "ttft_p50_ms": med([r["ttft_ms"]["p50"] for r in rs]),
                "itl_p50_ms": med([r["itl_ms"]["p50"] for r in rs]),
                "errors": sum(r["errors"] for r in rs),
                "prompt_tokens_mean": med([r.get("prompt_tokens_mean") for r in rs]),
                "rounds": [{k: r[k] for k in ("output_tokens_per_s", "ttft_ms", "itl_ms", "wall_s", "errors")}
                           for r in rs],
            }
            if t.label != baseline:
                pairs = [(a["output_tokens_per_s"], b["output_tokens_per_s"])
                         for a, b in zip(rs, runs[baseline][c])]
                ratios = [a / b for a, b in pairs if a and b]
                ttft = [a["ttft_ms"]["p50"] / b["ttft_ms"]["p50"] for a, b in zip(rs, runs[baseline][c])
                        if a["ttft_ms"]["p50"] and b["ttft_ms"]["p50"]]
                per_level[str(c)]["vs_baseline"] = {
                    "throughput_ratio_median": round(statistics.median(ratios), 3) if ratios else None,
                    "throughput_ratio_min": round(min(ratios), 3) if ratios else None,
                    "throughput_ratio_max": round(max(ratios), 3) if ratios else None,
                    "ttft_p50_ratio_median": round(statistics.median(ttft), 3) if ttft else None,
                }
        out[t.label] = {"kind": t.kind, "flags": t.flags, "levels": per_level}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.sigterm_as_interrupt()
    env = {**bc.machine_info("start"), "cpu_flags": cpu_flags()}
    tmp = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    targets: list[Target] = []
    trees: list[Path] = []
    try:
        targets, trees = build_targets(args, tmp)
        baseline = args.baseline or targets[0].label
        if baseline not in {t.label for t in targets}:
            raise SystemExit(f"--baseline {baseline!r} is not one of the labels")
        for t in targets:
            if t.kind != "url":
                t.start()
                t.wait_healthy(args.startup_timeout)
                bc.log(f"{t.label}: healthy at {t.url}")
        runs = asyncio.run(measure(targets, args))
    finally:
        for t in targets:
            t.stop()
        for tree in trees:
            remove_worktree(tree)
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {
        "benchmark": "compare_serving",
        "workload": {"prompt_words": args.prompt_words, "max_tokens": args.max_tokens,
                     "concurrency": args.concurrency, "reps": args.reps, "ignore_eos": True, "temperature": 0},
        "baseline": baseline,
        "env": {**env, **bc.machine_info("end")},
        "servers": summarize(targets, runs, baseline, args.concurrency),
    }
    bc.emit(summary, args.out)
    return 0


def cpu_flags() -> list[str]:
    """The CPU features that decide dtype and kernels (AVX2, AVX-512, bfloat16, AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return []
    return sorted(f for f in set(flags) if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"))


if __name__ == "__main__":
    bc.run_main(main)
