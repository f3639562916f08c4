"""Structured outputs and tool calls over HTTP, on the tiny random model (real processes):
OpenAI's ``response_format`` and ``tools``, vLLM's ``guided_*`` and
``structured_outputs``, the 400s a bad constraint gets before the engine, streamed
tool-call deltas, unknown fields logged, malformed constraint frames refused by the
engine that goes on serving."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import jsonschema
import msgspec
import pytest
import zmq

from shared import codec
from shared import protocol as p
from tests.procs import ProcessGroup, free_port, http_json, stats, wait_for, wait_healthy

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    """Engine + a frontend with --enable-auto-tool-choice + one without; a raw PUSH socket."""
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    group = ProcessGroup(tmp_path_factory.mktemp("structured"))
    group.engine(tiny_model_dir, run, max_batch_size=8)
    port, plain_port = free_port(), free_port()
    fe = group.frontend(tiny_model_dir, run, port, enable_auto_tool_choice=True, tool_call_parser="hermes")
    group.frontend(tiny_model_dir, run, plain_port)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(f"ipc://{run}/input.sock")
    base, plain = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{plain_port}"
    try:
        wait_healthy(base, 120)
        wait_healthy(plain, 60)
        yield base, plain, push, fe
    finally:
        push.close(0)
        ctx.term()
        group.close()
        shutil.rmtree(run, ignore_errors=True)


def chat(base, **body):
    status, out, _ = http_json(f"{base}/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 60,
                                                               "temperature": 0, **body}, timeout=120)
    return status, out


def sse_chunks(base, path, body) -> list[dict]:
    import httpx

    chunks = []
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def valid_or_cut(text: str, finish: str, schema: dict) -> None:
    if finish == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:
        assert finish == "length" and text.startswith("{")


@pytest.mark.parametrize("field", ["response_format", "guided_json", "structured_outputs"])
def test_json_schema_on_chat_and_completions(stack, field):
    base = stack[0]
    value = {"response_format": {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA,
                                                                         "strict": True}},
             "guided_json": SCHEMA, "structured_outputs": {"json": SCHEMA}}[field]
    status, out = chat(base, **{field: value})
    assert status == 200, out
    valid_or_cut(out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"], SCHEMA)
    status, out, _ = http_json(f"{base}/v1/completions", {"prompt": "Verdict:", "max_tokens": 40, "temperature": 0,
                                                          field: value}, timeout=120)
    assert status == 200, out
    valid_or_cut(out["choices"][0]["text"], out["choices"][0]["finish_reason"], SCHEMA)


def test_json_object_regex_choice_and_grammar(stack):
    base = stack[0]
    status, out = chat(base, response_format={"type": "json_object"}, max_tokens=200)
    assert status == 200, out
    if out["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict)
    status, out = chat(base, guided_regex=r"[A-Z]{2}-[0-9]{3}")
    assert status == 200 and re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out["choices"][0]["message"]["content"]), out
    status, out = chat(base, structured_outputs={"choice": ["red", "green", "blue"]}, n=3, temperature=1.0, seed=1)
    assert status == 200 and all(c["message"]["content"] in ("red", "green", "blue") for c in out["choices"]), out
    status, out, _ = http_json(f"{base}/v1/completions", {"prompt": "Sum:", "max_tokens": 30, "temperature": 0,
                                                          "guided_grammar": 'start: /[1-9]/ " + " /[1-9]/'})
    assert status == 200 and re.fullmatch(r"[1-9] \+ [1-9]", out["choices"][0]["text"]), out


def test_constrained_logprobs_and_stop_strings(stack):
    base = stack[0]
    status, out = chat(base, guided_choice=["alpha beta", "gamma"], logprobs=True, top_logprobs=3)
    assert status == 200, out
    content = out["choices"][0]["logprobs"]["content"]
    assert content and all(e["logprob"] > -50 for e in content)
    # a stop string applies to the detokenized constrained text, as in vLLM: cut there, finish "stop"
    status, out = chat(base, guided_regex="abc-def-ghi", stop=["-def"])
    assert status == 200 and out["choices"][0]["message"]["content"] == "abc", out
    assert out["choices"][0]["finish_reason"] == "stop"


def test_bad_constraints_are_400s_naming_the_problem_before_the_engine(stack):
    base = stack[0]
    before = stats(base)
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format", "strin"),
        ({"guided_regex": "[a-"}, "guided_regex", "regex"),
        ({"guided_json": SCHEMA, "guided_regex": "a+"}, "guided_regex", "at most one"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "at most one"),
        ({"guided_choice": []}, "guided_choice", ""),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", ""),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "xml"}}, "response_format", ""),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "nope"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "at most one"),
    ]
    for extra, param, says in cases:
        status, out = chat(base, **extra)
        assert status == 400, (extra, out)
        assert out["error"]["param"] == param and says in out["error"]["message"], (extra, out)
        assert out["error"]["type"] == "invalid_request_error"
    status, out, _ = http_json(f"{base}/v1/completions", {"prompt": "x", "guided_regex": "("})
    assert status == 400 and out["error"]["param"] == "guided_regex"
    after = stats(base)
    assert after["num_finished"] == before["num_finished"] and after["num_rejected"] == before["num_rejected"]


def assert_calls_valid(calls, tools, one=False):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls and (len(calls) == 1 or not one)
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_always_parse(stack, choice):
    base = stack[0]
    status, out = chat(base, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False, max_tokens=80)
    assert status == 200, out
    c = out["choices"][0]
    if c["finish_reason"] == "length":
        pytest.skip("the random model ran out of tokens inside its call")  # bounded schemas make this rare
    assert c["finish_reason"] == "tool_calls", c
    assert_calls_valid(c["message"]["tool_calls"], [WEATHER, TIME], one=True)
    if isinstance(choice, dict):
        assert c["message"]["tool_calls"][0]["function"]["name"] == "get_time"


def test_streamed_tool_call_deltas_assemble_into_the_same_calls(stack):
    base = stack[0]
    body = {"messages": MESSAGES, "max_tokens": 80, "temperature": 0, "tools": [WEATHER, TIME],
            "tool_choice": "required", "parallel_tool_calls": False}
    whole = chat(base, **{k: v for k, v in body.items() if k != "messages"})[1]["choices"][0]
    chunks = sse_chunks(base, "/v1/chat/completions", body)
    calls: dict[int, dict] = {}
    finish = None
    for ch in chunks:
        for choice in ch["choices"]:
            for tc in choice["delta"].get("tool_calls") or []:
                if "id" in tc:  # the first delta of a call: id and name, then arguments in pieces
                    assert tc["index"] not in calls and tc["function"]["name"]
                    calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
                calls[tc["index"]]["arguments"] += tc["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    if whole["finish_reason"] == "length":
        pytest.skip("the random model ran out of tokens inside its call")
    assert finish == "tool_calls"
    pieces = sum(1 for ch in chunks for c in ch["choices"] for tc in c["delta"].get("tool_calls") or []
                 if "id" not in tc)
    assert pieces >= 2  # arguments arrive in pieces, not at the end
    streamed = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(calls.items())]
    assert_calls_valid(streamed, [WEATHER, TIME], one=True)
    want = whole["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want]


def test_auto_tool_choice_needs_the_flag_and_parses_the_models_text(stack):
    base, plain = stack[0], stack[1]
    status, out = chat(plain, tools=[WEATHER])  # tool_choice defaults to auto with tools
    assert status == 400 and "--enable-auto-tool-choice" in out["error"]["message"], out
    status, out = chat(plain, tools=[WEATHER], tool_choice="none")
    assert status == 200 and "tool_calls" not in out["choices"][0]["message"]
    status, out = chat(base, tools=[WEATHER], tool_choice="auto", max_tokens=20)
    assert status == 200, out  # the random model writes no <tool_call>: plain content, finish stop/length
    assert out["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_conversation_with_tool_calls_and_tool_results_renders(stack):
    base = stack[0]
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    status, out, _ = http_json(f"{base}/v1/chat/completions", {"messages": messages, "tools": [WEATHER],
                                                               "max_tokens": 5}, timeout=60)
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] > 150  # the tools and the turns are in the prompt


def test_unknown_fields_are_logged_with_their_names(stack):
    base, fe = stack[0], stack[3]
    status, _ = chat(base, max_tokens=2, guided_jsn={"type": "object"}, frobnicate=1)
    assert status == 200
    wait_for(lambda: "The following fields were present in the request but ignored: ['frobnicate', 'guided_jsn']"
             in fe.output(), 10, what="the ignored fields logged")


@pytest.mark.parametrize("wire", [["json_schema", "{" * 10], ["grammarz", "x"], ["regex", 5],
                                  ["regex", "a" * (300 * 1024)]])
def test_malformed_constraint_frames_are_refused_and_the_engine_serves_on(stack, wire):
    base, _, push, _ = stack
    before = stats(base)
    params = msgspec.msgpack.decode(msgspec.msgpack.encode(p.SamplingParams(max_tokens=2)))
    params += [None] * (len(p.SamplingParams.__struct_fields__) - len(params))
    params[p.SamplingParams.__struct_fields__.index("constraint")] = wire
    frame = msgspec.msgpack.decode(codec.encode(p.Submit("bad-c", "nobody", [1, 2, 3], p.SamplingParams())))
    frame[4] = params
    push.send(msgspec.msgpack.encode(frame))
    if wire[0] == "json_schema":  # decodes, but its text is not a schema: refused at validation
        wait_for(lambda: stats(base)["rejected_by_code"].get("invalid", 0) > before["rejected_by_code"].get(
            "invalid", 0), 10, what="invalid submit refused")
    else:
        wait_for(lambda: stats(base)["bad_frames"] > before["bad_frames"], 10, what="bad frame counted")
    status, out = chat(base, guided_regex="ok", max_tokens=4)
    assert status == 200 and out["choices"][0]["message"]["content"] == "ok"


def test_a_grammar_only_the_engine_can_refuse_is_still_a_400(stack):
    """``<[999999]>`` names a token id: the frontend's check (no vocabulary) passes it, the
    engine's compile (with the tokenizer) fails the request, and the client gets a 400."""
    base = stack[0]
    status, out = chat(base, guided_grammar="start: <[999999]>")
    assert status == 400, out
    assert out["error"]["code"] == "invalid_constraint" and "does not compile" in out["error"]["message"]
    status, out = chat(base, guided_regex="fine", max_tokens=4)
    assert status == 200 and out["choices"][0]["message"]["content"] == "fine"
