"""Streamed token ids → text deltas, cut at stop strings.

The engine streams token ids; the frontend turns them into text for SSE. One choice's
path through this module::

    token ids ──► IncrementalDetokenizer ──► text delta ──► StopStringMatcher ──► SSE
                  holds the bytes of an                     holds text that could still
                  unfinished UTF-8 character                become a stop string

:class:`~frontend.text_stream.TextStream` wires the two together (with
:class:`~frontend.stop_strings.StopStringMatcher`) and is what the HTTP layer keeps per
choice. This module is the detokenizer.

Guarantees, for every piece: text already returned never changes (deltas only append),
and pieces of text are held back only while the next tokens could still change them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"

# Prompt tokens decoded in front of the output on the generic (window) path, so that
# decoders that treat the first token of a decode call specially (SentencePiece's
# Metaspace drops its leading space) see the output in context.
_PROMPT_CONTEXT_TOKENS = 4


# --------------------------------------------------------------------------------------
# Incremental detokenization
# --------------------------------------------------------------------------------------


class DecodeMode(enum.Enum):
    """How an :class:`IncrementalDetokenizer` turns ids into text.

    BYTE_LEVEL: byte-level BPE (GPT-2 style; SmolLM2, Llama 3, Qwen). Each token maps to
        raw bytes; exactly the bytes of an unfinished last character are held back.
        Exact and O(new tokens) per push, always.
    WINDOW: any other tokenizer. Re-decodes a short window of recent tokens with
        ``tokenizer.decode`` and emits what the window adds (prefix/read offsets).
    """

    BYTE_LEVEL = "byte_level"
    WINDOW = "window"


class _Decoder(Protocol):
    def push(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas.

    ``push(ids)`` returns the text the new ids add; ``flush()`` returns whatever is
    still held when the stream ends. Guarantees:

    - Monotonic: text returned is never revised; later calls only append.
    - No half characters: a delta never ends inside a UTF-8 character and never holds a
      U+FFFD that the full decode does not hold at that place. Bytes of an unfinished
      character are held until a later token completes it (or proves it invalid).
    - Exact: ``"".join(pushes) + flush() == tokenizer.decode(all_ids,
      skip_special_tokens=skip_special_tokens)``. On the WINDOW path this holds for
      decoders that decode a run of tokens the same whatever precedes it (byte-level
      BPE; SentencePiece byte-fallback while its byte tokens form valid UTF-8). With
      ``prompt_token_ids`` given, a SentencePiece tokenizer keeps the leading space of
      the first output word (the text as it reads after the prompt), which a
      stand-alone decode of the output drops.
    - Cost per ``push``: BYTE_LEVEL is O(new tokens). WINDOW decodes the previous
      push's tokens (as context) plus held and new tokens; tokens are held only while
      the text ends in U+FFFD or adds nothing (skipped special tokens), i.e. at most 3
      for valid UTF-8 output. A run of invalid bytes is held (and re-decoded) until a
      complete character follows, or until ``flush()``.

    ``prompt_token_ids``: decoding context only; its text is never returned. Byte-level
    decoding needs no context and ignores it.

    Where a genuinely invalid byte sequence shows up: BYTE_LEVEL emits its U+FFFD as
    soon as a following byte proves it invalid, or at ``flush()`` when the stream ends
    inside it. WINDOW holds any trailing U+FFFD until a complete character follows, or
    until ``flush()``.

    ``flush()`` ends the stream: a second call returns ``""``; ``push`` after it raises
    ``RuntimeError``.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        backend = _byte_level_backend(tokenizer)
        self._decoder: _Decoder
        if backend is not None:
            self.mode = DecodeMode.BYTE_LEVEL
            self._decoder = _ByteLevelDecoder(backend, skip_special_tokens)
        else:
            self.mode = DecodeMode.WINDOW
            self._decoder = _WindowDecoder(tokenizer, prompt_token_ids, skip_special_tokens)
        self.num_tokens = 0  # output token ids pushed so far
        self._flushed = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Append output ids; return the text they complete (may be ``""``)."""
        if self._flushed:
            raise RuntimeError("push() after flush(): the stream has ended")
        self.num_tokens += len(token_ids)
        return self._decoder.push(token_ids)

    def flush(self) -> str:
        """End the stream; return everything still held, invalid bytes as U+FFFD."""
        if self._flushed:
            return ""
        self._flushed = True
        return self._decoder.flush()


