"""The tickserve command.

    tickserve serve [MODEL]  engines + frontends, supervised (each restarted with backoff)
    tickserve engine         the engine alone: binds its sockets and runs the tick loop
    tickserve frontend       one HTTP frontend against a running engine (scale these out)
    tickserve cache          list the converted-model cache, or prune copies of the old layout
    tickserve convert --hf   write a model's float32 Hugging Face directory (for vLLM, lm-eval)

serve runs each part as a child process (python -m engine_proc, python -m frontend)
so that one can die without taking the other down. MODEL (or --model) is a local
Hugging Face directory or a .gguf file; without it, the embedded SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from shared import config as cfg
from shared.process_config import LOG_FORMAT, OneLineParser

log = logging.getLogger("tickserve.serve")

SERVE_SHARED = ("model", "run_dir", "input_addr", "output_addr", "log_level", "transport")


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now, or ``None`` (``make run`` asks first)."""
    from shared.supervisor import listen

    try:
        listen(host, port, backlog=1).close()
    except (OSError, OverflowError) as exc:
        return f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}"
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    """Check everything, convert the model once, bind the HTTP port, then supervise the
    engines and frontends (:mod:`shared.supervisor`). Exit status: 2 for a flag or
    setting that cannot work, 78 for model files that cannot load (one line on stderr
    either way, before anything starts); after the supervisor, the process exits with its
    status at once (:func:`~shared.process_config.exit_now`)."""
    from shared.marked_dirs import make_marked_dir
    from shared.models import ModelNotFound, gguf_source, has_weights, resolve_model
    from shared.startup_faults import StartupFault, check_model_dir, report
    from shared.supervisor import Supervisor, listen

    environ = dict(os.environ)
    mode = args.prefill_mode or environ.get(cfg.env_name("prefill_mode"), "")
    disagg = mode == cfg.PrefillMode.DISAGGREGATED.value
    try:  # serve's --decode-engines is a count (ServeConfig); an engine's, addresses
        engine = cfg.build(cfg.EngineConfig, args, environ, decode_engines="", handover_addr="",
                           role=cfg.EngineRole.DECODE.value if disagg else cfg.EngineRole.MONOLITHIC.value)
        frontend_probe = cfg.build(cfg.FrontendConfig, args, environ)
        serve = cfg.build(cfg.ServeConfig, args, environ)
    except ValueError as exc:
        print(f"tickserve: {exc}", file=sys.stderr)
        return 2
    problems = engine.problems() + [p for p in frontend_probe.problems() + serve.problems() if p not in engine.problems()]
    dp = serve.data_parallel_size
    by_address = bool(engine.input_addr or engine.output_addr)
    if dp > 1 and by_address:
        problems.append("--data-parallel-size engines listen in the run directory: give no --input-addr/--output-addr")
    if disagg and (args.data_parallel_size is not None or cfg.env_name("data_parallel_size") in environ):
        problems.append("--data-parallel-size does not apply to --prefill-mode disaggregated "
                        "(its engines are --prefill-engines P and --decode-engines D)")
    if disagg and by_address:
        problems.append("--prefill-mode disaggregated engines listen in the run directory: give no "
                        "--input-addr/--output-addr")
    if not disagg and (serve.prefill_engines or serve.decode_engines):
        problems.append("--prefill-engines and --decode-engines need --prefill-mode disaggregated")
    if problems:
        print("tickserve: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        model_dir = str(resolve_model(engine.model))  # convert once, before any child starts
        # weights and tokenizer: a fault there would fail every restart (a Llama GGUF's entry
        # holds no checkpoint: the engine reads the GGUF's own weights, as engine_proc.factory)
        check_model_dir(model_dir, weights=gguf_source(engine.model) is None or has_weights(Path(model_dir)))
    except ModelNotFound as exc:
        print(f"tickserve: {exc}", file=sys.stderr)
        return 2
    except StartupFault as fault:
        return report("tickserve", fault)
    from engine_proc.engine import device_problems  # loads torch: after the checks that need none
    from engine_proc.gates import capacity_problems

    problems = device_problems(engine) + capacity_problems(engine, _context_length(engine, model_dir))
    if problems:
        print("tickserve: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        http_sock = listen(frontend_probe.host, frontend_probe.port)
    except OSError as exc:
        print(f"tickserve: cannot listen on {frontend_probe.host}:{frontend_probe.port}: {exc.strerror or exc} "
              "(is another server running? set --port or PORT)", file=sys.stderr)
        return 2
    own = not (engine.run_dir or (engine.input_addr and engine.output_addr))
    run_dir = engine.run_dir or tempfile.mkdtemp(prefix="tickserve-")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if disagg:
        engines, engine_dirs = _disaggregated(args, environ, engine, serve, run_dir, model_dir, cpus)
        dp = len(engines)
    else:
        if dp == 0:
            dp = _auto_engines(engine, model_dir, by_address)
        engine_dirs = [run_dir] if dp == 1 else [os.path.join(run_dir, f"engine-{i}") for i in range(dp)]
        board = _core_board(engine, run_dir, dp)
        engines = [cfg.build(cfg.EngineConfig, args, environ, model=model_dir, run_dir=d, decode_engines="",
                             handover_addr="", role=cfg.EngineRole.MONOLITHIC.value, **(
                                 {} if dp == 1 else {"torch_threads": engine.torch_threads or max(1, cpus // dp),
                                                     "kv_memory_fraction": engine.kv_memory_fraction / dp,
                                                     "core_board": board, "core_board_slot": i}))
                   for i, d in enumerate(engine_dirs)]
    name = args.served_model_name or _display(args.model or environ.get(cfg.env_name("model"), ""))
    os.makedirs(run_dir, exist_ok=True)
    # a fresh, marked directory: never a name of the user's in --run-dir (shared/marked_dirs.py)
    metrics_dir = make_marked_dir(run_dir, "metrics-", "prometheus multiprocess")
    frontends = [cfg.build(cfg.FrontendConfig, args, environ, model=model_dir, served_model_name=name,
                           http_fd=http_sock.fileno(),
                           **({"run_dir": run_dir} if dp == 1 else {"run_dir": "", "engine": ",".join(engine_dirs)}),
                           **({"disable_log_stats": True} if i else {}))  # one stats line, from frontend 0
                 for i in range(serve.api_server_count)]
    parts = (f"{serve.api_server_count} frontends, " if serve.api_server_count > 1 else "") + \
            (f"{dp} engines, " if dp > 1 and not disagg else "") + \
            (f"{sum(e.role == 'prefill' for e in engines)} prefill + {sum(e.role == 'decode' for e in engines)} "
             "decode engines, " if disagg else "")
    print(f"tickserve: starting {name} on http://{frontend_probe.host}:{frontend_probe.port} "
          f"({parts}engine sockets in {', '.join(engine_dirs)}; "
          "Ctrl-C drains and stops)", flush=True)
    code = Supervisor(engines, frontends, http_sock, run_dir, own, metrics_dir,
                      announce=(frontend_probe.host, frontend_probe.port)).run()
    from shared.process_config import exit_now

    exit_now(code)  # the children are gone and the run directory with them: skip torch's teardown


def _core_board(engine: cfg.EngineConfig, run_dir: str, dp: int) -> str:
    """The board through which ``dp`` CPU engines lend idle cores (engine_proc/core_lending.py),
    created in ``run_dir``; "" when there is nothing to lend (one engine, lending off, an
    accelerator, engines placed by address) or it cannot be written."""
    if dp < 2 or not engine.lend_idle_cores or engine.device not in ("auto", "cpu"):
        return ""
    from engine_proc.core_lending import BOARD_NAME, create_board

    path = os.path.join(run_dir, BOARD_NAME)
    try:
        os.makedirs(run_dir, exist_ok=True)
        create_board(path, dp)
    except OSError as exc:
        print(f"tickserve: no core lending ({exc})", file=sys.stderr)
        return ""
    return path


def _context_length(engine: cfg.EngineConfig, model_dir: str) -> int:
    """``--max-model-len`` capped by the model's own context (its config.json), in tokens."""
    try:
        with open(os.path.join(model_dir, "config.json")) as fh:
            own = int(json.load(fh).get("max_position_embeddings") or engine.max_model_len)
    except (OSError, ValueError, TypeError, AttributeError):
        own = engine.max_model_len
    return min(engine.max_model_len, own)


def _disaggregated(args, environ, engine: cfg.EngineConfig, serve: cfg.ServeConfig, run_dir: str, model_dir: str,
                   cpus: int) -> tuple[list[cfg.EngineConfig], list[str]]:
    """``--prefill-mode disaggregated``: P prefill and D decode engines (auto: half the
    CPUs prefill, the rest decode, at least one each), each on its own share of the CPUs
    with its share of the KV memory cap; the prefill engines hand rows to every decode
    engine through its run directory. Returns the configs and their run directories."""
    p = serve.prefill_engines or max(1, cpus // 2)
    d = serve.decode_engines or max(1, cpus - p)
    n = p + d
    prefill_dirs = [os.path.join(run_dir, f"prefill-{i}") for i in range(p)]
    decode_dirs = [os.path.join(run_dir, f"decode-{i}") for i in range(d)]
    common = {"model": model_dir, "torch_threads": engine.torch_threads or max(1, cpus // n),
              "kv_memory_fraction": engine.kv_memory_fraction / n, "handover_addr": ""}
    prefills = [cfg.build(cfg.EngineConfig, args, environ, run_dir=x, role=cfg.EngineRole.PREFILL.value,
                          decode_engines=",".join(decode_dirs), **common) for x in prefill_dirs]
    decoders = [cfg.build(cfg.EngineConfig, args, environ, run_dir=x, role=cfg.EngineRole.DECODE.value,
                          decode_engines="", **common) for x in decode_dirs]
    return prefills + decoders, prefill_dirs + decode_dirs


def _auto_engines(engine: cfg.EngineConfig, model_dir: str, by_address: bool) -> int:
    """``--data-parallel-size 0``: see :mod:`shared.placement`."""
    import torch

    from engine_proc.threads import usable_cpus
    from shared.placement import auto_data_parallel_size

    mps = getattr(torch.backends, "mps", None)
    accelerator = torch.cuda.is_available() or bool(mps and mps.is_available())
    return auto_data_parallel_size(device=engine.device, torch_threads=engine.torch_threads, cpus=usable_cpus(),
                                   by_address=by_address, model_dir=model_dir, accelerator=accelerator)


def cmd_cache(argv: list[str]) -> int:
    """tickserve cache [list|prune]: what the converted-model cache holds; prune removes
    the per-clone copies of the older path-keyed layout."""
    from shared import model_cache

    parser = OneLineParser(prog="tickserve cache", description=cmd_cache.__doc__)
    parser.add_argument("action", nargs="?", choices=("list", "prune"), default="list")
    args = parser.parse_args(argv)
    root = model_cache.cache_root()
    if args.action == "prune":
        removed = model_cache.prune(root)
        for m in removed:
            print(f"removed {m.path} ({m.bytes / 1e6:.0f} MB)")
        print(f"freed {sum(m.bytes for m in removed) / 1e6:.0f} MB in {root}")
        return 0
    models = model_cache.list_models(root)
    for m in models:
        note = "" if m.content_keyed else "  (old per-path copy: prune removes it)" if m.removable else f"  ({m.note})"
        print(f"{m.bytes / 1e6:8.0f} MB  {m.path}{note}")
    print(f"{len(models)} entr{'y' if len(models) == 1 else 'ies'} in {root}; remove the directory to clear it")
    return 0


def cmd_convert(argv: list[str]) -> int:
    """tickserve convert --hf [MODEL]: a plain Hugging Face directory of MODEL (default: the
    embedded SmolLM2) with float32 weights, for tools that read one (vLLM, lm-eval,
    tools/bench_accuracy.py's reference). A Llama GGUF's cache entry holds only its packed
    low-bit weights; this adds the de-quantized model.safetensors to it (once). Prints the
    directory's path, alone, on stdout."""
    from shared import startup_faults
    from shared.models import ModelNotFound, hf_directory

    parser = OneLineParser(prog="tickserve convert", description=cmd_convert.__doc__)
    parser.add_argument("--hf", action="store_true", required=True, help="write the float32 Hugging Face directory")
    parser.add_argument("model", nargs="?", default="", help="a .gguf file or model directory; empty: the embedded default")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    try:
        print(hf_directory(args.model))
    except ModelNotFound as exc:
        print(f"tickserve convert: {exc}", file=sys.stderr)
        return startup_faults.EXIT_CONFIG
    except startup_faults.StartupFault as fault:
        return startup_faults.report("tickserve convert", fault)
    return 0


def _display(model: str) -> str:
    from shared.models import model_display_name

    return model_display_name(model)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="tickserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="engine + frontend, supervised",
                           epilog="The scheduler's names (MAX_QUEUE_SIZE, gates 1-3, the active-KV budget) are "
                                  "explained in docs/scheduler.md; every mode, with its default, in README.md.")
    serve.add_argument("model_positional", nargs="?", metavar="MODEL", default=None,
                       help="the same as --model: a local Hugging Face directory or .gguf file")
    cfg.add_arguments(serve, cfg.ServeConfig)
    cfg.add_arguments(serve, cfg.EngineConfig, skip=("role", "handover_addr"))  # serve assigns roles
    cfg.add_arguments(serve, cfg.FrontendConfig, skip=SERVE_SHARED + ("engine", "http_fd"))
    sub.add_parser("engine", help="the engine process alone", add_help=False)
    sub.add_parser("frontend", help="one HTTP frontend", add_help=False)
    sub.add_parser("cache", help="list or prune the converted-model cache", add_help=False)
    sub.add_parser("convert", help="write a model's float32 Hugging Face directory (--hf)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "engine":
        from engine_proc.engine import main as engine_main
        return engine_main(argv[1:])
    if argv and argv[0] == "frontend":
        from frontend.server import main as frontend_main
        return frontend_main(argv[1:])
    if argv and argv[0] == "cache":
        return cmd_cache(argv[1:])
    if argv and argv[0] == "convert":
        return cmd_convert(argv[1:])
    args = parser.parse_args(argv)
    if args.model_positional:
        if args.model and args.model != args.model_positional:
            parser.error(f"two models given: {args.model_positional!r} and --model {args.model!r}")
        args.model = args.model_positional
    level = (args.log_level or os.environ.get(cfg.env_name("log_level")) or "info").lower()
    logging.basicConfig(level=(level if level in cfg.LOG_LEVELS else "info").upper(), format=LOG_FORMAT)
    return cmd_serve(args)  # reports a bad log level with the other problems


if __name__ == "__main__":
    sys.exit(main())
