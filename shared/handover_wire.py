"""The frames between prefill and decode engines (``PREFILL_MODE=disaggregated``).

A prefill engine hands a row to a decode engine at ``_promote_to_decode`` with one
:class:`Handover`: the row's metadata here, its KV blocks beside it as raw bytes (a
sealed memfd on one host, a second ZeroMQ frame across hosts:
:mod:`shared.handover_transport`). Never a pickled tensor. Over the same connection the
decode engine answers::

    prefill engine                                decode engine
                                   ◄──  DecodeHello(engine_id, layout)   on connect
      Handover(meta) + KV bytes    ──►                                   gates 2, 3: admit or soft-hold
                                   ◄──  HandoverAck(request_id, ok)      it owns the row now
                                   ◄──  KVReleased(request_id)           its KV bytes are copied in (or
                                                                         dropped): their staging room is free
      HandoverAbort([ids])         ──►                                   an abort that met the row in flight
                                   ◄──  DecodeReport(load, counts)       every stats interval (Fair/VTC)

Every frame is msgpack ``[tag, fields…]`` decoded by one typed decoder per side that
checks every field's type and range (as :mod:`shared.codec` does for the frontend's
frames); :func:`layout_problem` then checks a handover's sizes against the receiver's
own KV layout. Anything else raises :class:`~shared.codec.DecodeError`.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

from shared.codec import DecodeError, decode_bounded
from shared.protocol import (MAX_ID_CHARS, MAX_LIST, MAX_PROMPT_TOKENS, Count, Id, Priority, RequestOutput,
                             SamplingParams, TokenId)

MAX_META_BYTES = 64 << 20  # a handover's metadata (prompt logprobs of a long prompt included)
DTYPES = ("float32", "bfloat16", "float16")


class KVLayout(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """How an engine's KV blocks are laid out; both ends of a handover must agree."""

    num_layers: Annotated[int, Meta(ge=1, le=4096)]
    num_kv_heads: Annotated[int, Meta(ge=1, le=4096)]
    head_dim: Annotated[int, Meta(ge=1, le=65536)]
    block_size: Annotated[int, Meta(ge=1, le=65536)]
    dtype: str  # one of DTYPES
    paired: bool  # the bfloat16 pair layout (engine_proc.kv_cache)
    block_nbytes: Annotated[int, Meta(ge=1, lt=1 << 40)]  # one block's K and V over every layer


class Handover(Struct, frozen=True, array_like=True, forbid_unknown_fields=True, tag=1):
    """One row leaving its prefill engine. Its KV (``num_blocks · layout.block_nbytes``
    bytes, blocks in row order, per layer K then V) travels beside this frame."""

    request_id: Id
    frontend_id: Id  # whose topic the decode engine streams on
    prompt_token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    output_token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_LIST)]  # the first token(s)
    params: SamplingParams
    session_id: Annotated[str, Meta(max_length=MAX_ID_CHARS)]
    priority: Priority
    num_cached_tokens: Count  # prompt tokens the prefill engine's prefix cache served
    generator_state: Annotated[bytes, Meta(max_length=1 << 16)] | None  # a seeded row's torch.Generator
    first_output: RequestOutput  # what the prefill engine did not stream: the decode engine sends it first
    layout: KVLayout
    num_kv_tokens: Count  # tokens whose KV is written (the prompt)
    num_blocks: Count
    kv_bytes: Count
    sent_at: float  # time.time() when packed (handover time)


class HandoverAbort(Struct, frozen=True, array_like=True, forbid_unknown_fields=True, tag=2):
    request_ids: Annotated[list[Id], Meta(max_length=MAX_LIST)]


class DecodeHello(Struct, frozen=True, array_like=True, forbid_unknown_fields=True, tag=10):
    engine_id: Id
    layout: KVLayout


class HandoverAck(Struct, frozen=True, array_like=True, forbid_unknown_fields=True, tag=11):
    """The decode engine took the row (``accepted``; it streams it from now on) or refused
    it (``error`` says why; the prefill engine fails the row to its frontend)."""

    request_id: Id
    accepted: bool
    error: Annotated[str, Meta(max_length=4096)] = ""


class DecodeReport(Struct, frozen=True, array_like=True, forbid_unknown_fields=True, tag=12):
    """A decode engine's load (to pick where the next row goes) and the decode tokens each
    ``session_id`` was served since its last report (Fair/VTC on the prefill engines)."""

    num_rows: Count  # decoding plus held
    num_held: Count
    free_blocks: Count
    max_batch_size: Count
    session_tokens: Annotated[dict[Annotated[str, Meta(max_length=MAX_ID_CHARS)], Count],
                              Meta(max_length=1 << 16)] = {}


TO_DECODE = (Handover, HandoverAbort)
class KVReleased(Struct, frozen=True, array_like=True, forbid_unknown_fields=True, tag=13):
    """The decode engine no longer reads this handover's KV bytes (copied into its blocks,
    or the row refused or aborted): the sender may reuse the staging room they used."""

    request_id: Id


TO_PREFILL = (DecodeHello, HandoverAck, DecodeReport, KVReleased)

_encoder = msgspec.msgpack.Encoder()
_decoders = {"decode": msgspec.msgpack.Decoder(Union[TO_DECODE]),  # type: ignore[misc]
             "prefill": msgspec.msgpack.Decoder(Union[TO_PREFILL])}  # type: ignore[misc]


def encode(msg) -> bytes:
    if type(msg) not in TO_DECODE + TO_PREFILL:
        raise KeyError(type(msg).__name__)
    return _encoder.encode(msg)


def decode(frame: bytes | memoryview, side: str):
    """One frame for ``side`` (``"decode"``: what a decode engine receives; ``"prefill"``).
    Raises :class:`DecodeError` for anything that is not exactly such a message."""
    return decode_bounded(_decoders[side], frame, MAX_META_BYTES, "handover frame")


def layout_problem(h: Handover, payload_bytes: int, local: KVLayout) -> str | None:
    """Why ``h`` (with ``payload_bytes`` of KV beside it) cannot be stored in an engine
    whose KV layout is ``local``, or ``None``: the layouts must be equal, the block count
    must cover exactly the written tokens, and the byte counts must agree."""
    if h.layout.dtype not in DTYPES:
        return f"unknown KV dtype {h.layout.dtype!r}"
    if h.layout != local:
        return f"KV layout {h.layout} differs from this engine's {local}"
    if h.num_kv_tokens != len(h.prompt_token_ids) + len(h.output_token_ids) - 1:
        return (f"{h.num_kv_tokens} KV tokens for a row of {len(h.prompt_token_ids)} prompt and "
                f"{len(h.output_token_ids)} output tokens (the last output token has no KV yet)")
    if h.num_blocks != -(-h.num_kv_tokens // local.block_size):
        return f"{h.num_blocks} blocks for {h.num_kv_tokens} tokens of blocks of {local.block_size}"
    if h.kv_bytes != h.num_blocks * local.block_nbytes:
        return f"{h.kv_bytes} KV bytes for {h.num_blocks} blocks of {local.block_nbytes}"
    if payload_bytes != h.kv_bytes:
        return f"{payload_bytes} KV bytes arrived, the frame says {h.kv_bytes}"
    if h.num_cached_tokens > len(h.prompt_token_ids):
        return "more cached tokens than prompt tokens"
    if h.first_output.request_id != h.request_id:
        return "the first output names another request"
    problem = h.params.validate()
    if problem:
        return problem
    if len(h.output_token_ids) >= max(1, h.params.max_tokens):
        return "the row already has max_tokens tokens (it finished on the prefill engine)"
    return None
