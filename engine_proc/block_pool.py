"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, prefix hashing, LRU reuse.

Pure Python, no torch. The paged attention backend owns the K/V tensors, shaped
``[num_blocks, block_size, ...]``; this module only decides *which* block ids each row
(request) uses. Token slot ``s`` of a row lives in block ``table[s // block_size]`` at
offset ``s % block_size``::

    block_size = 4, a 10-token prompt, then 2 decode slots appended

    token slot   0  1  2  3 | 4  5  6  7 | 8  9 10 11
    block table [     7     ,     3      ,     12     ]
                  full       full         partial: never hashed, never shared
                  hash h0    hash h1 = H(h0, tokens 4..7)

Units: ``num_tokens`` / ``num_*_tokens`` arguments count token slots; ``num_blocks`` counts
blocks; ``blocks_needed`` converts. Block ids are ints ``0 .. num_blocks - 1``.

Lifecycle of a block::

    free (refcount 0, no hash) --allocate--> used --commit_full_blocks--> used + hashed
        ^                                                                   | free(row)
        |  evicted: taken from the free-queue front,                        v
        +------------- hash dropped <--------------  free + hashed (refcount 0, still
                                                      findable by match_prefix)

Prefix caching (Ref: vLLM v1 "automatic prefix caching" design): a full block's hash
(:mod:`engine_proc.prefix_hash`) names the whole prefix up to and including that block, and
"how much of this prompt is cached" is a walk down the chain until the first miss.

Gate 3 (scheduler card, Backpressure) with this pool::

    m = pool.match_prefix(prompt_ids)
    fresh = pool.blocks_needed(num_tokens, m.num_tokens)
    if pool.blocks_needed(num_tokens) > pool.num_blocks:      -> hard-reject
    elif not pool.can_allocate(fresh + m.num_evictable_blocks): -> soft-hold
    else: pool.allocate(row_id, prompt_ids, num_tokens)         (cannot raise now)

``m.num_evictable_blocks`` matters: a cache hit on a *free* cached block takes that block
out of the free queue, so it costs a free block just like a fresh one does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine_proc.prefix_hash import BlockHash, hash_block_tokens, match_chain

def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


class NoFreeBlocks(RuntimeError):
    """Not enough free blocks (counting evictable cached ones). The pool is unchanged."""

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"need {needed} free KV blocks, only {available} available")
        self.needed = needed
        self.available = available


@dataclass(frozen=True)
class PrefixMatch:
    """Result of ``BlockPool.match_prefix``.

    ``block_ids``: the cached blocks covering the prompt's leading full blocks, in order.
    ``num_tokens``: tokens they cover, ``len(block_ids) * block_size``.
    ``num_evictable_blocks``: how many of ``block_ids`` currently sit in the free queue
    (refcount 0); reusing them consumes that many free blocks.
    """

    block_ids: list[int]
    num_tokens: int
    num_evictable_blocks: int = 0
    hashes: list[BlockHash] = field(default_factory=list, compare=False, repr=False)  # their chain


@dataclass
class _Row:
    block_ids: list[int]
    num_slots: int  # token slots the table covers; len(block_ids) == cdiv(num_slots, bs)
    num_cached_tokens: int  # reused from the prefix cache at allocate time
    hashes: list[BlockHash] = field(default_factory=list)  # chain of the committed blocks


