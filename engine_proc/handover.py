"""Disaggregated prefill and decode: the scheduler's two ends of a handover (part of
:class:`~engine_proc.scheduler.Scheduler`; ``PREFILL_MODE=disaggregated``).

A **prefill** engine runs ``_pending`` (the policy, gate 1 at HTTP entry, gates 2 and 3
against its own pool) and ``_prefilling``. A row whose prompt completes samples its first
token and is promoted through ``_promote_to_decode`` as in every mode; then, instead of
decoding it, :meth:`Handovers._hand_over_promoted` packs it into a
:class:`~shared.handover_wire.Handover` (metadata; its KV blocks' bytes are copied
straight into the buffer the sink gives: a memfd's mapping) and hands it to the sink,
which picks a decode engine. Once the sink has it the row leaves through the single
release path (blocks, reservation, policy) without a finish: it is no longer this
engine's. A row whose first token ends it finishes here. When no decode engine can take
it the row waits in ``_active`` (never decoded here) and is offered again next tick.

The first output (first token, its logprobs, prompt logprobs) is not streamed by the
prefill engine: it rides in the handover and the decode engine sends it first, so one
engine streams each row from its first token to its last, in order.

A **decode** engine validates a handover field by field against its own KV layout and
limits (:meth:`receive_handover`), streams its first output at once and queues it in
``_held``. Each tick, before ③ and ④, :meth:`_admit_handovers` admits the head of
``_held`` through gates 2 and 3 (the reservation invariant holds on the side that holds
the row: admit adds, finish/evict/abort subtract); a full engine soft-holds it (never
drops it). Admitted: fresh blocks, the KV copied in, the sampling state (penalty counts
from the output so far, the seeded generator's state) restored, and the row joins the
decode batch through ``_promote_to_decode``. A constrained row's grammar is rebuilt from
its constraint's source text (in the handover's sampling parameters; compiled on the
grammar worker, cached) and advanced over the tokens the prefill engine sampled. An abort reaches a held row, and an abort
that arrives before its handover leaves a tombstone that refuses the handover.
"""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from engine_proc.block_pool import cdiv
from engine_proc.gates import never_fits
from engine_proc.request import Request, RequestStatus
from engine_proc.sampler import RowSamplingState
from shared.config import EngineRole
from shared.handover_wire import Handover, KVLayout, layout_problem
from shared.protocol import RequestOutput

log = logging.getLogger(__name__)

HandoverSink = Callable[[Handover, Callable[[torch.Tensor], None]], bool]
"""``sink(handover, fill) -> bool``: take the row (True) or not now (False). ``fill(dst)``
writes the KV payload into ``dst``, a uint8 tensor of ``handover.kv_bytes``; the sink calls
it before returning (the blocks are freed right after)."""

MAX_TOMBSTONES = 4096
TIMES_KEPT = 1024


@dataclass
class Held:
    """A handover a decode engine accepted and has not admitted yet."""

    req: Request
    handover: Handover
    payload: torch.Tensor  # uint8 [kv_bytes]
    transit_s: float  # sent_at → received
    release: Callable[[], None] | None = None  # unmaps the payload once copied in
    grammar: Future | None = None  # a constrained row's compile (engine_proc.grammar); admitted once done


def kv_layout(cache) -> KVLayout:
    """The :class:`~shared.handover_wire.KVLayout` of a :class:`~engine_proc.kv_cache.PagedKVCache`."""
    k = cache.keys[0]
    paired = k.dim() == 5
    return KVLayout(num_layers=len(cache.keys), num_kv_heads=k.shape[1],
                    head_dim=k.shape[2] * 2 if paired else k.shape[2], block_size=cache.block_size,
                    dtype=str(k.dtype).removeprefix("torch."), paired=paired, block_nbytes=cache.block_nbytes)


def percentiles(values, qs=(50, 99)) -> dict:
    if not values:
        return {f"p{q}": None for q in qs}
    ordered = sorted(values)
    return {f"p{q}": ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] for q in qs}


