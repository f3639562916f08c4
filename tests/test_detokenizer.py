"""Incremental detokenization and stop strings (frontend/detokenizer.py).

Detokenizer tests run on the real SmolLM2 tokenizer, through both decoding paths: the
byte-level path it takes by itself, and the generic window path (forced by hiding the
tokenizer behind an object that only has ``decode``).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend.detokenizer import DecodeMode, IncrementalDetokenizer
from frontend.stop_strings import StopResult, StopStringMatcher
from frontend.text_stream import TextStream

FFFD = "\ufffd"
MULTIBYTE_TEXTS = [
    "😀🎉👍🏽 emoji",
    "日本語のテキスト、中文字符",
    "naïve café — Ελληνικά, Ørsted, Ж",
    "mixed: a😀b日c\u0301d 🇫🇷",
]


class DecodeOnly:
    """A tokenizer with nothing but ``decode``: forces the generic window path."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=False):
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="session", params=list(DecodeMode), ids=lambda m: m.value)
def detok_case(request, smol_tokenizer):
    """(tokenizer to hand the detokenizer, real tokenizer, expected mode)."""
    if request.param is DecodeMode.BYTE_LEVEL:
        return smol_tokenizer, smol_tokenizer, DecodeMode.BYTE_LEVEL
    return DecodeOnly(smol_tokenizer), smol_tokenizer, DecodeMode.WINDOW


@pytest.fixture(scope="session")
def vocab_pools(smol_tokenizer):
    """Token ids grouped by what they decode to on their own."""
    n = len(smol_tokenizer)
    singles = smol_tokenizer.batch_decode([[i] for i in range(n)])
    partial = [i for i, s in enumerate(singles) if FFFD in s]  # bytes not valid UTF-8 alone
    multibyte = [i for i, s in enumerate(singles) if FFFD not in s and not s.isascii()]
    ascii_ = [i for i, s in enumerate(singles) if s.isascii() and i >= 17]
    return {"partial": partial, "multibyte": multibyte, "ascii": ascii_, "special": list(range(17))}


def stream(detok: IncrementalDetokenizer, chunks) -> list[str]:
    return [detok.push(list(c)) for c in chunks]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------------------
# IncrementalDetokenizer
# --------------------------------------------------------------------------------------


def test_smollm2_takes_the_byte_level_path(smol_tokenizer):
    assert IncrementalDetokenizer(smol_tokenizer).mode is DecodeMode.BYTE_LEVEL
    assert IncrementalDetokenizer(DecodeOnly(smol_tokenizer)).mode is DecodeMode.WINDOW


def test_ascii_one_token_at_a_time(detok_case):
    tok, real, _ = detok_case
    text = "Hello, world! How are   you?\n  def f(x): return x  "
    ids = encode(real, text)
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, [[i] for i in ids])
    assert deltas == [real.decode([i]) for i in ids]  # ASCII: each token's own text, at once
    assert "".join(deltas) + detok.flush() == real.decode(ids) == text


def test_emoji_held_until_complete(detok_case):
    tok, real, mode = detok_case
    ids = encode(real, " 😀")
    assert len(ids) == 2 and FFFD in real.decode(ids[:1])  # the emoji spans two tokens
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, [[i] for i in ids])
    if mode is DecodeMode.BYTE_LEVEL:  # holds exactly the unfinished character's bytes
        assert deltas == [" ", "😀"]
    else:  # holds the whole token that ends inside a character
        assert deltas == ["", " 😀"]
    assert detok.flush() == ""


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_text_token_by_token(detok_case, text):
    tok, real, _ = detok_case
    ids = encode(real, text)
    assert any(FFFD in real.decode([i]) for i in ids), "text should split characters across tokens"
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, [[i] for i in ids])
    assert not any(FFFD in d for d in deltas)
    assert "".join(deltas) + detok.flush() == real.decode(ids) == text


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(detok_case, skip):
    tok, real, _ = detok_case
    im_start, im_end, eot = 1, 2, 0
    emoji = encode(real, "😀")
    # a special token inside a split character: skipped, the bytes still join up
    ids = [im_start, *encode(real, "assistant\nHi "), emoji[0], im_end, *emoji[1:], eot]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    out = "".join(stream(detok, [[i] for i in ids])) + detok.flush()
    assert out == real.decode(ids, skip_special_tokens=skip)
    if skip:
        assert out == "assistant\nHi 😀"
    else:
        assert out.startswith("<|im_start|>assistant") and "<|im_end|>" in out


