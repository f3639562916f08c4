"""Constrained requests in the scheduler (part of :class:`~engine_proc.scheduler.Scheduler`).

A request with ``params.constraint`` waits in ``_pending`` until its grammar is
compiled: it sits in ``_awaiting_grammar`` (status WAITING, counted as pending) while
:class:`~engine_proc.grammar.GrammarCache` compiles on its worker thread, and enters the
policy's queue at the start of the first tick after the compile (its ``arrival_seq``
unchanged, so FCFS order holds). A compile that fails finishes that request with
``finish_reason`` error and the compiler's message. A cached grammar skips the wait.

At admission each constrained row gets its own :class:`~engine_proc.grammar.RowGrammar`
(``n`` siblings each their own); every token the row accepts advances it, and a row
whose grammar is complete ends with ``stop`` (see :mod:`engine_proc.outputs`).
"""

from __future__ import annotations

from concurrent.futures import Future

from engine_proc.grammar import GrammarCache, RowGrammar
from engine_proc.request import Request, RequestStatus
from shared.constraints import COMPILE_FAILED


class Constrained:
    """Mixed into :class:`~engine_proc.scheduler.Scheduler`."""

    grammars: GrammarCache | None
    _awaiting_grammar: dict[Request, Future]

    def _wait_for_grammar(self, req: Request) -> bool:
        """Called by ``add_request``: True if ``req`` must wait for its compile (it is
        then held in ``_awaiting_grammar``), False if it may enter the queue now."""
        constraint = req.params.constraint
        if constraint is None:
            return False
        if self.grammars is None:
            raise ValueError("this engine has no grammar compiler for structured outputs")
        fut = self.grammars.get(constraint, on_done=self.on_grammar_ready)
        if fut.done() and fut.exception() is None:
            req.grammar_template = fut.result()
            return False
        self._awaiting_grammar[req] = fut
        return True

    def _release_grammar_waits(self) -> None:
        """At the start of ①: rows whose compile finished enter the queue, or fail."""
        if not self._awaiting_grammar:
            return
        for req, fut in list(self._awaiting_grammar.items()):
            if not fut.done():
                continue
            del self._awaiting_grammar[req]
            exc = fut.exception()
            if exc is not None:
                req.error = f"{COMPILE_FAILED}: {exc}"
                self._finish(req, RequestStatus.FINISHED_ERROR)
            else:
                req.grammar_template = fut.result()
                self.policy.on_request_arrived(req)

    def _grammar_waiting_only(self) -> bool:
        """Every request in the engine waits for a compile that is still running (and there
        is one; handovers a decode engine holds are work too)."""
        return (bool(self._awaiting_grammar) and len(self._awaiting_grammar) == len(self._requests)
                and not self.held_requests() and not any(f.done() for f in self._awaiting_grammar.values()))

    def _row_grammar(self, req: Request) -> RowGrammar | None:
        """The matcher of an admitted row (its compile is done), or None."""
        if req.grammar_template is None:
            return None
        return RowGrammar(req.grammar_template, self.eos_token_ids if req.params.ignore_eos else None)
