"""The scheduler: three queues and the ordered tick (see the scheduler card).

Every request is in exactly one of::

    _pending     waiting, ordered by the policy (FCFS or Fair/VTC)   ≤ MAX_QUEUE_SIZE
    _prefilling  prompt being computed, one chunk per tick           ┐ together
    _active      the decode batch, one token per row per tick        ┘ ≤ MAX_BATCH_SIZE

One tick, in this order (the worker holds the backend lock throughout)::

    ① _admit_pending        gates 2 and 3; admitted → _prefilling (or, monolithic,
                             prefilled at once and promoted)
    ② advance_prefill_chunk up to PREFILL_CHUNK_SIZE prompt tokens, oldest row first;
                             a final chunk samples the first token and promotes
    ③ evict_finished        rows that ended (EOS, stop id, max_tokens) release
                             their KV, blocks and reservation
    ④ decode_step           one batched forward, one new token per row

Admit and prefill run before evict so that a row whose *first* token ends it is
still seen by ③ and its token streamed; do not reorder without re-deriving that.

``PREFILL_MODE=mixed_batch`` (version B) runs ① → ③ → ②+④: :meth:`Scheduler.mixed_step`
is one forward pass for the decode rows and the tick's prefill chunks under one token
budget. ③ must precede it (a finished row must not be fed); a row whose first token
ends it is promoted with that token streamed and is evicted by the next tick's ③.
"""

from __future__ import annotations

import collections
import enum
import logging
from dataclasses import dataclass
from typing import Callable

from engine_proc.backends.base import Backend, PrefillChunk, affordable_prompt_tokens, prompt_chunk_cost
from engine_proc.backends.kernel_batch import BatchRejected
from engine_proc.prompt_logprobs import score_chunk, wants_prompt_logprobs
from engine_proc.block_pool import BlockPool, PrefixMatch
from engine_proc.gates import Limits, never_fits
from engine_proc.policy import SchedulingPolicy
from engine_proc.request import Request, RequestStatus
from engine_proc.sampler import RowSamplingState, Sampler
from shared.config import EngineConfig, PrefillMode
from shared.protocol import RejectCode, RejectReason, RequestOutput, TokenLogprob

log = logging.getLogger(__name__)


class AdmitVerdict(enum.Enum):
    ADMIT = "admit"
    SOFT_HOLD = "soft_hold"  # stays at the head of _pending; re-checked next tick
    HARD_REJECT = "hard_reject"  # can never fit


@dataclass(frozen=True)
class AdmitDecision:
    verdict: AdmitVerdict
    match: PrefixMatch | None = None  # the prefix-cache lookup, reused by the allocation
    reason: RejectReason | None = None  # which gate held or rejected


class _OutputBuffer:
    """Per-tick accumulation of each request's new tokens and finish."""

    def __init__(self) -> None:
        self.items: dict[str, dict] = {}

    def token(self, req: Request, token_id: int, logprob: TokenLogprob | None) -> None:
        item = self._item(req)
        item["token_ids"].append(token_id)
        if logprob is not None:
            item.setdefault("logprobs", []).append(logprob)

    def finish(self, req: Request) -> None:
        self._item(req)["finish_reason"] = req.status.finish_reason

    def prompt_logprobs(self, req: Request, logprobs: list[TokenLogprob]) -> None:
        self._item(req)["prompt_logprobs"] = logprobs

    def _item(self, req: Request) -> dict:
        item = self.items.get(req.request_id)
        if item is None:
            item = self.items[req.request_id] = {"req": req, "token_ids": []}
        return item

    def drain(self) -> list[tuple[str, RequestOutput]]:
        """``(frontend_id, output)`` pairs, in the order requests first appeared."""
        out = []
        for item in self.items.values():
            req: Request = item["req"]
            out.append((req.frontend_id, RequestOutput(
                request_id=req.request_id,
                token_ids=item["token_ids"],
                finish_reason=item.get("finish_reason"),
                logprobs=item.get("logprobs"),
                num_prompt_tokens=req.prompt_len,
                num_cached_tokens=req.num_cached_tokens,
                error=req.error if item.get("finish_reason") is not None else None,
                prompt_logprobs=item.get("prompt_logprobs"),
            )))
        self.items = {}
        return out


