"""PREFILL_MODE=mixed_batch on the tiny random Llama with the paged backend: the same
greedy tokens as chunked and monolithic prefill, one forward pass per tick, decode rows
advancing every tick while a long prompt prefills, the token budget never exceeded.

Block size 4 so that short prompts span many blocks; every run checks the scheduler's
and the pool's invariants after every tick (``run_until_idle``).
"""

from __future__ import annotations

import random

import pytest

from engine_proc.backends.base import affordable_prompt_tokens, prompt_chunk_cost
from engine_proc.backends.paged import PagedBackend

from engine_proc.request import RequestStatus
from shared.config import EngineConfig, PrefillMode
from shared.protocol import FinishReason
from tests.helpers import (assert_matches_reference, make_request, make_scheduler, run_until_idle,
                           tokens_of)

BS = 4


def _tokens(seed: int, n: int, vocab: int = 49152) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _sched(model, mode: str, chunk: int = 0, **overrides):
    return make_scheduler(model, backend="paged", kv_block_size=BS, prefill_mode=mode,
                          prefill_chunk_size=chunk, **overrides)


class PassLog:
    """Counts the paged backend's forward passes (whichever runner runs them) and the
    tokens of each, per tick."""

    def __init__(self, monkeypatch):
        self.tokens: list[int] = []  # tokens of each forward pass
        forward = PagedBackend._forward

        def counted(backend, ids, *args):
            self.tokens.append(ids.numel())
            return forward(backend, ids, *args)

        monkeypatch.setattr(PagedBackend, "_forward", counted)


@pytest.fixture
def passes(monkeypatch):
    return PassLog(monkeypatch)


def _workload():
    """Eight requests, half behind a shared system prompt, of different lengths, joining
    mid-stream and leaving at different lengths (``arrival tick → requests``)."""
    system = _tokens(40, 18)
    prompts = [(system if i % 2 else []) + _tokens(41 + i, 3 + 7 * i) for i in range(8)]
    max_tokens = [3, 17, 9, 1, 12, 6, 20, 2]
    reqs = [make_request(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, max_tokens)]
    return reqs, {0: reqs[:3], 2: reqs[3:5], 5: reqs[5:7], 9: reqs[7:]}


def test_greedy_tokens_equal_chunked_and_monolithic(tiny_llama):
    """Budgets from "a couple of prompt tokens per tick" to "every prompt at once": each
    request's tokens equal those of chunked and of monolithic prefill, and its logits the
    teacher-forced reference at every step."""
    expected = {}
    for mode, chunk in [("chunked", 5), ("monolithic", 0)]:
        reqs, arrivals = _workload()
        outs = run_until_idle(_sched(tiny_llama, mode, chunk), arrivals)
        expected[mode] = [tokens_of(outs[r.request_id]) for r in reqs]
    assert expected["chunked"] == expected["monolithic"]
    for budget in (10, 24, 512):
        reqs, arrivals = _workload()
        sched = _sched(tiny_llama, "mixed_batch", max_num_batched_tokens=budget)
        outs = run_until_idle(sched, arrivals)
        assert any(outs[r.request_id][-1].num_cached_tokens > 0 for r in reqs)  # prefix hits too
        assert [tokens_of(outs[r.request_id]) for r in reqs] == expected["chunked"], budget
        for req in reqs if budget == 10 else []:  # the most mixed passes
            toks = tokens_of(outs[req.request_id])
            assert len(toks) == req.params.max_tokens
            assert_matches_reference(tiny_llama, req.prompt_token_ids, toks,
                                     sched.backend.logits[req.request_id])


