"""msgpack codec for :mod:`shared.protocol` with an explicit tag → class table.

A frame is ``msgpack([tag, field_1, field_2, ...])`` with fields in declaration order.
Nested protocol dataclasses (``SamplingParams`` inside ``Submit``, ``RequestOutput``
inside ``StepOutput``) are encoded the same way, without a tag; their classes come
from the field annotations, resolved once at import. Enums travel as their values.

Errors: :func:`decode` raises :class:`DecodeError` for anything that is not a
well-formed frame of a known tag — callers count, log and drop such frames.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Callable

import msgpack

from shared import protocol as p

# The wire tags. Append only; never renumber.
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
_TAG_OF: dict[type, int] = {cls: tag for tag, cls in TAGS.items()}

MAX_FRAME_BYTES = 16 * 1024 * 1024  # larger frames are refused before unpacking


class DecodeError(ValueError):
    """A frame that is not a valid message."""


Converter = Callable[[Any], Any]


def _identity(x: Any) -> Any:
    return x


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _decoder_for(tp: Any) -> Converter:
    inner, optional = _unwrap_optional(tp)
    conv: Converter
    if dataclasses.is_dataclass(inner):
        conv = _struct_decoder(inner)
    elif isinstance(inner, type) and issubclass(inner, enum.Enum):
        conv = inner
    elif typing.get_origin(inner) is list:
        (item,) = typing.get_args(inner) or (Any,)
        item_conv = _decoder_for(item)
        conv = lambda v, c=item_conv: [c(x) for x in _expect(v, list)]  # noqa: E731
    elif typing.get_origin(inner) is dict or inner is dict:
        conv = lambda v: dict(_expect(v, dict))  # noqa: E731
    else:
        conv = _identity
    if optional and conv is not _identity:
        return lambda v, c=conv: None if v is None else c(v)
    return conv


def _expect(value: Any, tp: type) -> Any:
    if not isinstance(value, tp):
        raise DecodeError(f"expected {tp.__name__}, got {type(value).__name__}")
    return value


_STRUCT_DECODERS: dict[type, Converter] = {}


def _struct_decoder(cls: type) -> Converter:
    if cls in _STRUCT_DECODERS:
        return _STRUCT_DECODERS[cls]
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    convs = [_decoder_for(hints[n]) for n in names]

    def decode_struct(values: Any) -> Any:
        if not isinstance(values, list) or len(values) != len(names):
            raise DecodeError(f"{cls.__name__}: expected {len(names)} fields")
        return cls(*(c(v) for c, v in zip(convs, values)))

    _STRUCT_DECODERS[cls] = decode_struct
    return decode_struct


def _to_wire(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return [_to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [_to_wire(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_wire(v) for k, v in obj.items()}
    return obj


for _cls in TAGS.values():
    _struct_decoder(_cls)


def encode(msg: Any) -> bytes:
    """Encode one protocol message to bytes. Raises ``KeyError`` for an unknown type."""
    tag = _TAG_OF[type(msg)]
    return msgpack.packb([tag, *_to_wire(msg)], use_bin_type=True)


def decode(frame: bytes) -> Any:
    """Decode one frame produced by :func:`encode`. Raises :class:`DecodeError`."""
    if len(frame) > MAX_FRAME_BYTES:
        raise DecodeError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        values = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"not msgpack: {exc}") from None
    if not isinstance(values, list) or not values or not isinstance(values[0], int):
        raise DecodeError("frame is not a tagged list")
    cls = TAGS.get(values[0])
    if cls is None:
        raise DecodeError(f"unknown tag {values[0]}")
    try:
        return _STRUCT_DECODERS[cls](values[1:])
    except DecodeError:
        raise
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"{cls.__name__}: {exc}") from None
