"""Structured outputs and tool calls end to end on the real SmolLM2-135M-Instruct: `tickserve
serve` with two engines and auto tool choice, driven by the official openai client
(``beta.chat.completions.parse`` with a pydantic model, forced and streamed tool calls)."""

from __future__ import annotations

import concurrent.futures
import json

import pytest
from pydantic import BaseModel, Field

from tests.procs import ProcessGroup, free_port, stats, wait_healthy

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smol_dir):
    group = ProcessGroup(tmp_path_factory.mktemp("serve-structured"))
    port = free_port()
    group.spawn(["-m", "shared.cli", "serve", "--port", str(port), "--device", "cpu", "--data-parallel-size", "2",
                 "--torch-threads", "1", "--max-batch-size", "16", "--log-level", "warning",
                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "serve")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 240)
        yield base
    finally:
        group.close()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=180, max_retries=0)


class Capital(BaseModel):
    country: str = Field(max_length=40)  # bounded, so a small model cannot run on inside a string
    city: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=5000)


def test_openai_parse_with_a_pydantic_model(client):
    completion = client.beta.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=80, response_format=Capital,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Capital)
    assert choice.message.parsed.city  # the real model's answer, in the schema's shape


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}


def test_a_forced_tool_call_on_the_real_model(client):
    completion = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "What's the weather like in Paris today?"}])
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_streamed_tool_call_deltas_assemble(client):
    stream = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60, tools=[WEATHER], tool_choice="required", stream=True,
        parallel_tool_calls=False, messages=[{"role": "user", "content": "Weather in Tokyo?"}])
    name, args, finish, pieces = None, "", None, 0
    for chunk in stream:
        if not chunk.choices:
            continue
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.id:
                assert name is None and tc.index == 0
                name = tc.function.name
            elif tc.function and tc.function.arguments:
                pieces += 1
            args += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and name == "get_weather" and pieces >= 2
    assert "city" in json.loads(args)


def test_auto_tool_choice_gives_content_or_valid_calls(client):
    completion = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=80, tools=[WEATHER],
        messages=[{"role": "user", "content": "Use the get_weather tool for Berlin."}])
    choice = completion.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_constrained_requests_across_two_engines(client, server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30},
                                               "confident": {"type": "boolean"}},
              "required": ["answer", "confident"], "additionalProperties": False}

    def one(i: int):
        return client.chat.completions.create(
            model=MODEL, temperature=0.7, seed=i, max_tokens=60, user=f"session-{i}",
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            messages=[{"role": "user", "content": f"Is {i} a prime number? Answer in JSON."}])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    import jsonschema

    for r in results:
        c = r.choices[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), schema)
        else:
            assert c.finish_reason == "length"
    assert sum(r.choices[0].finish_reason == "stop" for r in results) >= 6
    s = stats(server)
    assert s["active_kv_reserved"] == 0 and s["num_active"] == 0
