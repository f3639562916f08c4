"""The tickserve command.

    tickserve serve [MODEL]  one engine + one frontend, supervised (engine restarted with backoff)
    tickserve engine         the engine alone: binds its sockets and runs the tick loop
    tickserve frontend       one HTTP frontend against a running engine (scale these out)
    tickserve cache          list the converted-model cache, or prune copies of the old layout

serve runs each part as a child process (python -m engine_proc, python -m frontend)
so that one can die without taking the other down. MODEL (or --model) is a local
Hugging Face directory or a .gguf file; without it, the embedded SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from shared import config as cfg

log = logging.getLogger("tickserve.serve")

SERVE_SHARED = ("model", "run_dir", "input_addr", "output_addr", "log_level")
EXIT_CONFIG = 78  # engine_proc.engine.EXIT_CONFIG (not imported here: that would load torch)


class Supervisor:
    """Starts the engine and the frontend, restarts the engine when it dies
    (exponential backoff, reset after a stable minute), and on SIGTERM/SIGINT stops
    the frontend first (it drains), then the engine; removes the run directory."""

    def __init__(self, engine: cfg.EngineConfig, frontend: cfg.FrontendConfig, own_run_dir: bool):
        self.engine_config = engine
        self.frontend_config = frontend
        self.own_run_dir = own_run_dir
        self.engine: subprocess.Popen | None = None
        self.frontend: subprocess.Popen | None = None
        self.stopping = False
        self.backoff = 0.5
        self.engine_started = 0.0

    def _spawn(self, module: str, config) -> subprocess.Popen:
        # Each child gets its own session, so a terminal's Ctrl-C reaches only this
        # supervisor, which then stops the children once, in order (a second signal
        # would cut the frontend's drain short); and each child is sent SIGTERM by the
        # kernel if the supervisor itself dies, so none is orphaned.
        return subprocess.Popen([sys.executable, "-m", module, *cfg.to_argv(config)],
                                start_new_session=True, preexec_fn=_die_with_parent)

    def start_engine(self) -> None:
        self.engine = self._spawn("engine_proc", self.engine_config)
        self.engine_started = time.monotonic()
        log.info("engine started (pid %d)", self.engine.pid)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.start_engine()
        self.frontend = self._spawn("frontend", self.frontend_config)
        code = 0
        while not self.stopping:
            time.sleep(0.1)
            if self.engine.poll() is not None and not self.stopping:
                if self.engine.returncode == EXIT_CONFIG:  # a restart cannot help; it said why
                    log.error("engine cannot start with this configuration (exit %d); shutting down",
                              EXIT_CONFIG)
                    code = 2
                    break
                if time.monotonic() - self.engine_started > 60:
                    self.backoff = 0.5
                log.error("engine exited with %s; restarting in %.1fs", self.engine.returncode, self.backoff)
                deadline = time.monotonic() + self.backoff
                while time.monotonic() < deadline and not self.stopping:
                    time.sleep(0.05)
                self.backoff = min(self.backoff * 2, 10.0)
                if not self.stopping:
                    self.start_engine()
            if self.frontend.poll() is not None and not self.stopping:
                log.error("frontend exited with %s; shutting down", self.frontend.returncode)
                code = self.frontend.returncode or 1
                break
        self.shutdown()
        return code

    def _on_signal(self, signum, frame) -> None:
        if self.stopping:  # a second Ctrl-C: pass it on, the children stop at once
            for proc in (self.frontend, self.engine):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        self.stopping = True

    def shutdown(self) -> None:
        drain = self.frontend_config.drain_timeout_s
        for proc, timeout in ((self.frontend, drain + 5), (self.engine, 10)):
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self.own_run_dir:
            shutil.rmtree(self.engine_config.run_dir, ignore_errors=True)


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def process_config(cls: type, prog: str, description: str, argv: list[str] | None):
    """Config of one process from its flags and ``TICKSERVE_*`` environment; sets up logging.
    A configuration that can never work ends the process here: one line on stderr, exit 2."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    cfg.add_arguments(parser, cls)
    args = parser.parse_args(argv)
    try:
        config = cfg.build(cls, args, os.environ)
    except ValueError as exc:  # an environment variable that does not parse
        _fail(prog, str(exc))
    problems = config.problems()
    if problems:
        _fail(prog, "; ".join(problems))
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    return config


