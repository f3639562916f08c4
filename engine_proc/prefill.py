"""② ``advance_prefill_chunk``: the prefill plan and its passes (part of
:class:`~engine_proc.scheduler.Scheduler`).

Each tick plans ``(request, start, end)`` prompt ranges over ``_prefilling``, oldest row
first, within a token budget: ``PREFILL_CHUNK_SIZE`` in chunked mode, what the decode
rows leave of ``max_num_batched_tokens`` in mixed_batch (where a chunk is charged its
attention too). Prefix-cache hits found after admission are taken before a row's first
chunk. A row whose prompt completes samples its first token and is promoted through
``_promote_to_decode``; a pass that fails fails only its own rows.
"""

from __future__ import annotations

import logging

from engine_proc.backends.base import PrefillChunk, affordable_prompt_tokens, prompt_chunk_cost
from engine_proc.prompt_logprobs import score_chunk, wants_prompt_logprobs
from engine_proc.request import Request, RequestStatus

log = logging.getLogger(__name__)


class Prefill:
    """Mixed into :class:`~engine_proc.scheduler.Scheduler`: phase ②."""

    def advance_prefill_chunk(self) -> None:
        """Feed at most PREFILL_CHUNK_SIZE prompt tokens this tick, oldest row first, in
        one packed forward pass.

        A long prompt takes one full chunk per tick, which bounds how long the decode
        batch waits (the card's point). A row that finishes its prompt with budget left
        passes the rest to the next rows, so short remainders (after a prefix-cache hit,
        say) share one pass instead of each costing a tick. Rows promote on their final
        chunk. A failing pass fails only the rows in it (their prefill KV is their own).
        """
        self._run_prefill_plan(self._plan_prefill(self.chunk_size))

    def _run_prefill_plan(self, plan: list[tuple[Request, int, int]]) -> None:
        """Run ``(request, start, end)`` prompt ranges: one packed pass if the backend packs,
        else row by row. Rows whose prompt completes are promoted."""
        if len(plan) > 1 and self.backend.packs_prefill:
            chunks = self._chunks(plan)
            try:
                logits = self.backend.prefill_chunks(chunks)
            except Exception:  # the pass changed no row state: find the culprit row by row
                log.exception("packed prefill of %d rows failed; retrying them one at a time", len(plan))
            else:
                self._after_prefills(plan, logits)
                return
        for req, start, end in plan:
            if self._isolated(req, self._run_prefill, req, end - start):
                self._prefilling.remove(req)

    @staticmethod
    def _chunks(plan: list[tuple[Request, int, int]]) -> list[PrefillChunk]:
        return [PrefillChunk(req.request_id, req.prompt_token_ids[start:end], start, end == req.prompt_len,
                             wants_prompt_logprobs(req.params))
                for req, start, end in plan]

    def _after_prefills(self, plan: list[tuple[Request, int, int]], logits: list) -> None:
        """Record a successful pass's prefill ranges; promote rows whose prompt completed."""
        for (req, _, end), row_logits in zip(plan, logits):
            if self._isolated(req, self._after_prefill, req, end, row_logits):
                self._prefilling.remove(req)

    def _plan_prefill(self, budget: int, pairs_per_token: float | None = None) -> list[tuple[Request, int, int]]:
        """``(request, start, end)`` prompt ranges for this tick within ``budget`` tokens,
        oldest row first. With ``pairs_per_token`` (mixed_batch) a chunk is charged its
        attention too (:func:`~engine_proc.backends.base.prompt_chunk_cost`), so a chunk
        deep in a long prompt is shorter and the tick's cost stays level."""
        plan: list[tuple[Request, int, int]] = []
        left = float(budget)
        for req in self._prefilling:
            if left < 1:
                break
            if self._reuses_prefix(req) and req.num_computed_tokens == req.num_cached_tokens:
                self._late_prefix_hit(req)  # cached tokens do not spend the budget
                if plan and self._shares_pending_blocks(req, plan):
                    break  # next tick it reuses what this pass computes instead of redoing it
            start = req.num_computed_tokens
            end = min(req.prompt_len, start + affordable_prompt_tokens(start, left, pairs_per_token))
            plan.append((req, start, end))
            left -= prompt_chunk_cost(start, end - start, pairs_per_token)
        return plan

    def _shares_pending_blocks(self, req: Request, plan: list[tuple[Request, int, int]]) -> bool:
        """Would ``req``'s next uncached block be computed by a row already planned?"""
        edge = req.num_computed_tokens + self.block_pool.block_size
        head = req.prompt_token_ids[:edge]
        return any(end >= edge and other.prompt_token_ids[:edge] == head for other, _, end in plan)

    def _isolated(self, req: Request, fn, *args) -> bool:
        """``fn(*args)`` for one row's prefill; a failure ends only that row (its prefill
        KV is its own), with ``finish_reason`` error, and returns False."""
        try:
            return fn(*args)
        except Exception as exc:
            log.exception("prefill of %s failed; failing that request only", req.request_id)
            req.error = f"prefill failed: {exc}"
            self._finish(req, RequestStatus.FINISHED_ERROR)
            return False

    def _run_prefill(self, req: Request, max_tokens: int) -> bool:
        """Compute up to ``max_tokens`` prompt tokens of ``req``; True once complete."""
        start = req.num_computed_tokens
        end = min(req.prompt_len, start + max_tokens)
        if wants_prompt_logprobs(req.params):
            logits = self.backend.prefill_chunk(req.request_id, req.prompt_token_ids[start:end], start,
                                                end == req.prompt_len, all_logits=True)
        else:
            logits = self.backend.prefill_chunk(req.request_id, req.prompt_token_ids[start:end], start,
                                                end == req.prompt_len)
        return self._after_prefill(req, end, logits)

    def _after_prefill(self, req: Request, end: int, logits) -> bool:
        """Record prompt tokens ``[.., end)`` as computed; on the last one, sample the first
        token and promote. True once the prompt is complete.

        ``logits``: ``[vocab]`` of the last token, or ``[end - start, vocab]`` for a row
        with prompt logprobs, which are scored here from the same pass. Such a row with
        ``max_tokens`` 0 finishes (length) once its prompt is scored."""
        if wants_prompt_logprobs(req.params):
            start = end - logits.shape[0]
            req.prompt_logprobs.extend(score_chunk(logits, req.prompt_token_ids, start, req.params.prompt_logprobs))
            logits = logits[-1]
        req.num_computed_tokens = end
        if self.prefix_caching:  # rows behind this one can reuse these blocks right away
            self.block_pool.commit_full_blocks(req.request_id, req.prompt_token_ids[:end])
        if end < req.prompt_len:
            return False
        if wants_prompt_logprobs(req.params):
            self._out.prompt_logprobs(req, req.prompt_logprobs)
            if req.params.max_tokens == 0:
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                return False  # _finish took it out of _prefilling already
        sample = self.sampler(logits.unsqueeze(0), [self._sampling[req.request_id]])
        self._promote_to_decode(req)
        self._append_token(req, sample.token_ids[0], sample.logprobs[0])
        return True

    def _reuses_prefix(self, req: Request) -> bool:
        """Prefix-cache hits for ``req``: not for rows scoring their prompt (a cached
        block has KV but not the logits its tokens were scored with)."""
        return self.prefix_caching and not wants_prompt_logprobs(req.params)

    def _late_prefix_hit(self, req: Request) -> None:
        """Before a row's first prefill chunk, reuse blocks that a row sharing its prefix
        committed after this one was admitted (same-tick arrivals, ``n`` samples)."""
        extra = self.block_pool.extend_prefix_hit(req.request_id, req.prompt_token_ids)
        if extra:
            req.num_cached_tokens += extra
            req.num_computed_tokens += extra
            self.policy.on_tokens_processed(req, -extra, 0)  # cached tokens are not charged
