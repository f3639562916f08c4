"""Frontend process entry point: tokenizer + Starlette app on uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from shared import config as cfg


def run_frontend(config: cfg.FrontendConfig) -> int:
    """Serve HTTP until SIGTERM/SIGINT; uvicorn drains in-flight requests first."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import uvicorn
    from transformers import AutoTokenizer

    from engine_proc.model_loader import model_display_name, resolve_model
    from frontend.app import create_app

    if not (config.run_dir or (config.input_addr and config.output_addr)):
        logging.error("the frontend needs --run-dir or --input-addr/--output-addr of a running engine")
        return 2
    model_dir = resolve_model(config.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    name = config.served_model_name or model_display_name(config.model)
    app = create_app(config, tokenizer, name)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level.lower(),
                timeout_graceful_shutdown=int(config.drain_timeout_s), access_log=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tickserve frontend",
                                     description="Run one HTTP frontend against a running engine.")
    cfg.add_arguments(parser, cfg.FrontendConfig)
    args = parser.parse_args(argv)
    config = cfg.build(cfg.FrontendConfig, args, os.environ)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_frontend(config)


if __name__ == "__main__":
    sys.exit(main())