def test_decode_rows_advance_every_tick_in_one_pass_while_a_long_prompt_prefills(tiny_llama, passes):
    """Three streams decode; a 300-token prompt arrives. Until its first token, every tick
    is one forward pass that gives each stream one token and feeds the prompt what the
    budget leaves (budget − 3 decode rows)."""
    budget = 40
    sched = _sched(tiny_llama, "mixed_batch", max_num_batched_tokens=budget)
    sched.backend.pairs_per_token = None  # tokens only; the attention charge has its own test
    streams = [make_request(_tokens(60 + i, 6), max_tokens=200, ignore_eos=True) for i in range(3)]
    for s in streams:
        sched.add_request(s)
    while not all(s.status is RequestStatus.RUNNING for s in streams):
        sched.step()
    long = make_request(_tokens(70, 300), max_tokens=4, ignore_eos=True)
    sched.add_request(long)
    prefill_ticks = 0
    while not long.output_token_ids:
        before = {s.request_id: s.num_output_tokens for s in streams}
        computed = long.num_computed_tokens
        del passes.tokens[:]
        sched.step()
        sched.check_invariants()
        prefill_ticks += 1
        assert all(s.num_output_tokens == before[s.request_id] + 1 for s in streams)
        assert len(passes.tokens) == 1, "decode and prefill must share one forward pass"
        assert passes.tokens[0] <= budget
        assert long.num_computed_tokens - computed == min(budget - 3, 300 - computed)
    assert prefill_ticks == -(-300 // (budget - 3))
    # Decoding together from the next tick: still one pass for all four rows.
    del passes.tokens[:]
    sched.step()
    assert passes.tokens == [4] and long.num_output_tokens == 2


def test_budget_never_exceeded_and_spent_when_prompts_wait(tiny_llama, passes):
    """Random arrivals, lengths, finishes and aborts: no pass exceeds
    max_num_batched_tokens, no tick runs more than one pass, and a tick with prompt
    tokens waiting spends the whole budget (or finishes every waiting prompt)."""
    rng = random.Random(11)
    budget = 20
    sched = _sched(tiny_llama, "mixed_batch", max_num_batched_tokens=budget, max_batch_size=6,
                   kv_num_blocks=120)
    sched.backend.pairs_per_token = None  # tokens only; the attention charge has its own test
    reqs = []
    for tick in range(100):
        if rng.random() < 0.35:
            req = make_request(_tokens(rng.randrange(10**6), rng.randint(1, 60)),
                               max_tokens=rng.randint(1, 12), ignore_eos=True)
            reqs.append(req)
            sched.add_request(req)
        live = [r for r in reqs if sched.has_request(r.request_id)]
        if live and rng.random() < 0.05:
            sched.abort_request(rng.choice(live).request_id)
        del passes.tokens[:]
        sched._admit_pending()  # as step() does first: then the tick's work is known
        sched.evict_finished()
        decode_rows = len(sched._active)
        waiting = sum(r.prompt_len - r.num_computed_tokens for r in sched._prefilling)
        sched.mixed_step()
        sched.drain_outputs()
        sched.check_invariants()
        assert len(passes.tokens) <= 1
        ran = sum(passes.tokens)
        assert ran <= budget
        if waiting:
            assert ran == min(budget, decode_rows + waiting)
    run_until_idle(sched)
    assert sched.block_pool.num_used_blocks == 0 and sched.active_kv_reserved == 0
    finished = [r for r in reqs if r.status is RequestStatus.FINISHED_LENGTH]
    assert len(finished) > 10
    for req in finished[::3]:
        assert_matches_reference(tiny_llama, req.prompt_token_ids, req.output_token_ids,
                                 sched.backend.logits[req.request_id])


def test_prompt_chunks_are_charged_their_attention(tiny_llama, passes):
    """With the backend's pairs_per_token, a chunk costs its tokens plus its attention
    pairs over that ratio: deep in a long prompt the chunks get shorter, each tick's
    prompt cost fits what the decode rows leave, and one token more would not have."""
    budget = 60
    sched = _sched(tiny_llama, "mixed_batch", max_num_batched_tokens=budget, max_model_len=1024,
                   kv_num_blocks=2048 // BS)
    k = sched.backend.pairs_per_token
    assert k == pytest.approx((64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3) / (2 * 4 * 16))  # tiny Llama's shapes
    stream = make_request(_tokens(90, 6), max_tokens=400, ignore_eos=True)
    sched.add_request(stream)
    for _ in range(5):
        sched.step()
    assert stream.status is RequestStatus.RUNNING
    long = make_request(_tokens(91, 600), max_tokens=2, ignore_eos=True)
    sched.add_request(long)
    chunks = []
    for _ in range(200):
        if long.output_token_ids:
            break
        start = long.num_computed_tokens
        del passes.tokens[:]
        sched.step()
        n = long.num_computed_tokens - start
        chunks.append(n)
        assert len(passes.tokens) == 1 and passes.tokens[0] == n + 1
        assert prompt_chunk_cost(start, n, k) <= budget - 1
        if start + n < 600:
            assert prompt_chunk_cost(start, n + 1, k) > budget - 1
    assert sum(chunks) == 600
    assert chunks[-2] < chunks[0] / 2, chunks  # 500 tokens in: well under half the first chunk
    assert affordable_prompt_tokens(0, 0.5, k) == 0 and affordable_prompt_tokens(10**6, 1, k) == 1
    assert affordable_prompt_tokens(7, 33, None) == 33


def test_first_token_streamed_when_it_ends_the_request(tiny_llama):
    """The card's ordering invariant holds in mixed_batch too (① → ③ → ②+④): a
    one-token request admitted beside running rows has its token streamed and leaves."""
    sched = _sched(tiny_llama, "mixed_batch", max_num_batched_tokens=16)
    runner = make_request(_tokens(80, 5), max_tokens=20, ignore_eos=True)
    one = make_request(_tokens(81, 30), max_tokens=1)
    outs = run_until_idle(sched, {0: [runner], 3: [one]})
    assert len(tokens_of(outs[one.request_id])) == 1
    assert outs[one.request_id][-1].finish_reason is FinishReason.LENGTH
    assert len(tokens_of(outs[runner.request_id])) == 20
    assert sched.active_kv_reserved == 0 and sched.block_pool.num_used_blocks == 0


def test_a_failing_mixed_pass_fails_only_the_bad_row(tiny_llama):
    """A prompt that breaks the forward pass: the mixed pass is retried as separate
    passes, the bad row ends with an error, the running row keeps decoding."""
    sched = _sched(tiny_llama, "mixed_batch", max_num_batched_tokens=16)
    good = make_request(_tokens(90, 5), max_tokens=12, ignore_eos=True)
    bad = make_request(_tokens(91, 20), max_tokens=5, ignore_eos=True)
    backend = sched.backend
    inner_mixed, inner_one, inner_many = backend.mixed_step, backend.prefill_chunk, backend.prefill_chunks

    def flaky_mixed(row_ids, token_ids, positions, chunks):
        if any(c.row_id == bad.request_id for c in chunks):
            raise RuntimeError("boom")
        return inner_mixed(row_ids, token_ids, positions, chunks)

    def flaky_one(row_id, token_ids, start_pos, compute_logits):
        if row_id == bad.request_id:
            raise RuntimeError("boom")
        return inner_one(row_id, token_ids, start_pos, compute_logits)

    def flaky_many(chunks):
        if any(c.row_id == bad.request_id for c in chunks):
            raise RuntimeError("boom")
        return inner_many(chunks)

    backend.mixed_step, backend.prefill_chunk, backend.prefill_chunks = flaky_mixed, flaky_one, flaky_many
    outs = run_until_idle(sched, {0: [good], 2: [bad]})
    assert outs[bad.request_id][-1].finish_reason is FinishReason.ERROR
    assert "boom" in outs[bad.request_id][-1].error
    assert len(tokens_of(outs[good.request_id])) == 12
    assert_matches_reference(tiny_llama, good.prompt_token_ids, tokens_of(outs[good.request_id]),
                             backend.logits[good.request_id])
    assert sched.active_kv_reserved == 0 and sched.block_pool.num_used_blocks == 0


def test_mode_selection_and_refusals(tiny_llama):
    """Empty PREFILL_MODE still derives chunked from PREFILL_CHUNK_SIZE; mixed_batch
    needs the paged backend and a budget above the batch size; disaggregated is refused."""
    assert EngineConfig().resolved_prefill_mode is PrefillMode.CHUNKED
    assert EngineConfig(prefill_chunk_size=0).resolved_prefill_mode is PrefillMode.MONOLITHIC
    config = EngineConfig(prefill_mode="mixed_batch")
    assert config.problems() == []
    assert config.resolved_max_num_batched_tokens == config.max_batch_size + config.prefill_chunk_size
    assert any("backend paged" in p for p in EngineConfig(prefill_mode="mixed_batch", backend="hf").problems())
    assert any("max_num_batched_tokens" in p for p in EngineConfig(
        prefill_mode="mixed_batch", max_batch_size=32, max_num_batched_tokens=32).problems())
    sched = _sched(tiny_llama, "mixed_batch", max_num_batched_tokens=64)
    assert sched.prefill_mode is PrefillMode.MIXED_BATCH and sched.token_budget == 64
    assert sched.stats()["prefill_mode"] == "mixed_batch"
    with pytest.raises(NotImplementedError, match="mixed_batch"):
        make_scheduler(tiny_llama, backend="hf", prefill_mode="mixed_batch")
    with pytest.raises(NotImplementedError):
        make_scheduler(tiny_llama, prefill_mode="disaggregated")


def test_engine_process_serves_mixed_batch_over_http(tmp_path_factory, tiny_model_dir):
    """``--prefill-mode mixed_batch`` through the real engine and frontend processes: the
    runtime record and stats say so, and concurrent greedy completions (one prompt long
    enough to prefill over several ticks beside the others' decoding) return the token
    ids an in-process chunked scheduler computes for the same prompts."""
    import shutil
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import httpx
    from transformers import AutoModelForCausalLM

    from tests.procs import ProcessGroup, free_port, http_json, stats, wait_healthy

    prompts = [_tokens(100, 5), _tokens(101, 150), _tokens(102, 12), _tokens(103, 9)]
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))  # short: ipc paths are limited to ~100 bytes
    group = ProcessGroup(tmp_path_factory.mktemp("mixed"))
    group.engine(tiny_model_dir, run, max_batch_size=8, prefill_mode="mixed_batch", max_num_batched_tokens=24)
    port = free_port()
    group.frontend(tiny_model_dir, run, port)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(base, 120)
        except TimeoutError:
            raise AssertionError("stack did not start:\n" + "\n".join(p.output()[-3000:] for p in group.procs))
        assert httpx.get(f"{base}/version", timeout=10).json()["runtime"]["prefill_mode"] == "mixed_batch"
        assert stats(base)["max_num_batched_tokens"] == 24

        def complete(prompt):
            status, body, _ = http_json(f"{base}/v1/completions", {
                "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 1,
                "return_tokens_as_token_ids": True}, timeout=60)
            assert status == 200, body
            return [int(t.split(":", 1)[1]) for t in body["choices"][0]["logprobs"]["tokens"]]

        with ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(complete, prompts))
    finally:
        group.close()
        shutil.rmtree(run, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype="float32").eval()
    reqs = [make_request(p, max_tokens=10, ignore_eos=True) for p in prompts]
    outs = run_until_idle(make_scheduler(model, prefill_mode="chunked", prefill_chunk_size=16), {0: reqs})
    assert served == [tokens_of(outs[r.request_id]) for r in reqs]
