"""One choice's output: token ids in, text deltas cut at stop strings out
(:class:`~frontend.detokenizer.IncrementalDetokenizer` then
:class:`~frontend.stop_strings.StopStringMatcher`)."""

from __future__ import annotations

from collections.abc import Sequence

from frontend.detokenizer import IncrementalDetokenizer
from frontend.stop_strings import StopResult, StopStringMatcher


class TextStream:
    """One choice's output: token ids in, text deltas cut at stop strings out.

    ``push(ids)`` returns a :class:`StopResult` ``(text, stopped)``; ``flush()`` returns
    the last text when the engine finishes the request. After a stop string matched,
    pushes return ``StopResult("", True)`` and are otherwise ignored (ids still in
    flight before the engine handles the abort); ``push`` after ``flush`` raises
    ``RuntimeError``. ``text`` is everything sent so far. Guarantees and costs are
    those of :class:`IncrementalDetokenizer` and :class:`StopStringMatcher`.

    ``min_tokens`` (vLLM's rule): stop strings are not looked for until that many ids
    have been pushed; text that arrived before is sent as it is, whatever it contains.
    """

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._matcher = StopStringMatcher(stop, include_stop_str_in_output)
        self._min_tokens = min_tokens
        self._parts: list[str] = []
        self._flushed = False

    @property
    def stopped(self) -> bool:
        return self._matcher.stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the stream, or ``None``."""
        return self._matcher.matched

    @property
    def text(self) -> str:
        """All text sent so far (the concatenation of every returned delta)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def push(self, token_ids: Sequence[int]) -> StopResult:
        """Append output ids; return the text safe to send and whether it stopped."""
        if self.stopped:
            return StopResult("", True)
        text = self._detokenizer.push(token_ids)
        result = self._matcher.push(text) if self._matching else StopResult(text, False)
        self._record(result.text)
        return result

    @property
    def _matching(self) -> bool:
        return self._detokenizer.num_tokens >= self._min_tokens

    def flush(self) -> str:
        """End the stream (EOS, length, abort); return the rest of the text.

        A stop string can still match here (see :meth:`StopStringMatcher.flush`):
        check :attr:`stopped` afterwards. Calling it again, or after a stop, returns
        ``""``.
        """
        if self.stopped or self._flushed:
            return ""
        self._flushed = True
        if not self._matching:
            text = self._detokenizer.flush()
        else:
            text = self._matcher.push(self._detokenizer.flush()).text + self._matcher.flush()
        self._record(text)
        return text

    def _record(self, text: str) -> None:
        if text:
            self._parts.append(text)
