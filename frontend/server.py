"""Frontend process entry point: tokenizer + Starlette app on uvicorn, with a drain phase."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

import uvicorn

from shared import config as cfg, startup_faults


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain phase: the first SIGTERM/SIGINT turns new requests
    and /health into 503 while in-flight requests finish (at most ``drain_timeout_s``
    seconds); then uvicorn shuts down. A second signal shuts down at once."""

    def __init__(self, config: uvicorn.Config, frontend, drain_timeout_s: float):
        super().__init__(config)
        self.frontend = frontend
        self.drain_timeout_s = drain_timeout_s

    exit_code = 0

    def refuse(self, reason: str) -> None:
        """The engine cannot be used (it serves another model): stop with exit code 2."""
        self.exit_code = 2
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        if self.frontend.draining:
            return super().handle_exit(sig, frame)
        self.frontend.draining = True
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while time.monotonic() < deadline and self.frontend.client.num_in_flight > 0:
            time.sleep(0.05)
        self.should_exit = True


def run_frontend(config: cfg.FrontendConfig) -> int:
    """Serve HTTP until SIGTERM/SIGINT (then drain). Returns the exit code: 0 after a
    drain, 2 for settings or an engine it refuses, 78 (logged in one line) for model files
    it cannot load (:mod:`shared.startup_faults`)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    from shared.models import ModelNotFound, model_display_name, model_fingerprint, resolve_model
    from frontend.app import create_app
    from frontend.http_guard import ConnectionLimits, guarded_protocol

    if not (config.run_dir or config.engine or (config.input_addr and config.output_addr)):
        logging.error("the frontend needs --run-dir, --engines or --input-addr/--output-addr of running engines")
        return 2
    try:
        model_dir = resolve_model(config.model)
        startup_faults.check_model_dir(model_dir, weights=False)  # the frontend needs only the tokenizer
        with startup_faults.faults_of(model_dir, weights=False):
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except ModelNotFound as exc:
        logging.error("%s", exc)
        return 2
    except startup_faults.StartupFault as fault:  # a restart finds the same files: stop (78)
        logging.error("frontend cannot start: %s", fault)
        return startup_faults.EXIT_CONFIG
    name = config.served_model_name or model_display_name(config.model)
    app = create_app(config, tokenizer, name)
    app.state.frontend.use_generation_config(model_dir)
    limits = ConnectionLimits(config.header_timeout_s, config.max_connections_per_client,
                              config.max_dashboard_streams_per_client)
    app.state.connection_limits = limits
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, http=guarded_protocol(limits),
                                           log_level=config.log_level.lower(), access_log=False,
                                           timeout_graceful_shutdown=5),
                            app.state.frontend, config.drain_timeout_s)
    client = app.state.frontend.client
    client.expected_fingerprint = model_fingerprint(model_dir)
    client.on_refused = server.refuse
    # tickserve serve binds the port once and every frontend accepts on that socket
    server.run(sockets=[socket.socket(fileno=config.http_fd)] if config.http_fd >= 0 else None)
    return server.exit_code


def main(argv: list[str] | None = None) -> int:
    from shared.process_config import process_config

    return run_frontend(process_config(cfg.FrontendConfig, "tickserve frontend",
                                       "Run one HTTP frontend against a running engine.", argv))


if __name__ == "__main__":
    sys.exit(main())
