"""OpenAI tool calling in the Hermes style: the prompt, the constraint, the parser.

The prompt: requests with ``tools`` (or a conversation carrying ``tool_calls`` or
``tool`` turns) are rendered with ``--chat-template FILE`` if one is given, else with
the packaged Hermes-style template (``templates/hermes_tools.jinja``: the tools listed
in the system turn; the model answers ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``), since the default model's own template has no ``tools`` variable.

``tool_choice``:

* ``none``: no tools in the prompt, plain text out;
* ``auto``: the model decides; its text is parsed for ``<tool_call>`` blocks
  (``--enable-auto-tool-choice`` with ``--tool-call-parser hermes``, as vLLM);
* ``required`` / a named function: the output is constrained by a grammar to one (or,
  with ``parallel_tool_calls``, several) ``<tool_call>`` blocks whose JSON is
  ``{"name": <one of the tools>, "arguments": <that tool's parameters schema>}``,
  so it always parses and its arguments always validate.

Parsing is one incremental parser (:class:`ToolCallParser`) for the stream and the
whole response alike: content outside the blocks stays content, each block becomes a
call (``id`` ``call_…``, ``function.name``, ``function.arguments`` as a JSON string);
in a stream, a call's id and name come first, then its arguments in pieces.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from shared.constraints import JSON_OPTIONS, Constraint, ConstraintKind

TOOL_TEMPLATE = Path(__file__).resolve().parent / "templates" / "hermes_tools.jinja"
PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mode_of(body) -> str | None:
    """``None`` (no tools in play), ``"auto"``, ``"required"`` or ``"named"``."""
    if not body.tools or body.tool_choice == "none":
        return None
    if body.tool_choice in (None, "auto"):
        return "auto"
    return "required" if body.tool_choice == "required" else "named"


def _call_schema(tool) -> dict:
    params = tool.function.parameters or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_constraint(body) -> Constraint:
    """The grammar for ``required`` / named ``tool_choice``: Hermes blocks whose JSON
    names one of the (or the named) tools with arguments of its schema."""
    tools = body.tools
    if body.tool_choice not in ("required",):
        tools = [t for t in tools if t.function.name == body.tool_choice.function.name]
    schemas = [_call_schema(t) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    many = body.parallel_tool_calls is not False and body.tool_choice == "required"
    start = 'start: call ("\\n" call)*' if many else "start: call"
    lark = f'{start}\ncall: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
    return Constraint(ConstraintKind.GRAMMAR, lark)


def conversation(messages) -> list[dict]:
    """Chat messages as the templates read them: an assistant turn's calls with their
    arguments parsed (a template renders them as JSON), a tool turn with its call id."""
    out = []
    for m in messages:
        turn: dict = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            calls = []
            for call in m.tool_calls:
                try:
                    args = json.loads(call.function.arguments)
                except ValueError:
                    args = call.function.arguments
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": args}})
            turn["tool_calls"] = calls
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            turn["name"] = m.name
        out.append(turn)
    return out


def uses_tools(body) -> bool:
    """The conversation needs a template that knows tools."""
    return bool(body.tools and body.tool_choice != "none") or any(
        m.tool_calls or m.role == "tool" for m in body.messages)


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""  # the pieces streamed so far, concatenated

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for k in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:k]):
            return k
    return 0


def _args_end(block: str) -> int:
    """Where a call's arguments end in ``block`` (the text after the header): before the
    outer object's closing brace, trailing whitespace and a partial closing tag."""
    end = len(block) - _partial_suffix(block, CLOSE)
    text = block[:end].rstrip()
    if text.endswith("}"):
        text = text[:-1].rstrip()
    return len(text)


@dataclass
class ToolCallParser:
    """Incremental Hermes parser: :meth:`push` text deltas, :meth:`finish` at the end.

    Both return delta events: ``("content", text)``, ``("call", index)`` (a new call:
    id and name known), ``("arguments", index, piece)``. ``calls`` holds every call;
    ``content`` every content piece. Arguments pieces concatenate to the call's
    arguments, JSON text (trailing whitespace and the block's own closing brace are
    held back until they are known not to be part of them).
    """

    calls: list[ParsedCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    _pending: str = ""
    _state: str = "out"  # out | head (inside a block, name not known) | args

    def push(self, text: str) -> list[tuple]:
        self._pending += text
        events: list[tuple] = []
        while True:
            before = (self._state, len(self._pending))
            if self._state == "out":
                self._out(events)
            elif self._state == "head":
                self._head(events)
            else:
                self._args(events)
            if (self._state, len(self._pending)) == before:
                return events

    def _out(self, events: list) -> None:
        at = self._pending.find(OPEN)
        if at >= 0:
            self._content(events, self._pending[:at])
            self._pending, self._state = self._pending[at + len(OPEN):], "head"
            return
        keep = _partial_suffix(self._pending, OPEN)
        self._content(events, self._pending[:len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]

    def _head(self, events: list) -> None:
        m = _HEADER.match(self._pending)
        if m:
            self.calls.append(ParsedCall(new_call_id(), json.loads(f'"{m.group(1)}"')))
            events.append(("call", len(self.calls) - 1))
            self._pending, self._state = self._pending[m.end():], "args"
            return
        close = self._pending.find(CLOSE)
        if close >= 0:  # a block whose name does not come first: parse it whole
            self._whole_block(events, self._pending[:close])
            self._pending, self._state = self._pending[close + len(CLOSE):], "out"

    def _args(self, events: list) -> None:
        call = self.calls[-1]
        if not call.arguments:  # whitespace between the header and the arguments is neither
            self._pending = self._pending.lstrip()
        close = self._pending.find(CLOSE)
        block = self._pending if close < 0 else self._pending[:close]
        end = _args_end(block) if close < 0 else len(_strip_outer(block))
        if end > len(call.arguments):
            piece = block[len(call.arguments):end]
            call.arguments += piece
            events.append(("arguments", len(self.calls) - 1, piece))
        if close >= 0:
            self._pending, self._state = self._pending[close + len(CLOSE):], "out"

    def _whole_block(self, events: list, block: str) -> None:
        try:
            obj = json.loads(block)
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            self._content(events, OPEN + block + CLOSE)  # not a call: leave it as the model wrote it
            return
        call = ParsedCall(new_call_id(), name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        self.calls.append(call)
        events += [("call", len(self.calls) - 1), ("arguments", len(self.calls) - 1, call.arguments)]

    def _content(self, events: list, text: str) -> None:
        if text:
            self.content.append(text)
            events.append(("content", text))

    def finish(self) -> list[tuple]:
        """The output ended: whatever was held back (an unclosed block closes here)."""
        if self._state == "args":
            return self.push(CLOSE)
        events: list[tuple] = []
        if self._state == "head":
            self._whole_block(events, self._pending)
        else:
            self._content(events, self._pending)
        self._pending, self._state = "", "out"
        return events

    @property
    def text(self) -> str | None:
        """The content outside the calls, stripped; None if there is none."""
        text = "".join(self.content).strip()
        return text or None


def _strip_outer(block: str) -> str:
    text = block.rstrip()
    return text[:-1].rstrip() if text.endswith("}") else text


def parse(text: str) -> ToolCallParser:
    """The whole response at once (same rules as the stream)."""
    parser = ToolCallParser()
    parser.push(text)
    parser.finish()
    return parser
