"""Tool calling's pieces without processes: the Hermes parser on known model outputs
(whole and streamed in random pieces), the packaged tool template, the forced-choice
grammar, the structured-output fields → one constraint, and the new settings."""

from __future__ import annotations

import asyncio
import json
import random

import llguidance
import llguidance.hf
import pytest

from frontend import tool_calls
from frontend.http_errors import HTTPError
from frontend.schemas import ChatCompletionRequest, CompletionRequest
from frontend.structured import request_constraint
from shared import config as cfg
from shared.constraints import ConstraintKind, grammar_source

# What Hermes-format models write (Hermes 2 Pro / Qwen 2.5 style), with the calls they mean.
KNOWN = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    ('Let me check.\n<tool_call>\n{"name": "search", "arguments": {"q": "a } tricky {\\"brace\\""}}\n</tool_call>',
     "Let me check.", [("search", {"q": 'a } tricky {"brace"'})]),
    ('<tool_call>{"name":"a","arguments":{}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": [1, {"y": 2}]}}'
     '</tool_call>', None, [("a", {}), ("b", {"x": [1, {"y": 2}]})]),
    ('<tool_call>\n{"arguments": {"n": 3}, "name": "count"}\n</tool_call>', None, [("count", {"n": 3})]),  # name last
    ('<tool_call>\n{"name": "f", "parameters": {"k": "v"}}\n</tool_call>', None, [("f", {"k": "v"})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}', None, [("get_time", {"zone": "utc"})]),  # EOS
    ("No tools needed: 2 < 3 and <tool> is not a tag.", "No tools needed: 2 < 3 and <tool> is not a tag.", []),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
]


@pytest.mark.parametrize("text, content, calls", KNOWN)
def test_known_model_outputs_parse(text, content, calls):
    parsed = tool_calls.parse(text)
    assert parsed.text == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in parsed.calls)
    assert len({c.id for c in parsed.calls}) == len(parsed.calls)


@pytest.mark.parametrize("text, content, calls", KNOWN)
def test_streamed_in_random_pieces_the_deltas_assemble_into_the_same_calls(text, content, calls):
    for seed in range(40):
        rng = random.Random(seed)
        parser, events, i = tool_calls.ToolCallParser(), [], 0
        while i < len(text):
            k = rng.randint(1, 6)
            events += parser.push(text[i:i + k])
            i += k
        events += parser.finish()
        names, args, texts = {}, {}, []
        for ev in events:
            if ev[0] == "call":
                assert ev[1] not in names and ev[1] == len(names)  # id and name first, in order
                names[ev[1]] = parser.calls[ev[1]].name
                args[ev[1]] = ""
            elif ev[0] == "arguments":
                assert ev[1] in names  # arguments only after their call's name
                args[ev[1]] += ev[2]
            else:
                texts.append(ev[1])
        assert [(names[k], json.loads(args[k])) for k in sorted(names)] == calls
        assert ("".join(texts).strip() or None) == content


def _tools():
    return [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}},
            {"type": "function", "function": {"name": "noop"}}]


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


@pytest.fixture(scope="module")
def llg_tokenizer(smol_tokenizer):
    return llguidance.hf.from_tokenizer(smol_tokenizer)


def _accepts(tokenizer, hf, constraint, text) -> bool:
    m = llguidance.LLMatcher(tokenizer, grammar_source(constraint), log_level=0)
    return m.consume_tokens(hf.encode(text)) and m.is_accepting()


def test_forced_choices_constrain_to_valid_calls(llg_tokenizer, smol_tokenizer):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    noop = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    required = tool_calls.forced_constraint(_chat(tools=_tools(), tool_choice="required"))
    assert required.kind is ConstraintKind.GRAMMAR
    assert _accepts(llg_tokenizer, smol_tokenizer, required, call)
    assert _accepts(llg_tokenizer, smol_tokenizer, required, call + "\n" + noop)  # parallel by default
    assert not _accepts(llg_tokenizer, smol_tokenizer, required, call.replace("get_weather", "get_wether"))
    assert not _accepts(llg_tokenizer, smol_tokenizer, required, call.replace('"Oslo"', "3"))
    single = tool_calls.forced_constraint(_chat(tools=_tools(), tool_choice="required", parallel_tool_calls=False))
    assert not _accepts(llg_tokenizer, smol_tokenizer, single, call + "\n" + noop)
    named = tool_calls.forced_constraint(_chat(tools=_tools(), tool_choice={"type": "function",
                                                                            "function": {"name": "noop"}}))
    assert _accepts(llg_tokenizer, smol_tokenizer, named, noop)
    assert not _accepts(llg_tokenizer, smol_tokenizer, named, call)