class Handovers:
    """Mixed into :class:`~engine_proc.scheduler.Scheduler`: both roles' handover steps."""

    def _init_handovers(self) -> None:
        self.role = EngineRole(self.config.role)
        self.handover_sink: HandoverSink | None = None  # prefill role: set by the engine
        self._handing: dict[str, RequestOutput] = {}  # prefill: promoted rows not handed yet → first output
        self._handed_ids: list[str] = []  # prefill: handed since the engine last asked
        self._held: collections.deque[Held] = collections.deque()  # decode: accepted, not admitted
        self._tombstones: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._session_tokens: dict[str, int] = {}  # decode: tokens per session since the last report
        self._handover_s: collections.deque[float] = collections.deque(maxlen=TIMES_KEPT)
        self.num_handovers = 0  # prefill: handed out; decode: admitted
        self.handover_bytes = 0
        self.handovers_refused = 0  # decode: refused (invalid, aborted first)
        self._kv_layout: KVLayout | None = None

    @property
    def kv_layout(self) -> KVLayout:
        if self._kv_layout is None:
            self._kv_layout = kv_layout(self.backend.cache)
        return self._kv_layout

    # ------------------------------------------------------------------ prefill role

    def prefill_role_step(self) -> None:
        """① admit → ② prefill → ③ evict (rows ended by their first token) → hand over."""
        self._admit_pending()
        self.advance_prefill_chunk()
        self.evict_finished()
        self._hand_over_promoted()

    def _hand_over_promoted(self) -> None:
        for req in list(self._active):
            first = self._handing.pop(req.request_id, None) or self._out.take(req)
            first = first or RequestOutput(req.request_id, [], num_prompt_tokens=req.prompt_len)
            if self.handover_sink is None or not self._hand_over(req, first):
                self._handing[req.request_id] = first  # no decode engine can take it now: next tick
                continue
            self._release(req)
            self._handed_ids.append(req.request_id)

    def _hand_over(self, req: Request, first: RequestOutput) -> bool:
        bs = self.block_pool.block_size
        n_kv = req.num_tokens - 1  # the last sampled token is not fed yet
        blocks = self.block_pool.block_table(req.request_id)[:cdiv(n_kv, bs)]
        gen = self._sampling[req.request_id].generator
        layout = self.kv_layout
        h = Handover(request_id=req.request_id, frontend_id=req.frontend_id,
                     prompt_token_ids=req.prompt_token_ids, output_token_ids=list(req.output_token_ids),
                     params=req.params, session_id=req.session_id, priority=req.priority,
                     num_cached_tokens=req.num_cached_tokens,
                     generator_state=gen.get_state().numpy().tobytes() if gen is not None else None,
                     first_output=first, layout=layout, num_kv_tokens=n_kv, num_blocks=len(blocks),
                     kv_bytes=len(blocks) * layout.block_nbytes, sent_at=time.time())
        t0 = time.perf_counter()
        if not self.handover_sink(h, lambda dst: self.backend.cache.copy_blocks_out(blocks, dst)):
            return False
        self._handover_s.append(time.perf_counter() - t0)
        self.num_handovers += 1
        self.handover_bytes += h.kv_bytes
        return True

    @property
    def only_waiting_for_decode(self) -> bool:
        """Prefill role: all that is left are rows no decode engine can take yet."""
        return bool(self._handing) and not len(self._pending) and not self._prefilling

    def take_handed_ids(self) -> list[str]:
        """Ids handed to a decode engine since the last call (they are no longer here)."""
        out, self._handed_ids = self._handed_ids, []
        return out

    def cancel_handing(self, request_id: str) -> None:
        """Forget a waiting row's held-back first output (it is being aborted)."""
        self._handing.pop(request_id, None)

    # ------------------------------------------------------------------ decode role

    def decode_role_step(self) -> None:
        """admit handovers (gates 2, 3) → ③ evict → ④ decode."""
        self._admit_handovers()
        self.evict_finished()
        rows = list(self._active)
        self.decode_step()
        self.count_session_tokens(rows)

    def receive_handover(self, h: Handover, payload: torch.Tensor, release: Callable[[], None] | None = None
                         ) -> str | None:
        """Take a handover (``payload``: its KV, uint8 ``[h.kv_bytes]``): ``None`` once it is
        queued in ``_held`` with its first output buffered to stream, else why it was
        refused (the caller tells the prefill engine, which fails the row). Never raises
        for a bad frame; ``release`` is called once the payload is no longer needed."""
        problem = self._handover_problem(h, payload)
        if problem is not None:
            self.handovers_refused += 1
            if release is not None:
                release()
            return problem
        req = Request(request_id=h.request_id, frontend_id=h.frontend_id,
                      prompt_token_ids=list(h.prompt_token_ids), params=h.params, session_id=h.session_id,
                      priority=h.priority)
        req.output_token_ids = list(h.output_token_ids)
        req.num_cached_tokens = h.num_cached_tokens
        req.num_computed_tokens = h.num_kv_tokens
        req.first_token_time = req.arrival_time
        grammar = None
        if h.params.constraint is not None:  # the matcher is rebuilt here from the constraint's source text
            grammar = self.grammars.get(h.params.constraint, on_done=self.on_grammar_ready)
        self._held.append(Held(req, h, payload, max(0.0, time.time() - h.sent_at), release, grammar))
        self._out.forward(req, h.first_output)
        return None

    def _handover_problem(self, h: Handover, payload: torch.Tensor) -> str | None:
        if self.role is not EngineRole.DECODE:
            return f"this engine's role is {self.role.value}, not decode"
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            return "the KV payload is not a flat byte buffer"
        problem = layout_problem(h, payload.numel(), self.kv_layout)
        if problem is not None:
            return problem
        vocab = self.limits.vocab_size
        if max(h.prompt_token_ids) >= vocab or max(h.output_token_ids) >= vocab:
            return f"token ids must be in [0, {vocab})"
        if h.request_id in self._tombstones:
            del self._tombstones[h.request_id]
            return "aborted before its handover arrived"
        if h.request_id in self._requests or any(x.req.request_id == h.request_id for x in self._held):
            return f"duplicate request id {h.request_id!r}"
        if h.generator_state is not None and h.params.seed is None:
            return "a generator state for an unseeded row"
        if h.params.constraint is not None and self.grammars is None:
            return "this engine has no grammar compiler for structured outputs"
        reason = never_fits(self.limits, len(h.prompt_token_ids), h.params.max_tokens)
        return reason.message if reason is not None else None

    def _admit_handovers(self) -> None:
        pool = self.block_pool
        while self._held and len(self._active) < self.max_batch_size:
            held = self._held[0]
            if held.grammar is not None and not held.grammar.done():
                return  # its grammar compiles on the worker thread; the queue keeps its order
            need = held.req.max_total_tokens
            if self._active_kv_reserved + need > self.kv_budget_tokens or not pool.can_allocate(
                    pool.blocks_needed(need)):
                self.kv_admit_blocked += 1
                return  # soft-hold: the head keeps its place until rows finish
            self._held.popleft()
            try:
                self._adopt(held)
            except Exception as exc:  # noqa: BLE001 - fail this row only, as a failed prefill does
                log.exception("adopting the handover of %s failed; failing that row only", held.req.request_id)
                self._unadopt(held.req, f"handover failed: {exc}")
            finally:
                held.payload = None
                if held.release is not None:
                    held.release()

    def _adopt(self, held: Held) -> None:
        req, h = held.req, held.handover
        rid = req.request_id
        self.block_pool.allocate(rid, [], req.max_total_tokens)
        t0 = time.perf_counter()
        blocks = self.block_pool.block_table(rid)[:h.num_blocks]
        self.backend.cache.copy_blocks_in(blocks, held.payload)
        self.backend.adopt(rid, h.num_kv_tokens)
        state = RowSamplingState(req.params, req.prompt_token_ids, self.eos_token_ids, self.backend.device)
        for t in req.output_token_ids:
            state.append(t)
        if h.generator_state is not None:
            state.generator.set_state(torch.frombuffer(bytearray(h.generator_state), dtype=torch.uint8))
        if held.grammar is not None:  # raises the compile's error: the row fails (_unadopt)
            req.grammar_template = held.grammar.result()
            state.grammar = self._row_grammar(req)
            for t in req.output_token_ids:  # the prefill engine's tokens: the matcher's state catches up
                if not state.grammar.advance(t):
                    raise ValueError("the handed-over tokens break the row's grammar")
        self._sampling[rid] = state
        req.kv_reserved = req.max_total_tokens
        self._active_kv_reserved += req.kv_reserved
        req.arrival_seq = self._arrival_seq
        self._arrival_seq += 1
        self._requests[rid] = req
        self.policy.on_request_admitted(req)
        self._promote_to_decode(req)
        self._handover_s.append(held.transit_s + time.perf_counter() - t0)
        self.num_handovers += 1
        self.handover_bytes += h.kv_bytes

    def _unadopt(self, req: Request, error: str) -> None:
        """Undo a partial :meth:`_adopt` and end the row with an error."""
        rid = req.request_id
        if rid in self._requests:
            req.error = error
            self._finish(req, RequestStatus.FINISHED_ERROR)  # the release path undoes the rest
            return
        self.backend.release(rid)
        self.block_pool.free(rid)
        self._sampling.pop(rid, None)
        req.error = error
        req.status = RequestStatus.FINISHED_ERROR
        self._out.finish(req)

    def abort_held(self, request_id: str) -> bool:
        """Abort a held handover (its finish streams); False if none has this id."""
        for held in self._held:
            if held.req.request_id == request_id:
                self._held.remove(held)
                held.req.status = RequestStatus.FINISHED_ABORTED
                self._out.finish(held.req)
                self.num_aborted += 1
                if held.release is not None:
                    held.release()
                return True
        return False

    def tombstone(self, request_id: str) -> None:
        """Remember an abort for a row not here yet: its handover will be refused."""
        self._tombstones[request_id] = None
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def count_session_tokens(self, rows: list[Request]) -> None:
        for r in rows:
            self._session_tokens[r.session_id] = self._session_tokens.get(r.session_id, 0) + 1

    def take_session_tokens(self) -> dict[str, int]:
        """Decode tokens per ``session_id`` since the last call (for the prefill engines' VTC)."""
        out, self._session_tokens = self._session_tokens, {}
        return out

    def held_requests(self) -> list[Request]:
        return [h.req for h in self._held]

    def handover_stats(self) -> dict:
        times = [t * 1000 for t in self._handover_s]
        pct = percentiles(times)
        return {"role": self.role.value, "handovers": {
            "count": self.num_handovers, "bytes": self.handover_bytes, "time_p50_ms": pct["p50"],
            "time_p99_ms": pct["p99"], "waiting": len(self._handing), "held": len(self._held),
            "refused": self.handovers_refused}}
