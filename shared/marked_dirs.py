"""Directories tickserve makes inside a directory that is not its own, and may delete later.

``tickserve serve --run-dir DIR`` puts things in a directory the user named, which may
hold the user's files (a ``DIR/metrics`` of their own, say). So tickserve never takes a
name there over: it makes a fresh directory (``mkdtemp``: a name nobody had) and writes a
marker file in it at once; deletion is refused for anything without that marker, for a
symbolic link, and for a marker that is itself a link::

    DIR/metrics-k3j9x2/.tickserve-made     {"pid": 4711, "purpose": "prometheus multiprocess"}

A marked directory whose maker has died (a ``kill -9`` of the supervisor) is removed by the
next :func:`make_marked_dir` with the same prefix in the same place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile

log = logging.getLogger(__name__)

MARKER = ".tickserve-made"


def make_marked_dir(parent: str, prefix: str, purpose: str) -> str:
    """A new, empty (but for its marker) directory ``<parent>/<prefix>XXXXXXXX``; first
    removes marked leftovers of the same prefix whose maker is gone. Raises ``OSError``."""
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if name.startswith(prefix) and is_marked(path) and not _maker_alive(path):
            remove_marked(path)
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    with open(os.path.join(path, MARKER), "x") as fh:
        json.dump({"pid": os.getpid(), "purpose": purpose}, fh)
    return path


def is_marked(path: str) -> bool:
    """Whether ``path`` is a real directory (not a link) that holds tickserve's marker as a
    regular file."""
    try:
        return (stat.S_ISDIR(os.lstat(path).st_mode)
                and stat.S_ISREG(os.lstat(os.path.join(path, MARKER)).st_mode))
    except OSError:
        return False


def remove_marked(path: str) -> bool:
    """Delete ``path`` if it is marked (see :func:`is_marked`); True if it went. Anything
    else is left as it is, with a warning."""
    if not is_marked(path):
        if os.path.lexists(path):
            log.warning("not removing %s: tickserve did not make it", path)
        return False
    shutil.rmtree(path, ignore_errors=True)  # rmtree does not follow links inside the tree
    return not os.path.lexists(path)


def _maker_alive(path: str) -> bool:
    try:
        with open(os.path.join(path, MARKER)) as fh:
            pid = int(json.load(fh)["pid"])
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError, KeyError, TypeError):
        return True  # cannot tell: leave it
    return True
