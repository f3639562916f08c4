"""Test helpers: building a scheduler on a model, running it, and checking its
logits against transformers' own forward pass (teacher forcing)."""

from __future__ import annotations

import dataclasses
import itertools
import time

import msgspec
import torch

from engine_proc.factory import build_scheduler
from engine_proc.request import Request
from shared.config import EngineConfig
from shared.protocol import SamplingParams


class RecordingBackend:
    """Wraps a backend and records, per row, every logits vector it returned."""

    def __init__(self, inner):
        self.inner = inner
        self.logits: dict[str, list[torch.Tensor]] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill_chunk(self, row_id, token_ids, start_pos, compute_logits, **kw):
        out = self.inner.prefill_chunk(row_id, token_ids, start_pos, compute_logits, **kw)
        if out is not None and compute_logits:  # the last token's logits, which are sampled
            self.logits.setdefault(row_id, []).append((out[-1] if out.dim() == 2 else out).clone())
        return out

    def prefill_chunks(self, chunks):
        outs = self.inner.prefill_chunks(chunks)
        for chunk, out in zip(chunks, outs):
            if out is not None and chunk.compute_logits:
                self.logits.setdefault(chunk.row_id, []).append((out[-1] if out.dim() == 2 else out).clone())
        return outs

    def decode_step_batched(self, row_ids, token_ids, positions):
        out = self.inner.decode_step_batched(row_ids, token_ids, positions)
        for rid, row in zip(row_ids, out):
            self.logits.setdefault(rid, []).append(row.clone())
        return out

    def mixed_step(self, row_ids, token_ids, positions, chunks):
        decoded, prefilled = self.inner.mixed_step(row_ids, token_ids, positions, chunks)
        for rid, row in zip(row_ids, decoded):
            self.logits.setdefault(rid, []).append(row.clone())
        for chunk, out in zip(chunks, prefilled):
            if out is not None:
                self.logits.setdefault(chunk.row_id, []).append(out.clone())
        return decoded, prefilled


def make_scheduler(model, record: bool = True, **overrides):
    config = EngineConfig(**{"max_model_len": 1024, "max_batch_size": 8, "prefill_chunk_size": 0,
                             **overrides})
    sched = build_scheduler(config, model)
    if record:
        sched.backend = RecordingBackend(sched.backend)
    return sched


_ids = itertools.count()


def make_request(prompt: list[int], max_tokens: int = 8, **params) -> Request:
    return Request(request_id=f"r{next(_ids)}", frontend_id="fe", prompt_token_ids=list(prompt),
                   params=SamplingParams(max_tokens=max_tokens, temperature=params.pop("temperature", 0.0),
                                         **params))


def run_until_idle(sched, arrivals: dict[int, list[Request]] | None = None, max_ticks: int = 10_000,
                   check: bool = True) -> dict[str, list]:
    """Tick until no work is left, adding ``arrivals[t]`` before tick ``t``.
    Returns request id → list of RequestOutput."""
    arrivals = arrivals or {}
    outputs: dict[str, list] = {}
    last_arrival = max(arrivals, default=-1)
    for tick in range(max_ticks):
        for req in arrivals.get(tick, []):
            sched.add_request(req)
        if not sched.has_work() and tick > last_arrival:
            return outputs
        deadline = time.monotonic() + 60
        while sched.only_compiling() and time.monotonic() < deadline:  # a grammar compiles off-thread
            time.sleep(0.005)
        for _, out in sched.step():
            outputs.setdefault(out.request_id, []).append(out)
        if check:
            sched.check_invariants()
    raise AssertionError("scheduler did not become idle")


def tokens_of(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


@torch.inference_mode()
def reference_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Teacher-forced next-token logits ``[len(output), vocab]`` from one plain forward."""
    ids = torch.tensor([prompt + output[:-1]])
    return model(input_ids=ids).logits[0, len(prompt) - 1:].float()


def assert_matches_reference(model, req_prompt: list[int], output: list[int],
                             recorded: list[torch.Tensor], atol: float = 2e-3) -> None:
    """The engine's logits at every step equal the teacher-forced reference within
    ``atol``, and each greedy token is the reference argmax unless the reference's
    top two logits are within ``atol`` of each other (a near-tie)."""
    ref = reference_logits(model, req_prompt, output)
    got = torch.stack(recorded[: len(output)])
    assert got.shape == ref.shape, (got.shape, ref.shape)
    diff = (got - ref).abs().max().item()
    assert diff < atol, f"logits differ from the reference by {diff}"
    top2 = ref.topk(2, dim=-1)
    for step, token in enumerate(output):
        margin = (top2.values[step, 0] - top2.values[step, 1]).item()
        if margin > atol:
            assert token == top2.indices[step, 0].item(), f"step {step}: token {token} is not the argmax"


def replace_params(req: Request, **changes) -> Request:
    return dataclasses.replace(req, params=msgspec.structs.replace(req.params, **changes))