class Scheduler:
    """Owns the queues, the gates and the reservation accounting; drives a backend.

    Not thread-safe: only the tick thread calls it (the engine's I/O thread talks to
    it through queues).
    """

    def __init__(self, config: EngineConfig, backend: Backend, policy: SchedulingPolicy,
                 block_pool: BlockPool, eos_token_ids: list[int], sampler: Sampler | None = None,
                 prefix_caching: bool = False,
                 on_left_pending: Callable[[Request], None] | None = None):
        mode = config.resolved_prefill_mode
        if mode not in (PrefillMode.MONOLITHIC, PrefillMode.CHUNKED, PrefillMode.MIXED_BATCH):
            raise NotImplementedError(f"PREFILL_MODE={mode.value} is not implemented yet "
                                      "(monolithic, chunked and mixed_batch are)")
        if mode is PrefillMode.MIXED_BATCH and not backend.packs_mixed:
            raise NotImplementedError(f"PREFILL_MODE=mixed_batch needs a backend that mixes decode rows and "
                                      f"prefill chunks in one pass (paged); {type(backend).__name__} does not")
        self.config = config
        self.prefill_mode = mode
        self.chunk_size = config.prefill_chunk_size if mode is PrefillMode.CHUNKED else 0
        # mixed_batch: tokens of one tick's pass, decode rows first (vLLM's max_num_batched_tokens)
        self.token_budget = config.resolved_max_num_batched_tokens if mode is PrefillMode.MIXED_BATCH else 0
        if mode is PrefillMode.MIXED_BATCH and self.token_budget <= config.max_batch_size:
            raise ValueError(f"max_num_batched_tokens ({self.token_budget}) must exceed max_batch_size "
                             f"({config.max_batch_size})")
        self.backend = backend
        self.policy = policy
        self.block_pool = block_pool
        kernels = getattr(backend, "kernels", None)
        self.sampler = sampler or Sampler(argmax=kernels.argmax if kernels is not None else None)
        self.eos_token_ids = list(eos_token_ids)
        self.prefix_caching = prefix_caching
        self.max_batch_size = config.max_batch_size
        self.kv_budget_tokens = config.resolved_kv_budget_tokens
        self.limits = Limits.from_config(config, backend.max_model_len, backend.vocab_size)
        self._on_left_pending = on_left_pending or (lambda req: None)

        self._pending = policy  # ordered by the policy; see SchedulingPolicy
        self._prefilling: collections.deque[Request] = collections.deque()
        self._active: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._sampling: dict[str, RowSamplingState] = {}
        self._active_kv_reserved = 0  # Σ (prompt_len + max_tokens) over admitted rows
        self._arrival_seq = 0
        self._out = _OutputBuffer()

        self.kv_admit_blocked = 0
        self.num_generated_tokens = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.rejected_by_code: dict[str, int] = {}  # hard rejects at admission, by reason
        self.num_ticks = 0

    # ------------------------------------------------------------------ entry points

    def add_request(self, req: Request) -> None:
        """Put an accepted request into ``_pending``. Raises ``ValueError`` for the id of a
        request still in the engine (one that finished this tick and waits for its
        eviction is evicted now: its id was already free to its client)."""
        old = self._requests.get(req.request_id)
        if old is not None and old.status.is_finished and old in self._active:
            self._release(old)
        elif old is not None:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.arrival_seq = self._arrival_seq
        self._arrival_seq += 1
        req.status = RequestStatus.WAITING
        self._requests[req.request_id] = req
        self.policy.on_request_arrived(req)

    def abort_request(self, request_id: str) -> bool:
        """Abort from whichever queue holds the request; False if unknown or done."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def abort_frontend(self, frontend_id: str) -> int:
        """Abort every request of a departed frontend; returns how many."""
        doomed = [r.request_id for r in self._requests.values() if r.frontend_id == frontend_id]
        for rid in doomed:
            self.abort_request(rid)
        return len(doomed)

    def has_work(self) -> bool:
        return bool(self._requests)

    def step(self, stream: Callable[[list[tuple[str, RequestOutput]]], None] | None = None
             ) -> list[tuple[str, RequestOutput]]:
        """One tick: the four phases in the card's order. Returns what to stream,
        as ``(frontend_id, RequestOutput)`` pairs.

        With ``stream``, first tokens made by prefill are handed to it before the decode
        pass instead of waiting for the end of the tick (TTFT is one decode step shorter).
        """
        self.num_ticks += 1
        self._admit_pending()
        if self.prefill_mode is PrefillMode.MIXED_BATCH:  # ② and ④ are one pass: ③ goes first
            self.evict_finished()
            self.mixed_step()
            return self.drain_outputs()
        self.advance_prefill_chunk()
        if stream is not None and self._out.items:
            stream(self.drain_outputs())
        self.evict_finished()
        self.decode_step()
        return self.drain_outputs()

    def drain_outputs(self) -> list[tuple[str, RequestOutput]]:
        """Outputs produced since the last drain (aborts between ticks included)."""
        return self._out.drain()

    # ------------------------------------------------------------------ ① admit

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
        while len(self._pending) and len(self._active) + len(self._prefilling) < self.max_batch_size:
            req = self._pending.peek_next()
            decision = self.check_gates(req)
            if decision.verdict is AdmitVerdict.SOFT_HOLD:
                self.kv_admit_blocked += 1
                return  # head keeps its place: order and fairness hold
            self._pending.pick_next()
            self._on_left_pending(req)
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
        self._sampling[req.request_id] = RowSamplingState(
            req.params, req.prompt_token_ids, self.eos_token_ids, self.backend.device)
        req.status = RequestStatus.PREFILLING
        self.policy.on_request_admitted(req)
        # VTC charges the whole uncached prompt at admission (as the paper does), not per
        # chunk: charging per chunk let one session take every slot freed in a tick.
        self.policy.on_tokens_processed(req, req.prompt_len - req.num_cached_tokens, 0)
        self._prefilling.append(req)
        if self.prefill_mode is PrefillMode.MONOLITHIC:
            self._prefilling.remove(req)
            self._isolated(req, self._run_prefill, req, req.prompt_len - req.num_computed_tokens)

    # ------------------------------------------------------------------ ② prefill

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

    def _promote_to_decode(self, req: Request) -> None:
        """The one door from prefill into the decode batch (the disaggregation seam)."""
        self.backend.promote(req.request_id)
        req.status = RequestStatus.RUNNING
        self._active.append(req)

    # ------------------------------------------------------------------ ③ evict

    def evict_finished(self) -> None:
        for req in [r for r in self._active if r.status.is_finished]:
            self._release(req)

    # ------------------------------------------------------------------ ④ decode

    def decode_step(self) -> None:
        rows = self._active
        if not rows:
            return
        try:
            logits = self.backend.decode_step_batched(*self._decode_inputs(rows))
        except BatchRejected as exc:  # refused at the kernel boundary before it ran: fail those rows only
            self._fail_rejected(exc, list(rows))
            return
        self._after_decode(rows, logits)

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

    # ------------------------------------------------------------------ ②+④ mixed_batch

    def mixed_step(self) -> None:
        """②+④ as one forward pass (``PREFILL_MODE=mixed_batch``, the card's version B).

        The tick's token budget (``max_num_batched_tokens``) goes first to the decode
        rows, one token each, so running streams never wait; prefill chunks take what is
        left, oldest row first (as :meth:`advance_prefill_chunk` spends its budget).
        Rows whose prompt completes are promoted through :meth:`_promote_to_decode`
        after the pass and decode from the next tick. If the mixed pass fails (it
        changed no row state), its prefill and decode run again as separate passes, so a
        bad prompt fails only its own row.
        """
        rows = list(self._active)
        plan = self._plan_prefill(self.token_budget - len(rows), self.backend.pairs_per_token)
        if not plan:
            self.decode_step()
            return
        if not rows:
            self._run_prefill_plan(plan)
            return
        try:
            logits, prefill_logits = self.backend.mixed_step(*self._decode_inputs(rows), self._chunks(plan))
        except Exception:
            log.exception("mixed pass of %d decode rows and %d prefill chunks failed; retrying them "
                          "as separate passes", len(rows), len(plan))
            self._run_prefill_plan(plan)
            self.decode_step()
            return
        self._after_decode(rows, logits)
        self._after_prefills(plan, prefill_logits)

    # ------------------------------------------------------------------ tokens and exits

    def _append_token(self, req: Request, token_id: int, logprob: TokenLogprob | None) -> None:
        req.output_token_ids.append(token_id)
        self._sampling[req.request_id].append(token_id)
        self.num_generated_tokens += 1
        self._out.token(req, token_id, logprob)
        params = req.params
        n = req.num_output_tokens
        if n >= params.min_tokens and (
                token_id in params.stop_token_ids
                or (not params.ignore_eos and token_id in self.eos_token_ids)):
            req.status = RequestStatus.FINISHED_STOPPED
        elif n >= params.max_tokens or req.num_tokens >= self.backend.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
        if req.status.is_finished:
            self._out.finish(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """End ``req`` with ``status`` from whichever queue holds it."""
        if req.status is RequestStatus.WAITING:
            self._pending.remove(req)
            self._on_left_pending(req)
        if not req.status.is_finished:
            req.status = status
            self._out.finish(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        """The single release path: queues, backend row, blocks, reservation, policy."""
        if req.status is RequestStatus.FINISHED_ABORTED:
            self.num_aborted += 1
        else:
            self.num_finished += 1
        if req in self._active:
            self._active.remove(req)
        elif req in self._prefilling:
            self._prefilling.remove(req)
        self.backend.release(req.request_id)
        self.block_pool.free(req.request_id)
        self._active_kv_reserved -= req.kv_reserved
        req.kv_reserved = 0
        self._sampling.pop(req.request_id, None)
        self.policy.on_request_finished(req)
        del self._requests[req.request_id]

    # ------------------------------------------------------------------ introspection

    @property
    def active_kv_reserved(self) -> int:
        return self._active_kv_reserved

    def check_invariants(self) -> None:
        """Raise AssertionError if the card's invariants do not hold."""
        pending = list(self._pending)
        queues = pending + list(self._prefilling) + self._active
        assert len(queues) == len({id(r) for r in queues}), "a request is in two queues"
        finished_active = [r for r in self._active if r.status.is_finished]
        assert {r.request_id for r in queues} == set(self._requests), "queues and index disagree"
        assert all(r.status is RequestStatus.WAITING for r in pending)
        assert all(r.status is RequestStatus.PREFILLING for r in self._prefilling)
        assert all(r.status is RequestStatus.RUNNING for r in self._active if r not in finished_active)
        admitted = list(self._prefilling) + self._active
        assert self._active_kv_reserved == sum(r.kv_reserved for r in admitted), "reservation drift"
        assert all(r.kv_reserved == r.max_total_tokens for r in admitted)
        assert all(r.kv_reserved == 0 for r in pending)
        assert len(admitted) <= self.max_batch_size
        assert self.block_pool.num_used_blocks <= sum(
            self.block_pool.blocks_needed(r.max_total_tokens) for r in admitted), "leaked blocks"
        self.block_pool.check_invariants()

    def stats(self) -> dict:
        pool = self.block_pool
        return {
            "prefill_mode": self.prefill_mode.value,
            "max_num_batched_tokens": self.token_budget or None,  # mixed_batch only
            "num_pending": len(self._pending),
            "num_prefilling": len(self._prefilling),
            "num_active": len(self._active),
            "batch_size": len(self._active),
            "max_batch_size": self.max_batch_size,
            "active_kv_reserved": self._active_kv_reserved,
            "kv_budget_tokens": self.kv_budget_tokens,
            "kv_admit_blocked": self.kv_admit_blocked,
            "kv_pressure": pool.usage,
            "kv_length": self.backend.kv_length(),
            "blocks": pool.stats(),
            "num_generated_tokens": self.num_generated_tokens,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "num_rejected": sum(self.rejected_by_code.values()),
            "rejected_by_code": dict(self.rejected_by_code),
            "num_ticks": self.num_ticks,
            **self.policy.snapshot(),
        }
