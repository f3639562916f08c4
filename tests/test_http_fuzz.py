"""Randomized HTTP bodies against a spawned engine + frontend (tiny model).

Hypothesis draws bodies for /v1/completions, /v1/chat/completions, /tokenize and
/detokenize: every known field either absent, a plausible value (in or just out of
range) or any JSON value at all (wrong types, nulls, huge numbers, NaN, deep
nesting, any Unicode including lone surrogates), plus raw non-JSON bytes. Whatever
arrives, the server must answer below 500, every error must have OpenAI's shape,
every stream must end with ``data: [DONE]`` and carry no error event, and once the
run is over the engine must be back at its baseline: nothing queued, running,
reserved or holding KV blocks.

The engine runs with a 128-token context, so defaults (a chat request without
max_tokens generates up to the rest of the context) stay cheap.
"""

from __future__ import annotations

import json
from collections import Counter
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.procs import start_stack, wait_for

MAX_MODEL_LEN = 128
VOCAB = 49152
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    try:
        group, base = start_stack(tmp_path_factory.mktemp("fuzz"), tiny_model_dir, run, max_batch_size=4,
                                  max_model_len=MAX_MODEL_LEN)
        engine, frontend = group.procs
        try:
            with httpx.Client(base_url=base, timeout=60) as http:
                yield http, engine, frontend
        finally:
            group.close()
    finally:
        shutil.rmtree(run, ignore_errors=True)


# ---------------------------------------------------------------------- strategies
#
# Each endpoint gets three kinds of body, in equal measure: VALID (every field drawn
# from its accepted range, so most reach the engine), MUTATED (a valid body with one
# field replaced by any JSON value) and CHAOS (every field plausible-or-anything).

EDGE_INTS = [0, 1, -1, 2, 16, VOCAB - 1, VOCAB, MAX_MODEL_LEN, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
WORDS = st.text(max_size=24)  # any Unicode except lone surrogates
TEXT = WORDS | st.text(st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010), max_size=4)  # with surrogates
SCALARS = (st.none() | st.booleans() | st.integers() | st.sampled_from(EDGE_INTS)
           | st.floats(allow_nan=True, allow_infinity=True) | TEXT)
ANY_JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4),
                        max_leaves=8)


