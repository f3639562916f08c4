"""The scheduler on a tiny random Llama: batching equivalence, the tick order, exits."""

from __future__ import annotations

import random

import pytest
import torch

from engine_proc.request import RequestStatus
from shared.protocol import FinishReason
from tests.helpers import (assert_matches_reference, make_request, make_scheduler, run_until_idle,
                           tokens_of)


def _prompts(seed: int, n: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.mark.parametrize("mode,chunk", [("monolithic", 0), ("chunked", 7)])
def test_alone_equals_generate(tiny_llama, mode, chunk):
    """Greedy tokens of a lone request are transformers' generate(do_sample=False)."""
    prompt = _prompts(1, 1)[0]
    sched = make_scheduler(tiny_llama, prefill_mode=mode, prefill_chunk_size=chunk)
    req = make_request(prompt, max_tokens=12, ignore_eos=True)
    outs = run_until_idle(sched, {0: [req]})
    with torch.inference_mode():
        ref = tiny_llama.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert tokens_of(outs[req.request_id]) == ref[0, len(prompt):].tolist()
    assert outs[req.request_id][-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("backend", ["paged", "hf"])
@pytest.mark.parametrize("mode,chunk", [("monolithic", 0), ("chunked", 5)])
def test_batched_with_joins_and_leaves_matches_alone(tiny_llama, mode, chunk, backend):
    """Eight requests of different prompt lengths join mid-stream and leave at
    different lengths; each one's tokens equal its solo run, and its logits equal the
    teacher-forced reference at every step."""
    prompts = _prompts(2, 8)
    max_tokens = [3, 17, 9, 1, 12, 6, 20, 2]
    sched = make_scheduler(tiny_llama, prefill_mode=mode, prefill_chunk_size=chunk, backend=backend)
    reqs = [make_request(pr, max_tokens=m, ignore_eos=True) for pr, m in zip(prompts, max_tokens)]
    arrivals = {0: reqs[:3], 2: reqs[3:5], 5: reqs[5:7], 9: reqs[7:]}
    outs = run_until_idle(sched, arrivals)
    assert sched.stats()["num_ticks"] > 0
    for req in reqs:
        toks = tokens_of(outs[req.request_id])
        assert len(toks) == req.params.max_tokens
        solo = make_scheduler(tiny_llama, prefill_mode=mode, prefill_chunk_size=chunk, backend=backend)
        solo_req = make_request(req.prompt_token_ids, max_tokens=req.params.max_tokens, ignore_eos=True)
        assert tokens_of(run_until_idle(solo, {0: [solo_req]})[solo_req.request_id]) == toks
        assert_matches_reference(tiny_llama, req.prompt_token_ids, toks, sched.backend.logits[req.request_id])


def test_decode_batch_holds_many_rows(tiny_llama):
    sched = make_scheduler(tiny_llama, max_batch_size=4)
    reqs = [make_request(p, max_tokens=6, ignore_eos=True) for p in _prompts(3, 6)]
    for r in reqs:
        sched.add_request(r)
    sizes = []
    while sched.has_work():
        sched.step()
        sizes.append(len(sched._active))
        sched.check_invariants()
    assert max(sizes) == 4  # never more than MAX_BATCH_SIZE, and batching happened


@pytest.mark.parametrize("backend", ["paged", "hf"])
@pytest.mark.parametrize("mode,chunk", [("monolithic", 0), ("chunked", 4)])
def test_first_token_streamed_for_one_token_request(tiny_llama, mode, chunk, backend):
    """The card's ordering invariant: a request admitted in a tick has its first token
    streamed, even when that token ends it (max_tokens=1, or a stop token)."""
    prompt = _prompts(4, 1)[0]
    sched = make_scheduler(tiny_llama, prefill_mode=mode, prefill_chunk_size=chunk, backend=backend)
    one = make_request(prompt, max_tokens=1)
    outs = run_until_idle(sched, {0: [one]})
    assert len(tokens_of(outs[one.request_id])) == 1
    assert outs[one.request_id][-1].finish_reason is FinishReason.LENGTH
    # A stop token id on the very first token.
    first = tokens_of(outs[one.request_id])[0]
    stopper = make_request(prompt, max_tokens=10, stop_token_ids=[first])
    sched2 = make_scheduler(tiny_llama, prefill_mode=mode, prefill_chunk_size=chunk, backend=backend)
    outs2 = run_until_idle(sched2, {0: [stopper]})
    assert tokens_of(outs2[stopper.request_id]) == [first]
    assert outs2[stopper.request_id][-1].finish_reason is FinishReason.STOP
    assert sched2.active_kv_reserved == 0


def test_eos_finishes_with_stop(tiny_llama):
    prompt = _prompts(5, 1)[0]
    sched = make_scheduler(tiny_llama)
    probe = make_request(prompt, max_tokens=3, ignore_eos=True)
    second = tokens_of(run_until_idle(sched, {0: [probe]})[probe.request_id])[1]
    sched.eos_token_ids = [second]
    req = make_request(prompt, max_tokens=10)
    outs = run_until_idle(sched, {0: [req]})
    assert len(tokens_of(outs[req.request_id])) == 2
    assert outs[req.request_id][-1].finish_reason is FinishReason.STOP


@pytest.mark.parametrize("where", ["pending", "prefilling", "active"])
def test_abort_from_every_queue_releases_everything(tiny_llama, where):
    sched = make_scheduler(tiny_llama, max_batch_size=1, prefill_mode="chunked", prefill_chunk_size=4)
    blocker = make_request(_prompts(6, 1)[0] * 3, max_tokens=30, ignore_eos=True)
    victim = make_request(_prompts(7, 1)[0], max_tokens=30, ignore_eos=True)
    sched.add_request(blocker if where == "pending" else victim)
    if where == "pending":
        sched.step()
        sched.add_request(victim)
    elif where == "active":
        while victim.status is not RequestStatus.RUNNING:
            sched.step()
    else:
        sched.step()
        assert victim.status is RequestStatus.PREFILLING
    assert sched.abort_request(victim.request_id)
    sched.check_invariants()
    finish = [o for _, o in sched.drain_outputs() if o.request_id == victim.request_id]
    assert finish[-1].finish_reason is FinishReason.ABORT
    assert not sched.has_request(victim.request_id)
    sched.abort_request(blocker.request_id)
    assert sched.active_kv_reserved == 0 and sched.block_pool.num_used_blocks == 0
    assert not sched.abort_request(victim.request_id)  # idempotent


def test_unimplemented_prefill_modes_fail_loud(tiny_llama):
    with pytest.raises(NotImplementedError):
        make_scheduler(tiny_llama, prefill_mode="disaggregated")
    with pytest.raises(NotImplementedError):  # mixed_batch needs a backend that mixes passes
        make_scheduler(tiny_llama, prefill_mode="mixed_batch", backend="hf")


def test_a_failing_prefill_fails_only_its_row(tiny_llama):
    sched = make_scheduler(tiny_llama, prefill_mode="chunked", prefill_chunk_size=4)
    good = make_request(_prompts(8, 1)[0], max_tokens=5, ignore_eos=True)
    bad = make_request(_prompts(9, 1)[0], max_tokens=5, ignore_eos=True)
    inner_one, inner_many = sched.backend.prefill_chunk, sched.backend.prefill_chunks

    def flaky_one(row_id, token_ids, start_pos, compute_logits):
        if row_id == bad.request_id:
            raise RuntimeError("boom")
        return inner_one(row_id, token_ids, start_pos, compute_logits)

    def flaky_many(chunks):
        if any(c.row_id == bad.request_id for c in chunks):
            raise RuntimeError("boom")
        return inner_many(chunks)

    sched.backend.prefill_chunk, sched.backend.prefill_chunks = flaky_one, flaky_many
    outs = run_until_idle(sched, {0: [good, bad]})
    assert outs[bad.request_id][-1].finish_reason is FinishReason.ERROR
    assert "boom" in outs[bad.request_id][-1].error
    assert len(tokens_of(outs[good.request_id])) == 5
    assert sched.active_kv_reserved == 0 and sched.block_pool.num_used_blocks == 0


def test_pool_sized_for_the_batch_and_capped_by_a_memory_fraction(tiny_llama):
    from engine_proc.factory import available_memory_bytes, kv_bytes_per_block

    per_block = kv_bytes_per_block(tiny_llama, 16)
    assert per_block == 2 * 2 * 2 * 16 * 16 * 4  # K+V · layers · kv_heads · head_dim · tokens · fp32
    full = 8 * (1024 // 16)  # max_batch_size rows at max_model_len (the helpers' 8 and 1024)
    assert make_scheduler(tiny_llama, record=False, kv_memory_fraction=0).block_pool.num_blocks == full
    assert make_scheduler(tiny_llama, record=False).block_pool.num_blocks == full  # the default cap is far
    fraction = 0.2 * full * per_block / available_memory_bytes(torch.device("cpu"))  # a cap of ~full/5
    capped = make_scheduler(tiny_llama, record=False, kv_memory_fraction=fraction).block_pool.num_blocks
    assert abs(capped - full // 5) <= full // 20 + 1
    assert make_scheduler(tiny_llama, record=False, kv_num_blocks=7).block_pool.num_blocks == 7


def test_first_tokens_can_stream_before_the_decode_pass(tiny_llama):
    sched = make_scheduler(tiny_llama, record=False)
    req = make_request(_prompts(10, 1)[0], max_tokens=5, ignore_eos=True)
    sched.add_request(req)
    early: list = []
    late = sched.step(stream=early.extend)
    assert [o.token_ids for _, o in early] == [req.output_token_ids[:1]]  # the prefill's token
    assert [o.token_ids for _, o in late] == [req.output_token_ids[1:2]]  # the decode step's


def test_chunked_prefill_spends_at_most_one_chunk_of_prompt_tokens_per_tick(tiny_llama):
    """The decode batch never waits for more than PREFILL_CHUNK_SIZE prompt tokens per
    tick; a row that finishes early hands the rest of the budget to the next one."""
    sched = make_scheduler(tiny_llama, prefill_mode="chunked", prefill_chunk_size=8)
    computed: list[int] = []
    inner_one, inner_many = sched.backend.prefill_chunk, sched.backend.prefill_chunks
    passes: list[int] = []

    def count_one(row_id, token_ids, start_pos, compute_logits):
        computed[-1] += len(token_ids)
        passes.append(1)
        return inner_one(row_id, token_ids, start_pos, compute_logits)

    def count_many(chunks):
        computed[-1] += sum(len(c.token_ids) for c in chunks)
        passes.append(len(chunks))
        return inner_many(chunks)

    sched.backend.prefill_chunk, sched.backend.prefill_chunks = count_one, count_many
    long = make_request(list(range(100, 120)), max_tokens=3, ignore_eos=True)  # 20 tokens: 3 ticks
    shorts = [make_request(list(range(200 + 10 * i, 203 + 10 * i)), max_tokens=3, ignore_eos=True)
              for i in range(3)]  # 3 tokens each
    for r in [long, *shorts]:
        sched.add_request(r)
    while sched.has_work():
        computed.append(0)
        sched.step()
    assert max(computed) <= 8
    # long: 8, 8, then its last 4 + short one's 3 + 1 of short two; then 2 + short three's 3
    assert computed[:4] == [8, 8, 4 + 3 + 1, 2 + 3]
    assert passes[:4] == [1, 1, 3, 2]  # one forward pass per tick, rows packed
    assert all(len(r.output_token_ids) == 3 for r in [long, *shorts])