class BlockPool:
    """Block allocator for a paged KV cache, with per-row block tables keyed by ``row_id``.

    Free queue (LRU, evict from the front): blocks with refcount 0 in the order they were
    freed; allocation takes from the front whether or not the block still holds a cached
    hash (like vLLM v1, no preference for unhashed blocks). ``free(row)`` pushes the row's
    blocks in *reverse* table order, so a sequence's tail is evicted before its head: a
    later request can only hit a prefix, and the head is the part most widely shared.
    A freed hashed block stays findable by ``match_prefix`` until it is taken again.

    A block gets a hash only when it is full of tokens whose KV has been written
    (``commit_full_blocks``) and prefix caching is on. At most one block per hash is
    registered; a row that computed a duplicate keeps its block unhashed.

    Not thread-safe: the tick thread owns it (under the backend lock).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_cnt = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # hash -> the one block registered for it
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._num_cached_free = 0
        self._rows: dict[str, _Row] = {}
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._num_evictions = 0

    # ------------------------------------------------------------------ queries

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached chain of full blocks at the start of ``token_ids``.

        Never covers the whole prompt: at most ``(len(token_ids) - 1) // block_size`` blocks,
        so at least one token is left to compute (the model needs the last token's logits).
        Pure: changes no refcount, queue or statistic (the scheduler may re-ask every tick
        while a request is soft-held; hits are counted once, by ``allocate``).
        """
        ids, hashes = self._match(token_ids, self._max_hit_blocks(token_ids))
        evictable = sum(1 for b in ids if self._ref_cnt[b] == 0)
        return PrefixMatch(ids, len(ids) * self.block_size, evictable, hashes)

    def blocks_needed(self, num_tokens: int, num_cached_tokens: int = 0) -> int:
        """Fresh blocks to cover ``num_tokens`` token slots when the first
        ``num_cached_tokens`` (a multiple of ``block_size``) come from cached blocks."""
        if num_cached_tokens % self.block_size:
            raise ValueError(f"num_cached_tokens {num_cached_tokens} is not block aligned")
        return max(0, cdiv(num_tokens, self.block_size) - num_cached_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """True if ``num_blocks`` blocks can be taken now (free ones, cached or not)."""
        return num_blocks <= len(self._free)

    def block_table(self, row_id: str) -> list[int]:
        """Copy of the row's block table. KeyError for an unknown row."""
        return list(self._rows[row_id].block_ids)

    def num_cached_tokens(self, row_id: str) -> int:
        """Leading tokens of the row whose KV came from the prefix cache (skip computing
        them). KeyError for an unknown row."""
        return self._rows[row_id].num_cached_tokens

    def num_slots(self, row_id: str) -> int:
        """Token slots the row's table covers. KeyError for an unknown row."""
        return self._rows[row_id].num_slots

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def __contains__(self, row_id: object) -> bool:
        return row_id in self._rows

    @property
    def num_free_blocks(self) -> int:
        """Blocks with refcount 0, including cached (evictable) ones."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with refcount > 0."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a hash (reusable by a prefix hit until evicted)."""
        return self._num_cached_free

    @property
    def usage(self) -> float:
        """``used / total`` blocks, in [0, 1]: the card's ``kv_pressure``."""
        return self.num_used_blocks / self.num_blocks

    def stats(self) -> dict:
        """Counters and gauges for /scheduler/stats. Prefix counters are in tokens,
        counted once per successful ``allocate``."""
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_free_blocks": self.num_free_blocks,
            "num_used_blocks": self.num_used_blocks,
            "num_cached_free_blocks": self._num_cached_free,
            "num_cached_blocks": len(self._cached),
            "num_rows": len(self._rows),
            "prefix_query_tokens": self._prefix_queries,  # prompt tokens looked up
            "prefix_hit_tokens": self._prefix_hits,  # of those, served from cached blocks
            "prefix_hit_rate": self._prefix_hits / self._prefix_queries if self._prefix_queries else 0.0,
            "num_evictions": self._num_evictions,
        }

    # ------------------------------------------------------------------ mutations

    def allocate(self, row_id: str, token_ids: Sequence[int], num_tokens: int,
                 match: PrefixMatch | None = None) -> list[int]:
        """Create ``row_id``'s block table covering ``num_tokens`` token slots.

        The leading full blocks of ``token_ids`` that are cached (``match_prefix``, further
        capped at ``num_tokens // block_size``) are shared: refcount + 1, and taken out of
        the free queue if they were free. The rest are fresh blocks from the free-queue
        front (evicting their old hashes). ``num_cached_tokens(row_id)`` then says how
        many tokens were reused. ``match``: this pool's ``match_prefix(token_ids)`` taken
        since its last change, to spare hashing the prompt again. Returns a copy of the table.

        Raises NoFreeBlocks (pool unchanged) if fresh + evictable hit blocks exceed the
        free blocks; ValueError if ``row_id`` already has a table or ``num_tokens < 0``.
        """
        if row_id in self._rows:
            raise ValueError(f"row {row_id!r} already has a block table")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        max_hits = min(self._max_hit_blocks(token_ids), num_tokens // self.block_size)
        if match is None or not self.enable_prefix_caching:
            hit_ids, hit_hashes = self._match(token_ids, max_hits)
        else:
            hit_ids, hit_hashes = match.block_ids[:max_hits], match.hashes[:max_hits]
        num_fresh = cdiv(num_tokens, self.block_size) - len(hit_ids)
        needed = num_fresh + sum(1 for b in hit_ids if self._ref_cnt[b] == 0)
        if needed > len(self._free):
            raise NoFreeBlocks(needed, len(self._free))
        for b in hit_ids:  # before popping fresh blocks, which could evict these
            self._take(b)
        fresh = [self._pop_free() for _ in range(num_fresh)]
        num_cached = len(hit_ids) * self.block_size
        self._rows[row_id] = _Row(hit_ids + fresh, num_tokens, num_cached, hit_hashes)
        self._prefix_queries += len(token_ids)
        self._prefix_hits += num_cached
        return hit_ids + fresh

    def extend_prefix_hit(self, row_id: str, token_ids: Sequence[int]) -> int:
        """Swap the row's next fresh blocks for cached ones committed since its allocate.

        For a row that has written nothing beyond its cached prefix yet (a prompt admitted
        in the same tick as another sharing its prefix, whose blocks were committed while
        this row waited to prefill). Each block that now hits replaces the row's own
        unwritten block, which goes back to the free-queue front (it holds nothing).
        Returns the number of tokens newly reused (a multiple of ``block_size``).
        Raises KeyError for an unknown row.
        """
        row = self._rows[row_id]
        if not self.enable_prefix_caching or len(row.hashes) * self.block_size != row.num_cached_tokens:
            return 0
        bs = self.block_size
        max_hits = min(self._max_hit_blocks(token_ids), row.num_slots // bs)
        added = 0
        for i in range(len(row.hashes), max_hits):
            parent = row.hashes[-1] if row.hashes else None
            h = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            b = self._cached.get(h)
            if b is None:
                break
            own = row.block_ids[i]
            self._take(b)
            self._ref_cnt[own] -= 1
            if self._ref_cnt[own] == 0:
                self._free[own] = None
                self._free.move_to_end(own, last=False)
            row.block_ids[i] = b
            row.hashes.append(h)
            row.num_cached_tokens += bs
            added += bs
        self._prefix_hits += added
        return added

    def append_slots(self, row_id: str, num_new_tokens: int) -> list[int]:
        """Grow the row's table to cover ``num_slots + num_new_tokens`` slots (decode).

        Returns only the newly added block ids (often ``[]``: the last block had room).
        Raises NoFreeBlocks (pool unchanged), KeyError for an unknown row, ValueError for
        ``num_new_tokens < 0``.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        row = self._rows[row_id]
        new_slots = row.num_slots + num_new_tokens
        needed = cdiv(new_slots, self.block_size) - len(row.block_ids)
        if needed > len(self._free):
            raise NoFreeBlocks(needed, len(self._free))
        new = [self._pop_free() for _ in range(needed)]
        row.block_ids.extend(new)
        row.num_slots = new_slots
        return new

    def commit_full_blocks(self, row_id: str, token_ids: Sequence[int]) -> None:
        """Register hashes for the row's blocks newly filled by ``token_ids``.

        ``token_ids`` is the row's sequence from position 0 whose KV has been *written*
        (after a decode step, not yet the token just sampled). Only blocks fully covered
        get a hash; already committed ones are skipped, so calling this every tick is
        cheap. If another block already holds the same hash, that mapping is kept and
        this row's block stays unhashed. No-op with prefix caching off.
        Raises KeyError for an unknown row, ValueError if ``token_ids`` is longer than
        the row's slots.
        """
        row = self._rows[row_id]
        if len(token_ids) > row.num_slots:
            raise ValueError(f"{len(token_ids)} tokens but row {row_id!r} has {row.num_slots} slots")
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(row.hashes), len(token_ids) // bs):
            parent = row.hashes[-1] if row.hashes else None
            h = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            row.hashes.append(h)
            if h in self._cached:
                continue
            b = row.block_ids[i]
            assert self._hash[b] is None, f"block {b} committed twice"
            self._hash[b] = h
            self._cached[h] = b

    def free(self, row_id: str) -> None:
        """Release the row's blocks; those reaching refcount 0 join the free-queue tail,
        the row's last block first. Cached ones stay findable. Unknown row: no-op."""
        row = self._rows.pop(row_id, None)
        if row is None:
            return
        for b in reversed(row.block_ids):
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free[b] = None
                if self._hash[b] is not None:
                    self._num_cached_free += 1

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (free and in-use blocks); returns how many were dropped.

        Safe with rows live: they keep their hash chains, so later commits still hash
        correctly. Statistics counters are not reset.
        """
        dropped = len(self._cached)
        for b in self._cached.values():
            self._hash[b] = None
        self._cached.clear()
        self._num_cached_free = 0
        return dropped

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call this after
        every step; O(num_blocks + table sizes)). Works under ``python -O``."""

        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(msg)

        used = [b for b in range(self.num_blocks) if self._ref_cnt[b] > 0]
        check(len(self._free) + len(used) == self.num_blocks, "free + used != total")
        for b in self._free:
            check(self._ref_cnt[b] == 0, f"free block {b} has refcount {self._ref_cnt[b]}")
        for b in used:
            check(b not in self._free, f"used block {b} is in the free queue")
        check(all(r >= 0 for r in self._ref_cnt), "negative refcount")
        for h, b in self._cached.items():
            check(self._hash[b] == h, f"hash map entry points to block {b} with another hash")
        hashed = [b for b in range(self.num_blocks) if self._hash[b] is not None]
        check(len(hashed) == len(self._cached), "a block holds a hash missing from the hash map")
        check(not self._cached or self.enable_prefix_caching, "hashes with prefix caching off")
        cached_free = sum(1 for b in self._free if self._hash[b] is not None)
        check(cached_free == self._num_cached_free, "cached-free counter is stale")
        occurrences = [0] * self.num_blocks
        for row_id, row in self._rows.items():
            check(len(set(row.block_ids)) == len(row.block_ids), f"row {row_id!r} repeats a block")
            check(len(row.block_ids) == cdiv(row.num_slots, self.block_size), f"row {row_id!r} size")
            check(row.num_cached_tokens <= len(row.hashes) * self.block_size, f"row {row_id!r} cache")
            check(len(row.hashes) * self.block_size <= row.num_slots, f"row {row_id!r} hashed partial")
            for b in row.block_ids:
                occurrences[b] += 1
        check(occurrences == self._ref_cnt, "refcounts differ from block-table occurrences")

    # ------------------------------------------------------------------ helpers

    def _max_hit_blocks(self, token_ids: Sequence[int]) -> int:
        return max(0, (len(token_ids) - 1) // self.block_size)

    def _match(self, token_ids: Sequence[int], max_blocks: int) -> tuple[list[int], list[BlockHash]]:
        if not self.enable_prefix_caching:
            return [], []
        return match_chain(self._cached, token_ids, self.block_size, max_blocks)

    def _take(self, b: int) -> None:
        """Share cached block ``b``: refcount + 1, out of the free queue if it was free."""
        if self._ref_cnt[b] == 0:
            del self._free[b]
            self._num_cached_free -= 1
        self._ref_cnt[b] += 1

    def _pop_free(self) -> int:
        """Take the free-queue front (least recently freed), evicting its hash."""
        b, _ = self._free.popitem(last=False)
        assert self._ref_cnt[b] == 0, f"block {b} in the free queue has refcount {self._ref_cnt[b]}"
        h = self._hash[b]
        if h is not None:
            del self._cached[h]
            self._hash[b] = None
            self._num_cached_free -= 1
            self._num_evictions += 1
        self._ref_cnt[b] = 1
        return b
