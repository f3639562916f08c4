"""④'s inputs and what its logits become (part of :class:`~engine_proc.scheduler.Scheduler`).

Each decode row feeds its last output token at its position; one token per row is
sampled from the pass's logits and appended under the output rules; a pass refused at
the kernel boundary fails only the rows it names. With prefix caching, each block a
row's generated text fills is hashed, so a later prompt that repeats it (a chat's next
turn) hits it.
"""

from __future__ import annotations

import logging

from engine_proc.backends.kernel_batch import BatchRejected
from engine_proc.request import Request, RequestStatus

log = logging.getLogger(__name__)


class Decode:
    """Mixed into :class:`~engine_proc.scheduler.Scheduler`: the rows of phase ④."""

    def _fail_rejected(self, exc: BatchRejected, rows: list[Request]) -> None:
        at_fault = set(exc.rows)
        failed = [r for r in rows if r.request_id in at_fault] or rows
        log.error("decode pass refused at the kernel boundary: %s; failing %d of its %d rows", exc, len(failed),
                  len(rows))
        for req in failed:
            req.error = f"decode refused: {exc.problem}"
            self._finish(req, RequestStatus.FINISHED_ERROR)

    @staticmethod
    def _decode_inputs(rows: list[Request]) -> tuple[list[str], list[int], list[int]]:
        """Row ids, the token each feeds (its last output) and that token's position."""
        return ([r.request_id for r in rows], [r.output_token_ids[-1] for r in rows],
                [r.num_tokens - 1 for r in rows])

    def _after_decode(self, rows: list[Request], logits) -> None:
        """Sample one token per decode row from ``logits`` ``[len(rows), vocab]``."""
        states = [self._sampling[r.request_id] for r in rows]
        sample = self.sampler(logits, states)
        for i, req in enumerate(rows):
            req.num_computed_tokens += 1
            self.policy.on_tokens_processed(req, 0, 1)
            self._append_token(req, sample.token_ids[i], sample.logprobs[i])
        if self.prefix_caching:
            self._commit_decoded_blocks(rows)

    def _commit_decoded_blocks(self, rows: list[Request]) -> None:
        """Hash each block this step filled, so a later prompt repeating a row's generated
        text (a chat's next turn) hits it. Only rows whose written KV (``num_computed_tokens``
        tokens) just reached a block boundary pay anything."""
        bs = self.block_pool.block_size
        for req in rows:
            if req.num_computed_tokens % bs == 0:
                written = req.num_computed_tokens - req.prompt_len
                self.block_pool.commit_full_blocks(
                    req.request_id, req.prompt_token_ids + req.output_token_ids[:written])