def test_invalid_bytes_at_end_released_by_flush(detok_case, vocab_pools):
    tok, real, _ = detok_case
    start_of_emoji = encode(real, "😀")[0]
    ids = [*encode(real, "ok"), start_of_emoji]
    detok = IncrementalDetokenizer(tok)
    assert "".join(stream(detok, [[i] for i in ids])) == "ok"
    tail = detok.flush()
    assert tail == FFFD and "ok" + tail == real.decode(ids)
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.push([1])


def test_invalid_byte_in_the_middle(detok_case):
    tok, real, mode = detok_case
    start_of_emoji = encode(real, "😀")[0]
    ids = [start_of_emoji, *encode(real, "ab cd")]
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, [[i] for i in ids])
    assert "".join(deltas) + detok.flush() == real.decode(ids) == FFFD + "ab cd"
    if mode is DecodeMode.BYTE_LEVEL:  # proven invalid by the next byte: sent right then
        assert deltas[:2] == ["", FFFD + real.decode(ids[1:2])]


def test_prompt_is_context_only(detok_case):
    tok, real, _ = detok_case
    messages = [{"role": "user", "content": "Hi"}]
    prompt = real.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    ids = encode(real, "Hello 日本 there")
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    assert "".join(stream(detok, [[i] for i in ids])) + detok.flush() == real.decode(ids)


def test_added_tokens_outside_byte_alphabet(smol_tokenizer):
    import copy

    tok = copy.deepcopy(smol_tokenizer)
    tok.add_tokens(["日本x", "Ġzz", "aé"])
    added = tok.convert_tokens_to_ids(["日本x", "Ġzz", "aé"])
    ids = [*encode(tok, "Hello"), *added, *encode(tok, " 😀")]
    detok = IncrementalDetokenizer(tok)
    assert detok.mode is DecodeMode.BYTE_LEVEL
    assert "".join(stream(detok, [[i] for i in ids])) + detok.flush() == tok.decode(ids)


def test_cost_does_not_grow_with_output_length(smol_tokenizer):
    """Each push decodes only its own tokens (plus a short window), never the history."""
    calls: list[int] = []

    class CountingDecode(DecodeOnly):
        def decode(self, ids, skip_special_tokens=False):
            calls.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    ids = encode(smol_tokenizer, "word 日本 " * 300)
    detok = IncrementalDetokenizer(CountingDecode(smol_tokenizer))
    out = "".join(stream(detok, [[i] for i in ids])) + detok.flush()
    assert out == smol_tokenizer.decode(ids)
    assert max(calls) <= 8


def test_unfinished_tail_exhaustive():
    """Held bytes are exactly a trailing start of a character that can still complete."""
    import itertools

    from frontend.detokenizer import _unfinished_tail_len

    edges = [0x41, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1,
             0xEC, 0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF]  # fmt: skip
    # only the first continuation byte has a restricted range; later ones take any 80..BF
    firsts = (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF)
    conts = [bytes([c]) + b"\x80" * m for c in firsts for m in range(3)]

    def completes(tail: bytes) -> bool:
        for c in conts:
            try:
                if len((tail + c).decode("utf-8")) == 1:
                    return True
            except UnicodeDecodeError:
                pass
        return False

    for n in range(0, 4):
        for data in map(bytes, itertools.product(edges, repeat=n)):
            k = _unfinished_tail_len(data)
            expected = max((j for j in range(1, n + 1) if completes(data[n - j :])), default=0)
            assert k == expected, data.hex()