def _byte_level_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` when decoding it is plain
    byte-level BPE decoding (so each token is a fixed byte string); otherwise ``None``.

    Requires a transformers ``TokenizersBackend`` with its stock ``decode``, a bare
    ``ByteLevel`` decoder (not inside a ``Sequence``) and no space clean-up.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    try:
        from tokenizers.decoders import ByteLevel
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    stock_decode = (
        isinstance(tokenizer, TokenizersBackend)
        and type(tokenizer).decode is TokenizersBackend.decode
        and type(tokenizer)._decode is TokenizersBackend._decode
    )
    if not stock_decode or not isinstance(backend.decoder, ByteLevel):
        return None
    return backend


def token_bytes_of(tokenizer) -> Callable[[int], bytes] | None:
    """For a byte-level BPE tokenizer, a function giving the exact bytes one token id
    decodes to (a piece of a UTF-8 character included; ``b""`` for an unknown id);
    ``None`` for any other tokenizer, whose tokens have no fixed bytes."""
    backend = _byte_level_backend(tokenizer)
    if backend is None:
        return None

    def token_bytes(token_id: int) -> bytes:
        token = backend.id_to_token(token_id)
        return b"" if token is None else _byte_level_token_bytes(token)

    return token_bytes


def _byte_level_alphabet() -> dict[str, int]:
    """Printable stand-in character → byte, as byte-level BPE vocabularies spell bytes.

    Bytes that are printable and not whitespace (``!``..``~``, ``¡``..``¬``,
    ``®``..``ÿ``) stand for themselves; the other 68 bytes, in increasing order, are
    spelled ``chr(256)``, ``chr(257)``, ... (so a space is ``Ġ``, a newline ``Ċ``).
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    others = (b for b in range(256) if chr(b) not in alphabet)
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


_BYTE_OF_CHAR = _byte_level_alphabet()


def _byte_level_token_bytes(token: str) -> bytes:
    """The bytes a byte-level decoder writes for one token string.

    A token spelled entirely in the byte alphabet gives those bytes; any other token
    (an added token such as ``日本``) gives its own UTF-8 encoding, as the
    ``tokenizers`` ``ByteLevel`` decoder does.
    """
    try:
        return bytes(_BYTE_OF_CHAR[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


class _ByteLevelDecoder:
    """Token ids → bytes → UTF-8 text, holding back an unfinished last character.

    Complete bytes are decoded with ``errors="replace"``: one U+FFFD per maximal
    invalid subsequence, as Rust's ``String::from_utf8_lossy`` (used by
    ``tokenizers``) does. Python's own incremental decoder is not used because it also
    holds back some sequences that are already invalid (``ED A0``, a surrogate).
    """

    def __init__(self, backend, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._skipped: frozenset[int] = frozenset()
        if skip_special_tokens:
            added = backend.get_added_tokens_decoder()
            self._skipped = frozenset(i for i, tok in added.items() if tok.special)
        self._pending = b""  # 0-3 bytes: the start of a character not yet finished

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._skipped:
            return b""
        token = self._backend.id_to_token(token_id)
        return b"" if token is None else _byte_level_token_bytes(token)  # unknown id → nothing

    def push(self, token_ids: Sequence[int]) -> str:
        data = self._pending + b"".join(map(self._bytes, token_ids))
        ready = len(data) - _unfinished_tail_len(data)
        self._pending = data[ready:]
        return data[:ready].decode("utf-8", errors="replace")

    def flush(self) -> str:
        data, self._pending = self._pending, b""
        return data.decode("utf-8", errors="replace")


def _unfinished_tail_len(data: bytes) -> int:
    """How many trailing bytes of ``data`` (0-3) start a valid UTF-8 character that
    more bytes could still finish (Unicode 15, Table 3-7)."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if 0x80 <= byte <= 0xBF:  # continuation byte: the lead byte is further back
            continue
        if 0xC2 <= byte <= 0xDF:
            length = 2
        elif 0xE0 <= byte <= 0xEF:
            length = 3
        elif 0xF0 <= byte <= 0xF4:
            length = 4
        else:  # ASCII, or a byte that never starts a character
            return 0
        low, high = _SECOND_BYTE_RANGE.get(byte, (0x80, 0xBF))
        second_ok = back == 1 or low <= data[-back + 1] <= high
        return back if back < length and second_ok else 0
    return 0


# Lead bytes whose second byte is restricted (no overlong forms, no surrogates, no
# code points above U+10FFFF).
_SECOND_BYTE_RANGE = {
    0xE0: (0xA0, 0xBF),
    0xED: (0x80, 0x9F),
    0xF0: (0x90, 0xBF),
    0xF4: (0x80, 0x8F),
}


class _WindowDecoder:
    """Generic incremental decoding with a prefix offset and a read offset.

    ``_ids`` holds only the window: context tokens (already emitted, or prompt tail)
    followed by tokens not yet emitted::

        _ids:  [ context ........ | unread ........... ]
               0                _read             len(_ids)
        _prefix_text = decode(_ids[:_read])

    A push decodes the whole window; if the text grew and does not end in U+FFFD (a
    possibly unfinished character), the part past ``_prefix_text`` is emitted and the
    tokens just emitted become the next window's context.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int] | None, skip: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip
        context = list(prompt_token_ids or [])[-_PROMPT_CONTEXT_TOKENS:]
        text = self._decode(context)
        if text.endswith(_REPLACEMENT):  # prompt ends inside a character: no context
            context, text = [], ""
        self._ids: list[int] = context
        self._read = len(context)
        self._prefix_text = text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        if len(self._ids) == self._read:
            return ""
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        if len(self._ids) == self._read:
            return ""
        return self._emit(self._decode(self._ids))

    def _emit(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta
