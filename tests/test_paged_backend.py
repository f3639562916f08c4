"""The paged backend on a tiny random Llama: equivalence with the reference forward and
the HF backend, prefix-cache hits, eviction, aborts, early stops, batching.

Block size 4 so that short prompts span many blocks. Every run checks the scheduler's
and the pool's invariants after every tick (``run_until_idle``).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_proc.backends.paged import PagedBackend
from engine_proc.backends.paged_attention import ATTN_IMPLEMENTATION, DecodeAttention
from engine_proc.request import RequestStatus
from tests.helpers import (assert_matches_reference, make_request, make_scheduler, run_until_idle,
                           tokens_of)

BS = 4
MODES = [("monolithic", 0), ("chunked", 5)]


def _tokens(seed: int, n: int, vocab: int = 49152) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _paged(model, mode="monolithic", chunk=0, **overrides):
    return make_scheduler(model, backend="paged", kv_block_size=BS, prefill_mode=mode,
                          prefill_chunk_size=chunk, **overrides)


def _run_one(sched, prompt, max_tokens=8, **params):
    """Run one request alone to completion; returns ``(request, tokens, final output)``."""
    req = make_request(prompt, max_tokens=max_tokens, ignore_eos=True, **params)
    outs = run_until_idle(sched, {0: [req]})[req.request_id]
    return req, tokens_of(outs), outs[-1]


def _check(model, sched, req, tokens):
    assert_matches_reference(model, req.prompt_token_ids, tokens, sched.backend.logits[req.request_id])


@pytest.mark.parametrize("mode,chunk", MODES)
def test_cold_run_matches_reference_and_hf(tiny_llama, mode, chunk):
    prompt = _tokens(1, 23)
    paged = _paged(tiny_llama, mode, chunk)
    req, toks, last = _run_one(paged, prompt, max_tokens=12)
    _check(tiny_llama, paged, req, toks)
    assert last.num_cached_tokens == 0
    hf = make_scheduler(tiny_llama, backend="hf", prefill_mode=mode, prefill_chunk_size=chunk)
    hf_req, hf_toks, _ = _run_one(hf, prompt, max_tokens=12)
    assert hf_toks == toks
    # The paged backend switched the shared model's attention; the HF path is unchanged.
    assert tiny_llama.config._attn_implementation == ATTN_IMPLEMENTATION
    _check(tiny_llama, hf, hf_req, hf_toks)
    diff = (torch.stack(paged.backend.logits[req.request_id]) - torch.stack(hf.backend.logits[hf_req.request_id]))
    assert diff.abs().max().item() < 1e-4


@pytest.mark.parametrize("mode,chunk", MODES)
def test_warm_run_hits_prefix_and_matches_cold(tiny_llama, mode, chunk):
    system = _tokens(2, 26)
    first = system + _tokens(3, 7)
    second = system + _tokens(4, 9)
    sched = _paged(tiny_llama, mode, chunk)
    _run_one(sched, first)
    req, toks, last = _run_one(sched, second, max_tokens=10)
    assert last.num_cached_tokens == 24  # the 6 full blocks of the shared 26 tokens
    _check(tiny_llama, sched, req, toks)
    _, cold_toks, cold_last = _run_one(_paged(tiny_llama, mode, chunk), second, max_tokens=10)
    assert cold_last.num_cached_tokens == 0 and cold_toks == toks
    # The very same prompt again: everything but the last block-or-token is cached.
    req3, toks3, last3 = _run_one(sched, second, max_tokens=10)
    assert last3.num_cached_tokens == 32 and toks3 == toks
    _check(tiny_llama, sched, req3, toks3)


def test_prefix_caching_off_never_hits(tiny_llama):
    prompt = _tokens(8, 21)
    sched = _paged(tiny_llama, "chunked", 5, prefix_caching=False)
    _, first, _ = _run_one(sched, prompt)
    req, again, last = _run_one(sched, prompt)
    assert last.num_cached_tokens == 0 and again == first
    assert sched.block_pool.stats()["num_cached_blocks"] == 0
    _check(tiny_llama, sched, req, again)


def test_prefix_hit_at_every_chunk_alignment(tiny_llama):
    """Chunks that start mid-block right after a cache hit, and a hit that leaves one token."""
    system = _tokens(5, 16)
    sched = _paged(tiny_llama, "chunked", 3)
    _run_one(sched, system + [7])
    for extra in (1, 2, 5, 11):
        prompt = system + _tokens(6 + extra, extra)
        req, toks, last = _run_one(sched, prompt, max_tokens=5)
        assert last.num_cached_tokens == 16
        _check(tiny_llama, sched, req, toks)


@pytest.mark.parametrize("mode,chunk", MODES)
def test_after_prefix_blocks_were_evicted(tiny_llama, mode, chunk):
    """A small pool: other requests take the free cached blocks, evicting the prefix."""
    system = _tokens(10, 24)
    sched = _paged(tiny_llama, mode, chunk, kv_num_blocks=16, max_batch_size=2)
    _run_one(sched, system + [5])  # 25 + 8 tokens: 8 blocks, all full once written
    assert sched.block_pool.num_cached_free_blocks == 8
    for seed in (11, 12):  # 13 tokens + 8 → 6 blocks each, from the free-queue front
        _run_one(sched, _tokens(seed, 13))
    assert sched.block_pool.stats()["num_evictions"] > 0
    prompt = system + _tokens(13, 6)
    req, toks, last = _run_one(sched, prompt)
    assert 0 <= last.num_cached_tokens < 24  # the tail of the prefix (at least) is gone
    _check(tiny_llama, sched, req, toks)
    _, cold_toks, _ = _run_one(_paged(tiny_llama, mode, chunk), prompt)
    assert toks == cold_toks


@pytest.mark.parametrize("warm", [False, True])
def test_after_sharing_request_aborted_mid_prefill(tiny_llama, warm):
    """An aborted prefill keeps what it fully wrote: blocks are committed chunk by
    chunk, so a later request sharing the prefix hits exactly the full blocks written
    before the abort (or the warm-up's), never the half-written one, and its tokens and
    logits still match the reference."""
    system = _tokens(20, 30)
    sched = _paged(tiny_llama, "chunked", 4)
    if warm:
        _run_one(sched, system[:13])  # commits 3 blocks
    victim = make_request(system + _tokens(21, 5), max_tokens=8, ignore_eos=True)
    sched.add_request(victim)
    for _ in range(3):
        sched.step()
        sched.check_invariants()
    assert victim.status is RequestStatus.PREFILLING and victim.num_computed_tokens < victim.prompt_len
    written = victim.num_computed_tokens
    assert sched.abort_request(victim.request_id)
    sched.check_invariants()
    assert sched.block_pool.num_used_blocks == 0
    req, toks, last = _run_one(sched, system + _tokens(22, 3))
    assert last.num_cached_tokens == max(12 if warm else 0, min(written // BS * BS, len(system) // BS * BS))
    _check(tiny_llama, sched, req, toks)


@pytest.mark.parametrize("mode,chunk", MODES)
def test_after_warm_up_that_stopped_inside_a_block(tiny_llama, mode, chunk):
    """A warm-up stops on a stop token mid-block. Its full blocks, generated ones
    included, are reusable; its partial last block is not, and the next turn (prompt =
    warm-up prompt + its output + more) still matches the reference."""
    prompt = _tokens(30, 10)  # 2 full blocks + 2 tokens
    sched = _paged(tiny_llama, mode, chunk)
    _, probe, _ = _run_one(sched, prompt, max_tokens=12)
    stop_at = next(i for i in range(7, 12) if (len(prompt) + i) % BS not in (0, 1)
                   and probe[i] not in probe[:i])
    warm_req, warm, warm_last = _run_one(sched, prompt, max_tokens=20, stop_token_ids=[probe[stop_at]])
    assert warm == probe[: stop_at + 1] and warm_last.finish_reason.value == "stop"
    # KV was written for prompt + warm[:-1]; only its full blocks can be hit.
    written = len(prompt) + len(warm) - 1
    follow = prompt + warm + _tokens(31, 6)
    req, toks, last = _run_one(sched, follow)
    assert last.num_cached_tokens == written // BS * BS
    assert last.num_cached_tokens > len(prompt)  # generated text was reused
    _check(tiny_llama, sched, req, toks)
    _, cold, _ = _run_one(_paged(tiny_llama, mode, chunk), follow)
    assert toks == cold


@pytest.mark.parametrize("mode,chunk,kernel", [("monolithic", 0, DecodeAttention.PER_ROW),
                                               ("chunked", 5, DecodeAttention.PER_ROW),
                                               ("chunked", 5, DecodeAttention.BATCHED)])
def test_batched_with_joins_and_leaves_and_shared_prefixes(tiny_llama, mode, chunk, kernel):
    """Requests of different lengths, half sharing a system prompt, join mid-stream and
    leave at different lengths: each equals its solo run, on hf too, and its logits the
    teacher-forced reference at every step. Both decode kernels (CPU picks PER_ROW)."""
    system = _tokens(40, 18)
    prompts = [(system if i % 2 else []) + _tokens(41 + i, 3 + 5 * i) for i in range(8)]
    max_tokens = [3, 17, 9, 1, 12, 6, 20, 2]
    sched = _paged(tiny_llama, mode, chunk)
    sched.backend.inner.decode_attention = kernel
    reqs = [make_request(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, max_tokens)]
    outs = run_until_idle(sched, {0: reqs[:3], 2: reqs[3:5], 5: reqs[5:7], 9: reqs[7:]})
    assert any(outs[r.request_id][-1].num_cached_tokens > 0 for r in reqs)
    hf = make_scheduler(tiny_llama, backend="hf", prefill_mode=mode, prefill_chunk_size=chunk)
    hf_reqs = [make_request(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, max_tokens)]
    hf_outs = run_until_idle(hf, {0: hf_reqs[:3], 2: hf_reqs[3:5], 5: hf_reqs[5:7], 9: hf_reqs[7:]})
    for req, hf_req in zip(reqs, hf_reqs):
        toks = tokens_of(outs[req.request_id])
        assert len(toks) == req.params.max_tokens
        _check(tiny_llama, sched, req, toks)
        assert tokens_of(hf_outs[hf_req.request_id]) == toks
        _, solo, _ = _run_one(_paged(tiny_llama, mode, chunk), req.prompt_token_ids, req.params.max_tokens)
        assert solo == toks


def test_random_mix_of_finishes_aborts_and_shared_prefixes(tiny_llama):
    """Random arrivals sharing a few prefixes, random aborts, a small pool: every
    finished request matches the reference; nothing leaks."""
    rng = random.Random(7)
    prefixes = [_tokens(50 + i, rng.randint(4, 20)) for i in range(3)]
    sched = _paged(tiny_llama, "chunked", 6, kv_num_blocks=40, max_batch_size=4)
    reqs = []
    for tick in range(60):
        if rng.random() < 0.4:
            prompt = rng.choice(prefixes) + _tokens(rng.randrange(10**6), rng.randint(1, 9))
            req = make_request(prompt, max_tokens=rng.randint(1, 10), ignore_eos=True)
            reqs.append(req)
            sched.add_request(req)
        live = [r for r in reqs if sched.has_request(r.request_id)]
        if live and rng.random() < 0.1:
            sched.abort_request(rng.choice(live).request_id)
        sched.step()
        sched.check_invariants()
    run_until_idle(sched)
    assert sched.block_pool.num_used_blocks == 0 and sched.active_kv_reserved == 0
    finished = [r for r in reqs if r.status is RequestStatus.FINISHED_LENGTH]
    assert len(finished) > 5 and any(r.num_cached_tokens for r in finished)
    for req in finished:
        _check(tiny_llama, sched, req, req.output_token_ids)


def test_backend_contract_errors_and_kv_length(tiny_llama):
    sched = _paged(tiny_llama, max_model_len=64)
    backend: PagedBackend = sched.backend.inner
    pool = sched.block_pool
    pool.allocate("a", [], 20)
    pool.allocate("b", [], 20)
    with pytest.raises(ValueError):
        backend.prefill_chunk("a", [5, 6], 3, False)  # KV holds 0 tokens
    backend.prefill_chunk("a", [5, 6, 7], 0, False)
    backend.prefill_chunk("b", [5, 6, 7, 8, 9, 10], 0, True)
    backend.promote("a")
    backend.promote("b")
    assert backend.kv_length() == 6
    with pytest.raises(ValueError):
        backend.decode_step_batched(["b", "a"], [1, 1], [6, 3])  # order differs
    with pytest.raises(ValueError):
        backend.decode_step_batched(["a", "b"], [1, 1], [4, 6])  # a's KV holds 3
    logits = backend.decode_step_batched(["a", "b"], [1, 1], [3, 6])
    assert logits.shape == (2, tiny_llama.config.vocab_size)
    assert backend.kv_length() == 7 and backend.seq_len("a") == 4
    backend.release("b")
    backend.release("b")  # idempotent
    assert backend.kv_length() == 4 and backend.num_decode_rows == 1
    backend.release("a")
    assert backend.kv_length() == 0


def test_refuses_models_it_would_get_wrong():
    from transformers import MistralConfig, MistralForCausalLM

    from engine_proc.block_pool import BlockPool

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=16)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        PagedBackend(MistralForCausalLM(config).eval(), 64, BlockPool(8, BS))


@pytest.mark.parametrize("mode,chunk", MODES)
def test_same_tick_arrivals_share_the_prefill(tiny_llama, mode, chunk):
    """Requests sharing a prompt that arrive together (``n`` samples, a burst behind one
    system prompt) compute it once: each later row picks up the blocks the first one
    committed, and every row still matches the reference."""
    system = _tokens(40, 26)
    sched = _paged(tiny_llama, mode, chunk)
    reqs = [make_request(system + _tokens(41 + i, 2), max_tokens=5, ignore_eos=True) for i in range(3)]
    outs = run_until_idle(sched, {0: reqs})
    cached = [outs[r.request_id][-1].num_cached_tokens for r in reqs]
    assert cached[0] == 0 and cached[1] == cached[2] == len(system) // BS * BS
    for r in reqs:
        _check(tiny_llama, sched, r, tokens_of(outs[r.request_id]))


def test_packed_prefill_of_many_rows_matches_reference(tiny_llama):
    """Six prompts (two continuing after a prefix hit) prefilled in one packed forward
    pass give the same logits as the reference, and as one-by-one prefill."""
    sched = _paged(tiny_llama, "chunked", 64)
    shared = _tokens(50, 9)
    _run_one(sched, shared + [7], max_tokens=2)  # warm: 2 blocks of `shared` cached
    reqs = [make_request(p, max_tokens=4, ignore_eos=True) for p in
            [_tokens(51, 5), _tokens(52, 11), shared + _tokens(53, 3), _tokens(54, 2), shared + [9], _tokens(55, 7)]]
    passes = []
    inner = sched.backend.prefill_chunks
    sched.backend.prefill_chunks = lambda chunks: passes.append(len(chunks)) or inner(chunks)
    outs = run_until_idle(sched, {0: reqs})
    assert passes == [6]
    assert [outs[r.request_id][-1].num_cached_tokens for r in reqs] == [0, 0, 8, 0, 8, 0]
    hf = make_scheduler(tiny_llama, backend="hf", prefill_mode="chunked", prefill_chunk_size=64)
    for r in reqs:
        toks = tokens_of(outs[r.request_id])
        _check(tiny_llama, sched, r, toks)
        solo = make_request(r.prompt_token_ids, max_tokens=4, ignore_eos=True)
        assert tokens_of(run_until_idle(hf, {0: [solo]})[solo.request_id]) == toks