def _id_chunks(pools, n_vocab):
    token = st.one_of(
        st.sampled_from(pools["partial"]),
        st.sampled_from(pools["partial"]),
        st.sampled_from(pools["multibyte"]),
        st.sampled_from(pools["ascii"]),
        st.sampled_from(pools["special"]),
        st.integers(0, n_vocab + 2),  # includes a few unknown ids
    )
    return st.lists(st.lists(token, max_size=4), max_size=30)


@pytest.mark.parametrize("skip", [True, False])
def test_property_random_ids(detok_case, vocab_pools, skip):
    tok, real, mode = detok_case

    @settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(chunks=_id_chunks(vocab_pools, len(real)))
    def check(chunks):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        ids = [i for c in chunks for i in c]
        final = real.decode(ids, skip_special_tokens=skip)
        sent, seen = "", []
        for chunk in chunks:
            sent += detok.push(chunk)
            seen += chunk
            # monotonic and exact: everything sent so far is a prefix of the final text,
            # so no U+FFFD is sent that the final text does not have at that place
            assert final.startswith(sent)
            if mode is DecodeMode.BYTE_LEVEL:  # held back: at most one unfinished character
                assert real.decode(seen, skip_special_tokens=skip) in (sent, sent + FFFD)
        assert sent + detok.flush() == final

    check()


# --------------------------------------------------------------------------------------
# StopStringMatcher
# --------------------------------------------------------------------------------------


def run_matcher(matcher: StopStringMatcher, deltas) -> tuple[list[StopResult], str]:
    results = [matcher.push(d) for d in deltas]
    return results, matcher.flush()


def test_stop_inside_one_delta():
    m = StopStringMatcher(["END"])
    assert m.push("abcENDxyz") == StopResult("abc", True)
    assert m.push("more") == StopResult("", True)
    assert m.flush() == "" and m.matched == "END"


def test_stop_across_three_deltas():
    m = StopStringMatcher(["STOP"])
    assert m.push("foo S") == StopResult("foo ", False)
    assert m.push("T") == StopResult("", False)
    assert m.push("O") == StopResult("", False)
    assert m.push("Pbar") == StopResult("", True)


def test_held_text_released_when_it_cannot_match():
    m = StopStringMatcher(["END"])
    assert m.push("xE") == StopResult("x", False)
    assert m.push("N") == StopResult("", False)
    assert m.push("ope E") == StopResult("ENope ", False)
    assert m.flush() == "E"
    assert not m.stopped


def test_include_stop_str_in_output():
    m = StopStringMatcher(["END"], include_stop_str_in_output=True)
    assert m.push("abcE") == StopResult("abc", False)
    assert m.push("NDxyz") == StopResult("END", True)


def test_earliest_match_wins():
    m = StopStringMatcher(["world", "lo w"])
    results, tail = run_matcher(m, ["hello", " wor", "ld"])
    assert "".join(r.text for r in results) + tail == "hel"
    assert m.matched == "lo w"


def test_shorter_stop_waits_for_longer_one_that_started_earlier():
    m = StopStringMatcher(["abcd", "c"])
    assert m.push("xabc") == StopResult("x", False)  # "c" matched, but "abcd" may too
    assert m.push("d") == StopResult("", True) and m.matched == "abcd"
    m = StopStringMatcher(["abcd", "c"])
    assert m.push("xabc") == StopResult("x", False)
    assert m.push("z") == StopResult("ab", True) and m.matched == "c"
    m = StopStringMatcher(["abcd", "c"])
    assert m.push("xabc") == StopResult("x", False)
    assert m.flush() == "ab" and m.stopped  # the stream ended: "abcd" cannot complete


def test_same_start_shortest_wins():
    m = StopStringMatcher(["abc", "ab"], include_stop_str_in_output=True)
    assert m.push("xabcd") == StopResult("xab", True)


