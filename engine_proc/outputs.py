"""The output rules and the tick's outputs (part of :class:`~engine_proc.scheduler.Scheduler`).

A row ends when it samples an EOS token (unless ``ignore_eos``) or one of its
``stop_token_ids`` once it has ``min_tokens``, or when it reaches ``max_tokens`` or the
context window (``max_model_len``). A constrained row also ends with ``stop`` when its
grammar is complete (nothing but EOS could follow), and on EOS even with ``ignore_eos``
(its grammar allowed EOS only because the output matches and ``ignore_eos`` was off, or
because the grammar is complete). What a tick produced is buffered per request and
drained as one :class:`~shared.protocol.RequestOutput` each, in the order requests
first appeared.
"""

from __future__ import annotations

from engine_proc.request import Request, RequestStatus
from shared.protocol import RequestOutput, TokenLogprob


class OutputBuffer:
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

    def forward(self, req: Request, output: RequestOutput) -> None:
        """Buffer an output made elsewhere (a handed-over row's first tokens) as this
        engine's own, to be drained before anything it adds later."""
        item = self._item(req)
        item["token_ids"].extend(output.token_ids)
        if output.logprobs:
            item.setdefault("logprobs", []).extend(output.logprobs)
        if output.prompt_logprobs is not None:
            item["prompt_logprobs"] = output.prompt_logprobs

    def take(self, req: Request) -> RequestOutput | None:
        """Remove ``req``'s buffered output and return it (``None`` if it has none)."""
        item = self.items.pop(req.request_id, None)
        return None if item is None else self._build(item)

    def _item(self, req: Request) -> dict:
        item = self.items.get(req.request_id)
        if item is None:
            item = self.items[req.request_id] = {"req": req, "token_ids": []}
        return item

    def drain(self) -> list[tuple[str, RequestOutput]]:
        """``(frontend_id, output)`` pairs, in the order requests first appeared."""
        out = [(item["req"].frontend_id, self._build(item)) for item in self.items.values()]
        self.items = {}
        return out

    @staticmethod
    def _build(item: dict) -> RequestOutput:
        req: Request = item["req"]
        return RequestOutput(
            request_id=req.request_id,
            token_ids=item["token_ids"],
            finish_reason=item.get("finish_reason"),
            logprobs=item.get("logprobs"),
            num_prompt_tokens=req.prompt_len,
            num_cached_tokens=req.num_cached_tokens,
            error=req.error if item.get("finish_reason") is not None else None,
            prompt_logprobs=item.get("prompt_logprobs"),
        )


class OutputRules:
    """Mixed into :class:`~engine_proc.scheduler.Scheduler`: a sampled token's way out."""

    def _append_token(self, req: Request, token_id: int, logprob: TokenLogprob | None) -> None:
        req.output_token_ids.append(token_id)
        state = self._sampling[req.request_id]
        state.append(token_id)
        self.num_generated_tokens += 1
        self._out.token(req, token_id, logprob)
        params = req.params
        n = req.num_output_tokens
        grammar = state.grammar
        if n >= params.min_tokens and (
                token_id in params.stop_token_ids
                or (not params.ignore_eos and token_id in self.eos_token_ids)):
            req.status = RequestStatus.FINISHED_STOPPED
        elif grammar is not None and token_id in self.eos_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED  # the grammar allowed EOS: it accepts
        elif grammar is not None and not grammar.advance(token_id):
            req.error = "the sampled token breaks the row's grammar"
            req.status = RequestStatus.FINISHED_ERROR
        elif grammar is not None and grammar.finished:
            req.status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        elif n >= params.max_tokens or req.num_tokens >= self.backend.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
        if req.status.is_finished:
            self._out.finish(req)
