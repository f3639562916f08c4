"""One process's configuration from its command line and ``TICKSERVE_*`` environment.

The engine (``python -m engine_proc``), the frontend (``python -m frontend``) and the
``tickserve`` launcher above them all start here: flags win over the environment,
which wins over the dataclass defaults (:func:`shared.config.build`), and a
configuration that can never work ends the process in one line with exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from shared import config as cfg

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (argparse's own error prints the whole
    usage, dozens of lines for these commands) and exits 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (--help lists the flags)\n")


def process_config(cls: type, prog: str, description: str, argv: list[str] | None):
    """Config of one process from its flags and ``TICKSERVE_*`` environment; sets up logging.
    A configuration that can never work ends the process here: one line on stderr, exit 2."""
    parser = OneLineParser(prog=prog, description=description)
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


def exit_now(code: int) -> NoReturn:
    """End a process whose own cleanup is done: flush the logs and standard streams, then
    leave without the interpreter's teardown of torch and every module (over a second of
    an idle stop's time, freeing memory the kernel frees anyway). ``atexit`` handlers run."""
    import atexit

    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
