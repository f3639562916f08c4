"""msgpack codec for :mod:`shared.protocol`: an explicit tag → class table, and one
typed decoder per receiving side that checks every field as it decodes.

A frame is ``msgpack([tag, field_1, field_2, ...])`` with fields in declaration order
(msgspec's ``array_like`` structs, the tag as the first element); nested structs
(``SamplingParams`` inside ``Submit``, ``RequestOutput`` inside ``StepOutput``) are
arrays without a tag. Enums travel as their values. Trailing fields that have defaults
may be left out.

Decoding is total: msgspec's decoder validates the type of every field — an ``int``
is never a ``bool`` or a string, a list of token ids holds only integers in range, a
float is inside its bounds (so never NaN or infinite) — against the ``Annotated``
constraints in :mod:`shared.protocol`. Anything else raises :class:`DecodeError` before
any of it is used; callers count, log and drop such frames.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from shared import protocol as p

# The wire tags. Append only; never renumber. Each class carries its tag in its own
# definition (msgspec needs it there); the table is the one place to read them all,
# and the import-time check below keeps the two in step.
TAGS: dict[int, type] = {
    1: p.Hello,
    2: p.Submit,
    3: p.Abort,
    4: p.Heartbeat,
    5: p.Goodbye,
    6: p.StatsRequest,
    20: p.Welcome,
    21: p.Ack,
    22: p.StepOutput,
    23: p.Stats,
    24: p.EngineHeartbeat,
}
for _tag, _cls in TAGS.items():
    if _cls.__struct_config__.tag != _tag:
        raise RuntimeError(f"{_cls.__name__} is tagged {_cls.__struct_config__.tag}, the table says {_tag}")
if set(TAGS.values()) != set(p.ENGINE_INBOUND) | set(p.FRONTEND_INBOUND):
    raise RuntimeError("the tag table and the protocol's message groups disagree")

MAX_FRAME_BYTES = 16 * 1024 * 1024  # larger frames are refused before unpacking


class DecodeError(ValueError):
    """A frame that is not a valid message."""


_encoder = msgspec.msgpack.Encoder()
_decoders = {
    "any": msgspec.msgpack.Decoder(Union[tuple(TAGS.values())]),  # type: ignore[misc]
    "engine": msgspec.msgpack.Decoder(Union[p.ENGINE_INBOUND]),  # type: ignore[misc]
    "frontend": msgspec.msgpack.Decoder(Union[p.FRONTEND_INBOUND]),  # type: ignore[misc]
}


def encode(msg: Any) -> bytes:
    """Encode one protocol message to bytes. Raises ``KeyError`` for a type that is not
    a tagged message."""
    if type(msg) not in _TAGGED:
        raise KeyError(type(msg).__name__)
    return _encoder.encode(msg)


_TAGGED = frozenset(TAGS.values())


def decode(frame: bytes, side: str = "any") -> Any:
    """Decode one frame produced by :func:`encode` into its message.

    ``side``: ``"engine"`` accepts only messages the engine receives, ``"frontend"``
    only those a frontend receives, ``"any"`` both. Raises :class:`DecodeError` for
    anything else: too large, not msgpack, an unknown or wrong-side tag, a missing,
    extra or ill-typed field, a value out of range.
    """
    return decode_bounded(_decoders[side], frame, MAX_FRAME_BYTES, "frame")


def decode_bounded(decoder: msgspec.msgpack.Decoder, frame: bytes | memoryview, limit: int, what: str):
    """``decoder.decode(frame)`` for a frame of at most ``limit`` bytes; every failure is
    a :class:`DecodeError` (``what`` names the frame in the size message)."""
    if len(frame) > limit:
        raise DecodeError(f"{what} of {len(frame)} bytes exceeds {limit}")
    try:
        return decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise DecodeError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"not a msgpack message: {exc}") from None