def field(*plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a plausible value, sometimes anything at all."""
    return st.one_of(*plausible, *plausible, ANY_JSON)


TINY = st.sampled_from([5e-324, 1e-300, 1e-40, 1e-8])  # float32 underflow: 0 where a division follows
IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
# accepted prompt text: some letter or digit, so that it tokenizes to at least one token
# (the tokenizer drops a control character such as "\x16", and the server then answers
# 400 "the prompt is empty after tokenization", as it should)
PROMPT_WORDS = WORDS.filter(lambda s: any(c.isalnum() for c in s))
ANY_IDS = st.lists(st.integers(-2, VOCAB + 2) | st.integers(0, VOCAB - 1), max_size=12)
STOP = st.text(min_size=1, max_size=6)
PARTS = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": WORDS}), min_size=1, max_size=2)
ROLES = ["system", "user", "assistant"]
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": WORDS | PARTS | st.none()}),
                    min_size=1, max_size=3).map(lambda ms: [*ms, {"role": "user", "content": "hi"}])
ANY_MESSAGES = st.lists(st.fixed_dictionaries({
    "role": field(st.sampled_from([*ROLES, "tool", "developer", "wizard"])),
    "content": field(TEXT, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                           "text": TEXT}), max_size=2))}), max_size=3)

# field: (accepted values, plausible values in or just out of range)
SAMPLING = {
    "model": (st.sampled_from(["", None]), st.sampled_from(["", "nope"])),
    "max_tokens": (st.integers(1, 8), st.integers(-1, 8)),
    "temperature": (st.floats(0, 2) | TINY, st.floats(0, 2.5)),
    "top_p": (st.floats(0.01, 1) | TINY, st.floats(0, 1.1)),
    "top_k": (st.integers(-1, VOCAB + 10), st.integers(-2, VOCAB + 10)),
    "min_p": (st.floats(0, 1) | TINY, st.floats(0, 1.1)),
    "seed": (st.integers(-(2**63), 2**63 - 1), st.integers(-(2**64), 2**64)),
    "presence_penalty": (st.floats(-2, 2), st.floats(-2.5, 2.5)),
    "frequency_penalty": (st.floats(-2, 2), st.floats(-2.5, 2.5)),
    "repetition_penalty": (st.floats(0.05, 2), st.floats(0, 2.5) | TINY),
    "logit_bias": (st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
                   st.dictionaries(st.integers(-1, VOCAB + 1).map(str) | TEXT, st.floats(-150, 150), max_size=4)),
    "stop": (STOP | st.lists(STOP, max_size=3), TEXT | st.lists(TEXT, max_size=3)),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=3), ANY_IDS),
    "ignore_eos": (st.booleans(), st.booleans()),
    "min_tokens": (st.integers(0, 2), st.integers(-1, 10)),
    "n": (st.integers(1, 3), st.integers(0, 3)),
    "stream": (st.booleans(), st.booleans()),
    "user": (WORDS, TEXT),
    "priority": (st.integers(-5, 5), st.integers(-5, 5)),
    "include_stop_str_in_output": (st.booleans(), st.booleans()),
    "skip_special_tokens": (st.booleans(), st.booleans()),
    "return_tokens_as_token_ids": (st.booleans(), st.booleans()),
}
COMPLETION = {
    **SAMPLING,
    "prompt": (PROMPT_WORDS | st.lists(PROMPT_WORDS, min_size=1, max_size=3) | IDS
               | st.lists(IDS, min_size=1, max_size=2),
               TEXT | st.lists(TEXT, max_size=3) | ANY_IDS | st.lists(ANY_IDS, max_size=3)),
    "echo": (st.booleans(), st.booleans()),
    "logprobs": (st.integers(0, 20), st.integers(-1, 22)),
}
CHAT = {
    **SAMPLING,
    "messages": (MESSAGES, ANY_MESSAGES),
    "max_completion_tokens": (st.integers(1, 8), st.integers(-1, 8)),
    "logprobs": (st.booleans(), st.booleans()),
    "top_logprobs": (st.integers(0, 20), st.integers(-1, 22)),
    "add_generation_prompt": (st.booleans(), st.booleans()),
}
CHAT_CHAOS_ONLY = {
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "tools": st.lists(ANY_JSON, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto"]),
    "best_of": st.integers(0, 3),
    "suffix": TEXT,
}
TOKENIZE = {"model": SAMPLING["model"], "prompt": (WORDS, TEXT), "messages": (MESSAGES, ANY_MESSAGES),
            "add_special_tokens": (st.booleans(), st.booleans()),
            "add_generation_prompt": (st.booleans(), st.booleans())}
DETOKENIZE = {"model": SAMPLING["model"], "tokens": (IDS, ANY_IDS)}


def consistent(body: dict) -> dict:
    """Drop the cross-field conflicts that independent draws make: top_logprobs
    without logprobs, min_tokens above the token limit."""
    if body.get("logprobs") is not True:
        body.pop("top_logprobs", None)
    limits = [body[k] for k in ("max_tokens", "max_completion_tokens") if k in body]
    if limits and body.get("min_tokens", 0) > min(limits):
        body["min_tokens"] = min(limits)
    return body


def valid_bodies(fields: dict, required: tuple[str, ...]) -> st.SearchStrategy:
    return st.fixed_dictionaries({k: fields[k][0] for k in required},
                                 optional={k: v[0] for k, v in fields.items() if k not in required}).map(consistent)


def bodies(fields: dict, required: tuple[str, ...]) -> st.SearchStrategy:
    valid = valid_bodies(fields, required)
    mutated = st.builds(lambda body, key, value: {**body, key: value},
                        valid, st.sampled_from(sorted(fields)), ANY_JSON)
    chaos = st.fixed_dictionaries({}, optional={**{k: field(v[1]) for k, v in fields.items()},
                                                **{k: field(v) for k, v in CHAT_CHAOS_ONLY.items()}})
    return st.one_of(valid, mutated, chaos | ANY_JSON)


def with_usage_when_streaming(body):
    if isinstance(body, dict) and body.get("stream") is True and "stream_options" not in body:
        return {**body, "stream_options": {"include_usage": True}}
    return body


REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), bodies(COMPLETION, ("prompt",)).map(with_usage_when_streaming)),
    st.tuples(st.just("/v1/chat/completions"), bodies(CHAT, ("messages",)).map(with_usage_when_streaming)),
    st.tuples(st.just("/tokenize"), bodies({k: v for k, v in TOKENIZE.items() if k != "messages"}, ("prompt",))
              | bodies({k: v for k, v in TOKENIZE.items() if k != "prompt"}, ("messages",))),
    st.tuples(st.just("/detokenize"), bodies(DETOKENIZE, ("tokens",))),
)
VALID_REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), valid_bodies(COMPLETION, ("prompt",)).map(with_usage_when_streaming)),
    st.tuples(st.just("/v1/chat/completions"), valid_bodies(CHAT, ("messages",)).map(with_usage_when_streaming)),
)
PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])


# ---------------------------------------------------------------------- checks


def check_response(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        body = resp.json()
        assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        return
    assert resp.status_code == 200, resp.status_code
    if resp.headers["content-type"].startswith("text/event-stream"):
        datas = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert datas and datas[-1] == "[DONE]", datas[-3:]
        for data in datas[:-1]:
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
    else:
        resp.json()


def dumps(body) -> bytes:
    """JSON as a client may send it: NaN and Infinity as bare words, lone surrogates
    as \\ud800 escapes."""
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


FUZZ = settings(max_examples=200, deadline=None, derandomize=False, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_random_bodies_never_5xx_and_engine_returns_to_baseline(server):
    http, engine, frontend = server
    before = stats_of(http)
    seen: Counter[tuple[str, int]] = Counter()

    @FUZZ
    @given(REQUESTS)
    def run(request):
        path, body = request
        resp = http.post(path, content=dumps(body), headers={"content-type": "application/json"})
        seen[path, resp.status_code] += 1
        check_response(resp)

    run()
    print(sorted(seen.items()))

    # The mix above leans on validation; these reach the engine. Every body drawn
    # from the accepted ranges must be served, sampled, streamed and finished.
    @settings(FUZZ, max_examples=50)
    @given(VALID_REQUESTS)
    def accepted(request):
        path, body = request
        resp = http.post(path, content=dumps(body), headers={"content-type": "application/json"})
        assert resp.status_code == 200, (body, resp.text[:300])
        check_response(resp)

    accepted()

    @settings(FUZZ, max_examples=40)
    @given(PATHS, st.binary(max_size=64) | st.builds(lambda b, k: dumps(b)[:k], REQUESTS, st.integers(0, 60)))
    def raw(path, content):
        check_response(http.post(path, content=content, headers={"content-type": "application/json"}))

    raw()

    assert engine.alive() and frontend.alive()
    wait_for(lambda: at_baseline(http), 15, 0.1, "engine back at baseline after the fuzz run")
    after = stats_of(http)
    assert after["bad_frames"] == before["bad_frames"]  # the frontend never sent the engine garbage
    ok = http.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


def stats_of(http: httpx.Client) -> dict:
    resp = http.get("/scheduler/stats")
    assert resp.status_code == 200, resp.text
    return resp.json()


def at_baseline(http: httpx.Client) -> bool:
    s = stats_of(http)
    return (s["num_active"] == 0 and s["num_pending"] == 0 and s["num_prefilling"] == 0
            and s["active_kv_reserved"] == 0 and s["blocks"]["num_used_blocks"] == 0
            and s["num_waiting"] == 0)