def test_stop_at_very_start():
    assert StopStringMatcher(["STOP"]).push("STOP and more") == StopResult("", True)
    m = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert m.push("ST") == StopResult("", False)
    assert m.push("OP!") == StopResult("STOP", True)


def test_no_stop_strings_pass_everything_through():
    m = StopStringMatcher([])
    assert m.push("abc") == StopResult("abc", False)
    assert m.flush() == ""
    with pytest.raises(RuntimeError):
        m.push("x")


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=500, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=40),
    stop=st.text(alphabet="abc ", min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    include=st.booleans(),
)
def test_property_single_stop(text, stop, cuts, include):
    m = StopStringMatcher([stop], include_stop_str_in_output=include)
    results, tail = run_matcher(m, _split(text, cuts))
    pos = text.find(stop)
    expected = text if pos < 0 else text[: pos + len(stop) * include]
    assert "".join(r.text for r in results) + tail == expected
    assert m.stopped == (pos >= 0)
    stopped_flags = [r.stopped for r in results]
    assert stopped_flags == sorted(stopped_flags)  # once stopped, stays stopped


@settings(max_examples=500, deadline=None)
@given(
    text=st.text(alphabet="ab😀", max_size=30),
    stops=st.lists(st.text(alphabet="ab😀", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
    include=st.booleans(),
)
def test_property_several_stops(text, stops, cuts, include):
    m = StopStringMatcher(stops, include_stop_str_in_output=include)
    results, tail = run_matcher(m, _split(text, cuts))
    found = [(text.find(s), len(s), s) for s in stops if s in text]
    if found:
        pos, _, stop = min(found)
        expected = text[: pos + len(stop) * include]
    else:
        expected = text
    assert "".join(r.text for r in results) + tail == expected


# --------------------------------------------------------------------------------------
# TextStream
# --------------------------------------------------------------------------------------


def test_text_stream_stops_on_text(smol_tokenizer):
    ids = encode(smol_tokenizer, "Hello world. STOP here and more")
    s = TextStream(smol_tokenizer, ["STOP"])
    results = [s.push([i]) for i in ids]
    assert s.stopped and s.matched_stop == "STOP"
    assert "".join(r.text for r in results) == s.text == "Hello world. "
    assert s.push([42]) == StopResult("", True)  # ids still in flight after the stop
    text, stopped = s.push([43])
    assert (text, stopped) == ("", True)
    assert s.flush() == ""


def test_text_stream_stop_string_in_split_characters(smol_tokenizer):
    ids = encode(smol_tokenizer, "abc 日本語 def")
    s = TextStream(smol_tokenizer, ["本語"], include_stop_str_in_output=True)
    for i in ids:
        r = s.push([i])
        assert FFFD not in r.text
    assert s.stopped and s.text == "abc 日本語"


def test_text_stream_flush_without_stop(smol_tokenizer):
    ids = [1, *encode(smol_tokenizer, "Answer: 😀 42"), 2]
    s = TextStream(smol_tokenizer, ["42!"])
    sent = "".join(s.push([i]).text for i in ids)
    assert sent == "Answer: 😀 "  # "42" could still become "42!"
    assert s.flush() == "42" and not s.stopped
    assert s.text == smol_tokenizer.decode(ids, skip_special_tokens=True)
    assert s.flush() == ""
    with pytest.raises(RuntimeError):
        s.push([5])


def test_text_stream_stop_found_at_flush(smol_tokenizer):
    """A stop string that only wins once the stream ends is still honoured."""
    s = TextStream(smol_tokenizer, ["x y z", "y"])
    sent = "".join(s.push([i]).text for i in encode(smol_tokenizer, "a x y"))
    assert sent == "a " and not s.stopped  # "x y" may still become "x y z"
    assert s.flush() == "x " and s.stopped
    assert s.text == "a x " and s.matched_stop == "y"
