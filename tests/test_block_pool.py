"""Exact block ids and eviction order for the paged KV block pool (CPU, milliseconds).

Run: .venv/bin/python -m pytest tests/test_block_pool.py -q
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_proc.block_pool import BlockPool, NoFreeBlocks, PrefixMatch
from engine_proc.prefix_hash import hash_block_tokens

BS = 4


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def snapshot(pool: BlockPool) -> dict:
    return copy.deepcopy(vars(pool))


def free_queue(pool: BlockPool) -> list[int]:
    return list(pool._free)


def test_fresh_ids_in_order_and_free_pushes_tail_first():
    pool = BlockPool(10, BS, enable_prefix_caching=False)
    assert pool.allocate("a", toks(0, 10), 10) == [0, 1, 2]
    assert pool.allocate("b", toks(0, 5), 5) == [3, 4]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.usage) == (5, 5, 0.5)
    pool.free("a")
    assert free_queue(pool) == [5, 6, 7, 8, 9, 2, 1, 0]
    assert pool.allocate("c", toks(0, 24), 24) == [5, 6, 7, 8, 9, 2]
    assert pool.num_cached_tokens("c") == 0
    pool.check_invariants()


def test_empty_row_and_idempotent_free():
    pool = BlockPool(4, BS)
    assert pool.allocate("a", [], 0) == []
    assert "a" in pool and pool.block_table("a") == []
    pool.free("a")
    pool.free("a")
    pool.free("never-seen")
    assert "a" not in pool
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_blocks_needed():
    pool = BlockPool(8, BS)
    assert [pool.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert pool.blocks_needed(9, 8) == 1
    assert pool.blocks_needed(8, 8) == 0
    with pytest.raises(ValueError):
        pool.blocks_needed(9, 3)
    assert pool.can_allocate(8) and not pool.can_allocate(9)


def test_prefix_hit_shares_blocks_with_refcount_two():
    pool = BlockPool(10, BS)
    prompt = toks(100, 10)
    assert pool.allocate("a", prompt, 10) == [0, 1, 2]
    assert pool.match_prefix(prompt) == PrefixMatch([], 0, 0)  # nothing committed yet
    pool.commit_full_blocks("a", prompt)
    assert pool.match_prefix(prompt) == PrefixMatch([0, 1], 8, 0)
    assert pool.allocate("b", prompt, 10) == [0, 1, 3]
    assert pool.num_cached_tokens("b") == 8
    assert [pool.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert pool.num_used_blocks == 4
    stats = pool.stats()
    assert (stats["prefix_query_tokens"], stats["prefix_hit_tokens"]) == (20, 8)
    assert "kv_pressure" not in stats  # once, at the top of /scheduler/stats
    pool.check_invariants()


def test_partial_last_block_never_hashed_or_shared():
    pool = BlockPool(10, BS)
    prompt = toks(100, 10)
    pool.allocate("a", prompt, 10)
    pool.commit_full_blocks("a", prompt)
    assert pool.stats()["num_cached_blocks"] == 2
    longer = prompt + toks(500, 4)  # first 10 tokens identical; block 2 differs after token 10
    assert pool.match_prefix(longer).block_ids == [0, 1]
    pool.free("a")
    assert pool.num_cached_free_blocks == 2  # block 2 is free but holds no hash
    pool.check_invariants()


def test_match_never_covers_entire_prompt():
    pool = BlockPool(10, BS)
    prompt = toks(100, 8)  # exactly two full blocks
    pool.allocate("a", prompt, 8)
    pool.commit_full_blocks("a", prompt)
    assert pool.match_prefix(prompt) == PrefixMatch([0], 4, 0)
    assert pool.match_prefix(prompt + [7]) == PrefixMatch([0, 1], 8, 0)
    assert pool.match_prefix(prompt[:4]).block_ids == []
    assert pool.match_prefix([]).block_ids == []
    assert pool.allocate("b", prompt, 8) == [0, 2]  # last block recomputed
    assert pool.num_cached_tokens("b") == 4


def test_match_prefix_is_pure():
    pool = BlockPool(6, BS)
    prompt = toks(0, 9)
    pool.allocate("a", prompt, 9)
    pool.commit_full_blocks("a", prompt)
    pool.free("a")
    before = snapshot(pool)
    assert pool.match_prefix(prompt) == PrefixMatch([0, 1], 8, 2)
    assert snapshot(pool) == before


def test_freed_cached_blocks_reused_by_identical_prompt():
    pool = BlockPool(8, BS)
    prompt = toks(100, 13)
    assert pool.allocate("a", prompt, 13) == [0, 1, 2, 3]
    pool.commit_full_blocks("a", prompt)
    pool.free("a")
    assert pool.num_free_blocks == 8
    assert pool.num_cached_free_blocks == 3
    assert free_queue(pool) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert pool.match_prefix(prompt).num_evictable_blocks == 3
    assert pool.allocate("b", prompt, 13) == [0, 1, 2, 4]
    assert pool.num_cached_tokens("b") == 12
    assert pool.num_cached_free_blocks == 0
    assert free_queue(pool) == [5, 6, 7, 3]
    assert pool.stats()["num_evictions"] == 0
    pool.check_invariants()


def test_eviction_order_lru_tail_before_head():
    pool = BlockPool(6, BS)
    p1, p2 = toks(100, 12), toks(200, 12)
    assert pool.allocate("a", p1, 12) == [0, 1, 2]
    pool.commit_full_blocks("a", p1)
    assert pool.allocate("b", p2, 12) == [3, 4, 5]
    pool.commit_full_blocks("b", p2)
    pool.free("a")
    pool.free("b")
    assert free_queue(pool) == [2, 1, 0, 5, 4, 3]
    q1, q2 = p1 + [9], p2 + [9]
    assert pool.match_prefix(q1).block_ids == [0, 1, 2]

    assert pool.allocate("c", toks(900, 4), 4) == [2]  # a's tail: least recently freed
    assert pool.match_prefix(q1).block_ids == [0, 1]
    assert pool.allocate("d", toks(950, 8), 8) == [1, 0]  # then a's head
    assert pool.match_prefix(q1).block_ids == []
    assert pool.match_prefix(q2).block_ids == [3, 4, 5]  # b, freed later, survives
    assert pool.stats()["num_evictions"] == 3
    pool.free("c")
    assert free_queue(pool) == [5, 4, 3, 2]  # freed blocks go to the tail
    pool.check_invariants()


def test_no_free_blocks_leaves_pool_unchanged():
    pool = BlockPool(5, BS)
    pool.allocate("a", toks(0, 8), 8)
    before = snapshot(pool)
    with pytest.raises(NoFreeBlocks) as exc:
        pool.allocate("b", toks(50, 13), 13)
    assert (exc.value.needed, exc.value.available) == (4, 3)
    assert snapshot(pool) == before
    with pytest.raises(NoFreeBlocks):
        pool.append_slots("a", 13)  # 21 slots -> 6 blocks, 4 more
    assert snapshot(pool) == before
    assert pool.append_slots("a", 12) == [2, 3, 4]
    pool.check_invariants()


def test_evictable_hits_count_against_free_blocks():
    pool = BlockPool(5, BS)
    prompt = toks(100, 13)
    assert pool.allocate("a", prompt, 13) == [0, 1, 2, 3]
    pool.commit_full_blocks("a", prompt)
    pool.free("a")
    assert pool.allocate("x", toks(900, 4), 4) == [4]
    # 3 cached free hits + 2 fresh = 5 > 4 free: must refuse rather than evict its own hits.
    m = pool.match_prefix(prompt)
    assert (m.block_ids, m.num_evictable_blocks) == ([0, 1, 2], 3)
    fresh = pool.blocks_needed(17, m.num_tokens)
    assert fresh == 2 and not pool.can_allocate(fresh + m.num_evictable_blocks)
    before = snapshot(pool)
    with pytest.raises(NoFreeBlocks):
        pool.allocate("b", prompt, 17)
    assert snapshot(pool) == before
    # 3 hits + 1 fresh = 4 fits exactly; the fresh one is a's unhashed tail block.
    assert pool.can_allocate(pool.blocks_needed(13, 12) + 3)
    assert pool.allocate("b", prompt, 13) == [0, 1, 2, 3]
    assert pool.num_free_blocks == 0
    pool.check_invariants()


def test_append_slots_crossing_block_boundary():
    pool = BlockPool(8, BS)
    assert pool.allocate("a", toks(0, 3), 3) == [0]
    assert pool.append_slots("a", 1) == []  # slot 3 still in block 0
    assert pool.append_slots("a", 1) == [1]  # slot 4 opens block 1
    assert pool.append_slots("a", 0) == []
    assert pool.append_slots("a", 9) == [2, 3]  # slots 5..13
    assert pool.block_table("a") == [0, 1, 2, 3]
    assert pool.num_slots("a") == 14
    with pytest.raises(KeyError):
        pool.append_slots("nope", 1)
    pool.check_invariants()


def test_decode_commit_makes_generated_blocks_hittable():
    pool = BlockPool(8, BS)
    seq = toks(100, 6)
    pool.allocate("a", seq, 6)
    pool.commit_full_blocks("a", seq)
    for t in range(6):  # decode: one slot, then the token's KV is written
        pool.append_slots("a", 1)
        seq.append(t)
        pool.commit_full_blocks("a", seq)
    assert pool.block_table("a") == [0, 1, 2]
    with pytest.raises(ValueError):
        pool.commit_full_blocks("a", seq + [1])  # more tokens than slots
    assert pool.match_prefix(seq + [0]).block_ids == [0, 1, 2]


def test_concurrent_duplicate_keeps_first_mapping():
    pool = BlockPool(8, BS)
    prompt = toks(100, 9)
    assert pool.allocate("a", prompt, 9) == [0, 1, 2]
    assert pool.allocate("b", prompt, 9) == [3, 4, 5]  # miss: nothing committed yet
    pool.commit_full_blocks("a", prompt)
    pool.commit_full_blocks("b", prompt)
    assert pool.stats()["num_cached_blocks"] == 2
    assert pool.match_prefix(prompt).block_ids == [0, 1]
    pool.free("a")
    pool.free("b")
    assert pool.num_cached_free_blocks == 2
    pool.check_invariants()


def test_prefix_caching_disabled():
    pool = BlockPool(8, BS, enable_prefix_caching=False)
    prompt = toks(100, 9)
    pool.allocate("a", prompt, 9)
    pool.commit_full_blocks("a", prompt)
    assert pool.match_prefix(prompt).block_ids == []
    assert pool.allocate("b", prompt, 9) == [3, 4, 5]
    assert pool.stats()["num_cached_blocks"] == 0
    pool.check_invariants()


def test_reset_prefix_cache_with_live_rows():
    pool = BlockPool(8, BS)
    prompt = toks(100, 9)
    pool.allocate("a", prompt, 9)
    pool.commit_full_blocks("a", prompt)
    pool.allocate("b", toks(0, 4), 4)
    pool.commit_full_blocks("b", toks(0, 4))
    pool.free("b")
    assert pool.reset_prefix_cache() == 3
    assert pool.num_cached_free_blocks == 0
    assert pool.match_prefix(prompt).block_ids == []
    pool.check_invariants()
    seq = prompt + [1, 2, 3]  # a keeps its chain: block 2 hashes after its real parents
    pool.append_slots("a", 3)
    pool.commit_full_blocks("a", seq)
    assert pool.stats()["num_cached_blocks"] == 1
    assert pool.match_prefix(seq + [0]).block_ids == []  # head was dropped; chain broken
    pool.check_invariants()


def test_errors():
    with pytest.raises(ValueError):
        BlockPool(0, BS)
    pool = BlockPool(4, BS)
    pool.allocate("a", [], 1)
    with pytest.raises(ValueError):
        pool.allocate("a", [], 1)
    with pytest.raises(ValueError):
        pool.allocate("b", [], -1)
    with pytest.raises(KeyError):
        pool.block_table("b")
    with pytest.raises(KeyError):
        pool.commit_full_blocks("b", [])


def test_hash_is_deterministic_and_chained():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, (1, 2, 3, 4)) and len(h0) == 32
    assert hash_block_tokens(h0, [5, 6, 7, 8]) == hash_block_tokens(h0, [5, 6, 7, 8])
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 4, 3])


def test_check_invariants_catches_corruption():
    pool = BlockPool(4, BS)
    pool.allocate("a", toks(0, 4), 4)
    pool.check_invariants()
    pool._ref_cnt[0] += 1
    with pytest.raises(AssertionError):
        pool.check_invariants()


NUM_BLOCKS = 16
BASES = [tuple(range(14)), tuple(range(7)) + tuple(range(50, 57)), tuple([3] * 14)]  # shared heads


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / append / commit / free against a shadow KV store.

    Each block id is backed by ``kv[block][offset]``; a row "writes" its tokens where its
    table points. Every reused prefix block must already hold the row's tokens, and no
    row's written tokens may be clobbered by another row, which catches a block handed
    out twice or a wrong prefix hit, not only bookkeeping slips.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BS)
        self.kv: dict[int, list[int | None]] = {b: [None] * BS for b in range(NUM_BLOCKS)}
        self.rows: dict[str, tuple[list[int], int]] = {}  # row -> (tokens, num written)
        self.next_id = 0

    def _write(self, row_id: str, start: int, tokens: list[int]) -> None:
        table = self.pool.block_table(row_id)
        for p in range(start, len(tokens)):
            self.kv[table[p // BS]][p % BS] = tokens[p]

    def _pick(self, idx: int) -> str:
        return sorted(self.rows)[idx % len(self.rows)]

    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(0, 14),
        suffix=st.lists(st.integers(0, 2), max_size=5),
        reserve=st.integers(0, 3),
        prefill_done=st.booleans(),
    )
    def allocate(self, base: tuple[int, ...], cut: int, suffix: list[int], reserve: int, prefill_done: bool) -> None:
        prompt = list(base[:cut]) + suffix
        if not prompt:
            return
        row_id = f"r{self.next_id}"
        self.next_id += 1
        m = self.pool.match_prefix(prompt)
        num_tokens = len(prompt) + reserve
        fits = self.pool.can_allocate(self.pool.blocks_needed(num_tokens, m.num_tokens) + m.num_evictable_blocks)
        before = snapshot(self.pool)
        try:
            table = self.pool.allocate(row_id, prompt, num_tokens)
        except NoFreeBlocks:
            assert not fits
            assert snapshot(self.pool) == before
            return
        assert fits
        assert len(table) == self.pool.blocks_needed(num_tokens)
        cached = self.pool.num_cached_tokens(row_id)
        assert cached == m.num_tokens and table[: len(m.block_ids)] == m.block_ids
        assert cached < len(prompt)
        for p in range(cached):  # reused KV must be exactly this prompt's
            assert self.kv[table[p // BS]][p % BS] == prompt[p]
        self._write(row_id, cached, prompt)
        self.rows[row_id] = (list(prompt), len(prompt))
        if prefill_done:
            self.pool.commit_full_blocks(row_id, prompt)

    @precondition(lambda self: self.rows)
    @rule(idx=st.integers(0, 99), n=st.integers(0, 6))
    def append(self, idx: int, n: int) -> None:
        row_id = self._pick(idx)
        tokens, written = self.rows[row_id]
        before = snapshot(self.pool)
        try:
            self.pool.append_slots(row_id, n)
        except NoFreeBlocks:
            assert snapshot(self.pool) == before
            return
        new_slots = self.pool.num_slots(row_id)
        tokens = tokens[:written] + [(written + i) % 3 for i in range(new_slots - written)]
        self._write(row_id, written, tokens)
        self.rows[row_id] = (tokens, new_slots)

    @precondition(lambda self: self.rows)
    @rule(idx=st.integers(0, 99), cut=st.integers(0, 99))
    def commit(self, idx: int, cut: int) -> None:
        row_id = self._pick(idx)
        tokens, written = self.rows[row_id]
        self.pool.commit_full_blocks(row_id, tokens[: cut % (written + 1)])

    @precondition(lambda self: self.rows)
    @rule(idx=st.integers(0, 99))
    def free(self, idx: int) -> None:
        row_id = self._pick(idx)
        self.pool.free(row_id)
        self.pool.free(row_id)  # idempotent
        del self.rows[row_id]

    @invariant()
    def consistent(self) -> None:
        self.pool.check_invariants()
        for row_id, (tokens, written) in self.rows.items():
            table = self.pool.block_table(row_id)
            for p in range(written):
                assert self.kv[table[p // BS]][p % BS] == tokens[p], (row_id, p)

    def teardown(self) -> None:
        for row_id in list(self.rows):
            self.pool.free(row_id)
        self.pool.check_invariants()
        assert self.pool.num_free_blocks == NUM_BLOCKS and self.pool.num_used_blocks == 0
        assert self.pool.usage == 0.0


BlockPoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_pool_state_machine = BlockPoolMachine.TestCase


def test_extend_prefix_hit_swaps_unwritten_blocks_for_newly_cached_ones():
    pool = BlockPool(num_blocks=10, block_size=4)
    prompt = list(range(100, 111))  # 2 full blocks + 3 tokens
    first = pool.allocate("a", prompt, 12)
    second = pool.allocate("b", prompt, 12)  # same tick: nothing cached yet
    assert pool.num_cached_tokens("b") == 0 and set(first).isdisjoint(second)
    pool.commit_full_blocks("a", prompt)  # a's prefill wrote its prompt
    assert pool.extend_prefix_hit("b", prompt) == 8
    assert pool.block_table("b")[:2] == first[:2] and pool.num_cached_tokens("b") == 8
    assert pool.ref_count(first[0]) == 2
    assert pool.extend_prefix_hit("b", prompt) == 0  # idempotent
    pool.check_invariants()
    assert pool.num_used_blocks == 4  # b's two replaced blocks went back to the pool
    pool.free("a")
    pool.free("b")
    pool.check_invariants()
    assert pool.num_free_blocks == 10


def test_allocate_with_a_fresh_match_equals_allocate_without():
    """Passing match_prefix's result to allocate (the scheduler's admit path) reuses the
    same blocks as letting allocate look the prefix up itself."""
    tables = []
    for reuse in (False, True):
        pool = BlockPool(num_blocks=12, block_size=4)
        prompt = list(range(50, 63))
        pool.allocate("warm", prompt, 13)
        pool.commit_full_blocks("warm", prompt)
        pool.free("warm")
        match = pool.match_prefix(prompt)
        tables.append(pool.allocate("r", prompt, 16, match if reuse else None))
        assert pool.num_cached_tokens("r") == 12
        pool.check_invariants()
    assert tables[0] == tables[1]
