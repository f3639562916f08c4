"""Cutting a text stream at the first stop string (OpenAI's ``stop``), across deltas.

Text that could still become a stop string is held back until the next deltas rule it
out; everything else goes out at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopResult(NamedTuple):
    """Text that is safe to send now, and whether the stream has hit a stop string.

    Once ``stopped`` is true the text already includes everything that will ever be
    sent (up to the stop string, and the stop string itself if requested). A named
    tuple, so ``text, stopped = stream.push(ids)`` works.
    """

    text: str
    stopped: bool


class StopStringMatcher:
    """Cuts a text stream at the first stop string.

    Stop strings are matched on text, inside one delta or across any number of them.
    Text that could still be the start of a stop string is held back until the next
    deltas rule that out; everything else goes out at once. Which match wins is a
    function of the full text only, never of how it was split into deltas: the match
    that starts earliest, and among those that start at the same place the shortest.
    So, for a single stop string ``s``, the text sent is ``text[:text.find(s)]``, or
    all of ``text`` if ``s`` never occurs.

    On a match: the text before it (plus the stop string when
    ``include_stop_str_in_output``) goes out with ``stopped=True``, nothing after it
    ever does, and later pushes return ``StopResult("", True)``.

    Cost per push: O(k·(d + L²)) for k stop strings of length at most L and a delta of
    d characters; at most L - 1 characters are held between pushes.
    """

    def __init__(
        self, stop: Sequence[str] | None, include_stop_str_in_output: bool = False
    ) -> None:
        stops = list(dict.fromkeys(stop or ()))
        if "" in stops:
            raise ValueError("stop strings must not be empty")
        self._stops = stops
        self._include = include_stop_str_in_output
        self._max_len = max(map(len, stops), default=0)
        self._held = ""
        self._flushed = False
        self.matched: str | None = None  # the stop string that ended the stream

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, delta: str) -> StopResult:
        """Add a text delta; return what is safe to send now."""
        if self._flushed:
            raise RuntimeError("push() after flush(): the stream has ended")
        if self.stopped:
            return StopResult("", True)
        held = self._held + delta
        match = self._first_match(held)
        end = match[0] if match else len(held)
        pending = self._first_pending(held, end)
        if pending is not None:  # a stop string may still start at `pending`
            self._held = held[pending:]
            return StopResult(held[:pending], False)
        if match is not None:
            return self._stop(held, *match)
        self._held = ""
        return StopResult(held, False)

    def flush(self) -> str:
        """End the stream; return the held text, cut at a stop string if one matches.

        A match found here (a shorter stop string that waited on a longer one that
        started earlier but never completed) sets :attr:`stopped` as a push would.
        """
        if self._flushed or self.stopped:
            self._flushed = True
            return ""
        self._flushed = True
        held, self._held = self._held, ""
        match = self._first_match(held)
        return held if match is None else self._stop(held, *match).text

    def _stop(self, held: str, pos: int, stop: str) -> StopResult:
        self.matched = stop
        self._held = ""
        return StopResult(held[: pos + len(stop)] if self._include else held[:pos], True)

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the earliest, then shortest, complete match."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            pos = text.find(stop)
            if pos >= 0 and (best is None or (pos, len(stop)) < (best[0], len(best[1]))):
                best = (pos, stop)
        return best

    def _first_pending(self, text: str, end: int) -> int | None:
        """Earliest start before ``end`` of a stop string that runs past the end of
        ``text`` and agrees with it so far, i.e. one that more text could complete."""
        for start in range(max(0, len(text) - self._max_len + 1), end):
            tail = text[start:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stops):
                return start
        return None
