"""Which engine serves a request: affinity first, bounded by load.

Every frontend connected to the same engines makes the same choice without talking to
the others:

1. **Affinity key**: the request's session (``X-Session-Id``, ``session_id``, OpenAI's
   ``user``) or, without one, a hash of the prompt's first KV blocks — so a
   conversation's turns, and prompts sharing a system prompt, meet the blocks their
   predecessors left in one engine's prefix cache.
2. **Rendezvous hashing** (Thaler & Ravishankar 1998, "Using name-based mappings to
   increase hit rates", highest random weight): the healthy engines ordered by
   ``hash(key, engine address)``. An engine that dies moves only its own keys; when it
   returns they come back.
3. **Bounded load**: the first choice is skipped for the least loaded engine when it
   would queue the request (no free batch slot) while that one has room, or when its
   load exceeds ``balance_abs + balance_rel · least`` — the shape of SGLang's cache-aware
   router's balance thresholds. Load is the engine's queued plus running requests from
   its last stats broadcast (four a second) plus what this frontend sent it since.

The rest of the order is the fallback when an engine refuses (429 only when every
engine refuses).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Routable(Protocol):
    address: str  # stable across restarts, the same in every frontend

    @property
    def up(self) -> bool: ...

    def load(self) -> float: ...

    def free_slots(self) -> float: ...


@dataclass(frozen=True)
class BalancePolicy:
    balance_abs: float = 8.0  # requests
    balance_rel: float = 1.5


AFFINITY_BLOCKS = 2


def affinity_key(session: str | None, prompt_token_ids: Sequence[int], block_size: int = 16) -> bytes:
    """The session if there is one, else the first ``AFFINITY_BLOCKS`` KV blocks of the
    prompt (all of it when shorter)."""
    if session:
        return b"s:" + session.encode("utf-8", "surrogatepass")
    head = prompt_token_ids[: AFFINITY_BLOCKS * block_size]
    return b"p:" + b",".join(str(t).encode() for t in head)


def rendezvous_order(key: bytes, members: Sequence[Routable]) -> list:
    """``members`` by descending ``blake2b(key, address)``: highest random weight first."""
    def weight(m: Routable) -> bytes:
        return hashlib.blake2b(key + b"\0" + m.address.encode(), digest_size=8).digest()
    return sorted(members, key=weight, reverse=True)


def choose(key: bytes, members: Sequence[Routable], policy: BalancePolicy = BalancePolicy()) -> list:
    """Healthy members in the order to try them (empty when none is up)."""
    healthy = [m for m in members if m.up]
    if len(healthy) <= 1:
        return healthy
    ranked = rendezvous_order(key, healthy)
    loads = {id(m): m.load() for m in healthy}
    least = min(healthy, key=lambda m: (loads[id(m)], ranked.index(m)))
    first = ranked[0]
    if least is not first and (
            (first.free_slots() <= 0 < least.free_slots())
            or loads[id(first)] > policy.balance_abs + policy.balance_rel * loads[id(least)]):
        return [least] + [m for m in ranked if m is not least]
    return ranked
