"""The prefix cache's names for blocks: a full block's hash is ``H(parent block's hash,
block's token ids)``, so one hash names the whole prefix up to and including that block
(Ref: vLLM v1 "automatic prefix caching" design). Pure Python and stable across
processes, so any process can compute the chain of a prompt.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence

BlockHash = bytes
"""A 32-byte SHA-256 digest naming a full block *and* every token before it."""


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block: ``sha256(parent tag + parent hash + tokens as <int64)``.

    ``parent_hash`` is None for a row's first block. SHA-256 rather than Python's
    ``hash()``: a collision would silently hand a request someone else's KV (wrong output,
    no error), and 64-bit ``hash()`` collisions are cheap to construct for adversarial
    prompts; the digest is also stable across processes and runs (no PYTHONHASHSEED, no
    ``hash(None)`` identity), so a frontend or a prefill worker could compute the same
    hashes. Cost is about a microsecond per block.
    """
    h = hashlib.sha256()
    if parent_hash is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01")
        h.update(parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def match_chain(cached: Mapping[BlockHash, int], token_ids: Sequence[int], block_size: int,
                max_blocks: int) -> tuple[list[int], list[BlockHash]]:
    """Walk ``token_ids``' chain of full-block hashes down ``cached`` (hash → block id)
    until the first miss, at most ``max_blocks`` blocks: the hit blocks' ids and hashes."""
    ids: list[int] = []
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for i in range(max_blocks):
        h = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        b = cached.get(h)
        if b is None:
            break
        ids.append(b)
        hashes.append(h)
        parent = h
    return ids, hashes