def test_the_tool_template_renders_tools_calls_and_results(smol_tokenizer):
    body = _chat(tools=_tools())
    body.messages.extend(ChatCompletionRequest.model_validate({"messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sun"}]}).messages)
    text = smol_tokenizer.apply_chat_template(
        tool_calls.conversation(body.messages), tokenize=False, add_generation_prompt=True,
        chat_template=tool_calls.TOOL_TEMPLATE.read_text(), tools=[t.model_dump(exclude_none=True) for t in body.tools])
    tools_part = text[text.index("<tools>\n"):text.index("\n</tools>")]
    assert '"name": "get_weather"' in tools_part and '"name": "noop"' in tools_part
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert text.count("<|im_start|>tool") == 1  # consecutive results share one tool turn
    assert "<tool_response>\nrain, 4 C\n</tool_response>" in text and "<tool_response>\nsun\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tool_calls.uses_tools(body) and not tool_calls.uses_tools(_chat())
    assert tool_calls.mode_of(_chat(tools=_tools(), tool_choice="none")) is None
    assert tool_calls.mode_of(_chat(tools=_tools())) == "auto"


def test_the_structured_fields_become_one_constraint():
    run = asyncio.run
    c = run(request_constraint(CompletionRequest.model_validate({"prompt": "x", "guided_choice": ["a", "b"]})))
    assert c.kind is ConstraintKind.CHOICE and json.loads(c.text) == ["a", "b"]
    c = run(request_constraint(CompletionRequest.model_validate(
        {"prompt": "x", "structured_outputs": {"json": '{"type": "integer"}'}})))
    assert c.kind is ConstraintKind.JSON_SCHEMA and c.text == '{"type": "integer"}'
    c = run(request_constraint(_chat(response_format={"type": "text"})))
    assert c is None
    with pytest.raises(HTTPError) as err:
        run(request_constraint(CompletionRequest.model_validate({"prompt": "x", "guided_regex": "a",
                                                                 "guided_grammar": "start: \"a\""})))
    assert err.value.status == 400 and "guided_regex, guided_grammar" in err.value.message


def test_the_tool_settings():
    assert "chat_template" in " ".join(cfg.FrontendConfig(chat_template="/nonexistent.jinja").problems())
    assert "tool_call_parser" in " ".join(cfg.FrontendConfig(tool_call_parser="mistral").problems())
    import argparse

    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, cfg.FrontendConfig)
    args = parser.parse_args(["--enable-auto-tool-choice", "--port", "1"])
    assert cfg.build(cfg.FrontendConfig, args).enable_auto_tool_choice is True
    args = parser.parse_args(["--enable-auto-tool-choice", "false"])
    assert cfg.build(cfg.FrontendConfig, args).enable_auto_tool_choice is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--enable-auto-tool-choice", "maybe"])


def test_chat_template_file_replaces_the_models_template_for_every_chat(tmp_path, smol_tokenizer):
    from frontend.context import Frontend
    from frontend.params import chat_prompt

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}]{% endfor %}"
                    "{% if tools %}{{ tools | length }} tools{% endif %}")
    fe = Frontend(cfg.FrontendConfig(chat_template=str(path)), smol_tokenizer, None, "m")
    plain = _chat()
    assert chat_prompt(fe, plain.messages).text == "[user|hi]"
    with_tools = _chat(tools=_tools())
    assert chat_prompt(fe, with_tools.messages, tools=[t.model_dump() for t in with_tools.tools],
                       tool_template=True).text == "[user|hi]2 tools"
    default = Frontend(cfg.FrontendConfig(), smol_tokenizer, None, "m")
    assert chat_prompt(default, plain.messages).text.startswith("<|im_start|>system\nYou are a helpful")
    assert "<tools>" in chat_prompt(default, with_tools.messages, tools=[t.model_dump() for t in with_tools.tools],
                                    tool_template=True).text
