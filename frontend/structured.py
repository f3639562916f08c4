"""A request's structured-output fields → one :class:`~shared.constraints.Constraint`,
checked here so that a bad one is a 400 before anything reaches the engine.

Accepted, on chat and completions (at most one per request; two or more are a 400):

* OpenAI's ``response_format``: ``{"type": "json_object"}`` and ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (``{"type": "text"}`` is no constraint);
* vLLM's ``guided_json`` (a schema, object or text), ``guided_regex``, ``guided_choice``
  (a list of strings), ``guided_grammar`` (Lark or GBNF);
* vLLM's ``structured_outputs`` object: ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``.

Each distinct constraint is compiled once (without the tokenizer: that is the engine's
work) and its verdict kept in an LRU cache keyed by the constraint's hash, so a client
that repeats a schema pays for it once.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading

from frontend.http_errors import HTTPError
from shared.constraints import MAX_CONSTRAINT_CHARS, Constraint, ConstraintKind, grammar_problem

_CACHE_SIZE = 1024
_verdicts: collections.OrderedDict[str, str | None] = collections.OrderedDict()
_lock = threading.Lock()


def _text(value, what: str, param: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        raise HTTPError(400, f"{what} is not JSON", param=param) from None


def constraints_of(body) -> list[tuple[str, Constraint]]:
    """Every constraint the request asks for, as ``(param, constraint)``."""
    found: list[tuple[str, Constraint]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Constraint(ConstraintKind.JSON_OBJECT)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise HTTPError(400, 'response_format {"type": "json_schema"} needs json_schema.schema',
                            param="response_format")
        found.append(("response_format", Constraint(ConstraintKind.JSON_SCHEMA, _text(
            rf.json_schema.schema_, "response_format.json_schema.schema", "response_format"))))
    if body.guided_json is not None:
        found.append(("guided_json", Constraint(ConstraintKind.JSON_SCHEMA,
                                                _text(body.guided_json, "guided_json", "guided_json"))))
    if body.guided_regex is not None:
        found.append(("guided_regex", Constraint(ConstraintKind.REGEX, body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", Constraint(ConstraintKind.CHOICE, json.dumps(body.guided_choice))))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", Constraint(ConstraintKind.GRAMMAR, body.guided_grammar)))
    so = body.structured_outputs
    if so is not None:
        if so.json_ is not None:
            found.append(("structured_outputs", Constraint(ConstraintKind.JSON_SCHEMA,
                                                           _text(so.json_, "structured_outputs.json",
                                                                 "structured_outputs"))))
        if so.regex is not None:
            found.append(("structured_outputs", Constraint(ConstraintKind.REGEX, so.regex)))
        if so.choice is not None:
            found.append(("structured_outputs", Constraint(ConstraintKind.CHOICE, json.dumps(so.choice))))
        if so.grammar is not None:
            found.append(("structured_outputs", Constraint(ConstraintKind.GRAMMAR, so.grammar)))
        if so.json_object:
            found.append(("structured_outputs", Constraint(ConstraintKind.JSON_OBJECT)))
    return found


def one_constraint(found: list[tuple[str, Constraint]]) -> tuple[str, Constraint] | None:
    """The request's one constraint, or None; more than one is a 400 naming them."""
    if len(found) > 1:
        names = ", ".join(dict.fromkeys(param for param, _ in found))
        raise HTTPError(400, f"a request takes at most one structured-output constraint; this one has "
                             f"{len(found)} ({names})", param=found[1][0])
    return found[0] if found else None


def verdict(constraint: Constraint) -> str | None:
    """The constraint's compile problem, or None (cached by its hash)."""
    key = constraint.key
    with _lock:
        if key in _verdicts:
            _verdicts.move_to_end(key)
            return _verdicts[key]
    problem = grammar_problem(constraint)
    with _lock:
        _verdicts[key] = problem
        while len(_verdicts) > _CACHE_SIZE:
            _verdicts.popitem(last=False)
    return problem


async def checked(param: str, constraint: Constraint) -> Constraint:
    """``constraint`` if it compiles; else a 400 naming ``param`` and the compiler's
    message. A first-seen constraint is compiled on a worker thread (a large schema can
    take tens of milliseconds), never on the event loop."""
    if len(constraint.text) > MAX_CONSTRAINT_CHARS:
        raise HTTPError(400, f"{param}: the constraint exceeds {MAX_CONSTRAINT_CHARS} characters", param=param)
    problem = constraint.validate()
    if problem is None:
        with _lock:
            cached = constraint.key in _verdicts
        problem = verdict(constraint) if cached else await asyncio.to_thread(verdict, constraint)
    if problem:
        raise HTTPError(400, f"{param}: {problem}", param=param, code="invalid_constraint")
    return constraint


async def request_constraint(body) -> Constraint | None:
    """The request's checked constraint (HTTP 400 for two, or one that does not compile)."""
    one = one_constraint(constraints_of(body))
    return None if one is None else await checked(*one)
