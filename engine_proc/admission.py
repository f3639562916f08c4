"""① ``_admit_pending``: gates 2 and 3 at the head of ``_pending`` (part of
:class:`~engine_proc.scheduler.Scheduler`).

Gate 1 (queue capacity) and the hard rejects that depend only on the configuration run
before the ack, in the engine's I/O thread (:mod:`engine_proc.gates`); they are checked
again here. A request that passes is admitted: its blocks are allocated (reusing a
prefix-cache hit), its reservation added to ``_active_kv_reserved``, and it enters
``_prefilling`` (or, monolithic, is prefilled at once and promoted). A soft-hold leaves
the head in place, so order and fairness hold; a hard-reject finishes it with an error.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine_proc.block_pool import PrefixMatch
from engine_proc.gates import never_fits
from engine_proc.request import Request, RequestStatus
from engine_proc.sampler import RowSamplingState
from shared.config import PrefillMode
from shared.protocol import RejectCode, RejectReason


class AdmitVerdict(enum.Enum):
    ADMIT = "admit"
    SOFT_HOLD = "soft_hold"  # stays at the head of _pending; re-checked next tick
    HARD_REJECT = "hard_reject"  # can never fit


@dataclass(frozen=True)
class AdmitDecision:
    verdict: AdmitVerdict
    match: PrefixMatch | None = None  # the prefix-cache lookup, reused by the allocation
    reason: RejectReason | None = None  # which gate held or rejected



class Admission:
    """Mixed into :class:`~engine_proc.scheduler.Scheduler`: phase ① and its gates."""

    def check_gates(self, req: Request) -> AdmitDecision:
        """Gates 2 (active-KV budget, tokens) and 3 (block pool, blocks) for ``req``.

        Gate 2 adds ``prompt_len + max_tokens`` to the running reservation; gate 3
        needs blocks for the whole reservation minus the prefix-cache hit, so a row
        admitted can always decode to ``max_tokens`` without preemption.
        """
        need = req.max_total_tokens
        reason = never_fits(self.limits, req.prompt_len, req.params.max_tokens)
        if reason is not None:
            return AdmitDecision(AdmitVerdict.HARD_REJECT, reason=reason)
        pool = self.block_pool
        if self._active_kv_reserved + need > self.kv_budget_tokens:
            return AdmitDecision(AdmitVerdict.SOFT_HOLD, reason=RejectReason(
                RejectCode.KV_BUDGET, "active-KV budget is full", need,
                self.kv_budget_tokens - self._active_kv_reserved))
        match = pool.match_prefix(req.prompt_token_ids) if self._reuses_prefix(req) else None
        cached = match.num_tokens if match else 0
        # Hit blocks that sit in the free queue leave it when reused: they count too.
        revived = match.num_evictable_blocks if match else 0
        if not pool.can_allocate(pool.blocks_needed(need, cached) + revived):
            return AdmitDecision(AdmitVerdict.SOFT_HOLD, reason=RejectReason(
                RejectCode.BLOCK_POOL, "not enough free KV blocks", self.limits.blocks_for(need),
                pool.num_free_blocks))
        return AdmitDecision(AdmitVerdict.ADMIT, match=match)

    def _admit_pending(self) -> None:
        self._release_grammar_waits()  # rows whose grammar compiled join the queue
        while len(self._pending) and len(self._active) + len(self._prefilling) < self.max_batch_size:
            req = self._pending.peek_next()
            decision = self.check_gates(req)
            if decision.verdict is AdmitVerdict.SOFT_HOLD:
                self.kv_admit_blocked += 1
                return  # head keeps its place: order and fairness hold
            self._pending.pick_next()
            self.on_left_pending(req)
            if decision.verdict is AdmitVerdict.HARD_REJECT:
                req.error = decision.reason.message
                code = decision.reason.code.value
                self.rejected_by_code[code] = self.rejected_by_code.get(code, 0) + 1
                self._finish(req, RequestStatus.FINISHED_ERROR)
                continue
            self._admit(req, decision.match)

    def _admit(self, req: Request, match: PrefixMatch | None) -> None:
        cached_ids = req.prompt_token_ids if self._reuses_prefix(req) else []
        self.block_pool.allocate(req.request_id, cached_ids, req.max_total_tokens, match)
        req.num_cached_tokens = self.block_pool.num_cached_tokens(req.request_id) if cached_ids else 0
        req.num_computed_tokens = req.num_cached_tokens
        req.kv_reserved = req.max_total_tokens
        self._active_kv_reserved += req.kv_reserved
        state = self._sampling[req.request_id] = RowSamplingState(
            req.params, req.prompt_token_ids, self.eos_token_ids, self.backend.device)
        state.grammar = self._row_grammar(req)
        req.status = RequestStatus.PREFILLING
        self.policy.on_request_admitted(req)
        # VTC charges the whole uncached prompt at admission (as the paper does), not per
        # chunk: charging per chunk let one session take every slot freed in a tick.
        self.policy.on_tokens_processed(req, req.prompt_len - req.num_cached_tokens, 0)
        self._prefilling.append(req)
        if self.prefill_mode is PrefillMode.MONOLITHIC:
            self._prefilling.remove(req)
            self._isolated(req, self._run_prefill, req, req.prompt_len - req.num_computed_tokens)