def _fail(prog: str, message: str):
    print(f"{prog}: {message}", file=sys.stderr)
    raise SystemExit(2)


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the parent dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now, or ``None``."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    from engine_proc.model_loader import ModelNotFound, resolve_model

    environ = dict(os.environ)
    try:
        engine = cfg.build(cfg.EngineConfig, args, environ)
        frontend_probe = cfg.build(cfg.FrontendConfig, args, environ)
    except ValueError as exc:
        print(f"tickserve: {exc}", file=sys.stderr)
        return 2
    problems = engine.problems() + [p for p in frontend_probe.problems() if p not in engine.problems()]
    if not problems:
        from engine_proc.engine import device_problems

        problems += device_problems(engine)
        port_issue = port_problem(frontend_probe.host, frontend_probe.port)
        if port_issue:
            problems.append(port_issue + " (is another server running? set --port or PORT)")
    if problems:
        print("tickserve: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        model_dir = str(resolve_model(engine.model))  # convert once, before either child starts
    except ModelNotFound as exc:
        print(f"tickserve: {exc}", file=sys.stderr)
        return 2
    own = not (engine.run_dir or (engine.input_addr and engine.output_addr))
    run_dir = engine.run_dir or tempfile.mkdtemp(prefix="tickserve-")
    engine = cfg.build(cfg.EngineConfig, args, environ, model=model_dir, run_dir=run_dir)
    frontend = cfg.build(cfg.FrontendConfig, args, environ, model=model_dir, run_dir=run_dir,
                         served_model_name=args.served_model_name or _display(args.model or environ.get(
                             cfg.env_name("model"), "")))
    print(f"tickserve: starting {frontend.served_model_name} on http://{frontend.host}:{frontend.port} "
          f"(engine sockets in {run_dir}; Ctrl-C drains and stops)", flush=True)
    return Supervisor(engine, frontend, own).run()


def cmd_cache(argv: list[str]) -> int:
    """tickserve cache [list|prune]: what the converted-model cache holds; prune removes
    the per-clone copies of the older path-keyed layout."""
    from engine_proc import model_cache

    parser = argparse.ArgumentParser(prog="tickserve cache", description=cmd_cache.__doc__)
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
        print(f"{m.bytes / 1e6:8.0f} MB  {m.path}{'' if m.content_keyed else '  (old per-path copy: prune removes it)'}")
    print(f"{len(models)} converted model(s) in {root}; remove the directory to clear it")
    return 0


def _display(model: str) -> str:
    from engine_proc.model_loader import model_display_name

    return model_display_name(model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tickserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="engine + frontend, supervised")
    serve.add_argument("model_positional", nargs="?", metavar="MODEL", default=None,
                       help="the same as --model: a local Hugging Face directory or .gguf file")
    cfg.add_arguments(serve, cfg.EngineConfig)
    cfg.add_arguments(serve, cfg.FrontendConfig, skip=SERVE_SHARED)
    sub.add_parser("engine", help="the engine process alone", add_help=False)
    sub.add_parser("frontend", help="one HTTP frontend", add_help=False)
    sub.add_parser("cache", help="list or prune the converted-model cache", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "engine":
        from engine_proc.engine import main as engine_main
        return engine_main(argv[1:])
    if argv and argv[0] == "frontend":
        from frontend.server import main as frontend_main
        return frontend_main(argv[1:])
    if argv and argv[0] == "cache":
        return cmd_cache(argv[1:])
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
