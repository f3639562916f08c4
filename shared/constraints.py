"""A structured-output constraint as it crosses the process boundary: its source text.

A :class:`Constraint` is a ``kind`` and a ``text`` — a JSON schema, a regular
expression, a JSON list of choices or a Lark/EBNF grammar — never a compiled object.
It travels inside :class:`~shared.protocol.SamplingParams` and is checked field by field
when a frame is decoded (kind in :class:`ConstraintKind`, text at most
:data:`MAX_CONSTRAINT_CHARS` characters) and again by :meth:`Constraint.validate`
(the text parses as its kind says). Both the frontend (to answer a bad one with a 400)
and the engine (to build the token matcher) turn it into llguidance's grammar with
:func:`grammar_source`, so both compile exactly the same thing.

JSON output is compact and bounded (``{"a": 1, "b": [1, 2]}``: one space after ``:``
and ``,``, no other whitespace): a small model given free whitespace can spend its
whole ``max_tokens`` on newlines.
"""

from __future__ import annotations

import enum
import hashlib
import json
from typing import Annotated

from msgspec import Meta, Struct

MAX_CONSTRAINT_CHARS = 256 * 1024  # characters of source text (schema, regex, choices, grammar)
MAX_CHOICES = 1024

# llguidance's JSON compile options for every JSON constraint (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintKind(str, enum.Enum):
    """What ``Constraint.text`` holds."""

    JSON_SCHEMA = "json_schema"  # a JSON schema (a JSON object, as text)
    JSON_OBJECT = "json_object"  # any JSON object; text is empty
    REGEX = "regex"  # a regular expression (Rust regex syntax), matched in full
    CHOICE = "choice"  # a JSON list of strings; the output is exactly one of them
    GRAMMAR = "grammar"  # a Lark grammar, or llama.cpp's GBNF (EBNF), as llguidance accepts


class Constraint(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The output must match ``text`` read as ``kind``."""

    kind: ConstraintKind
    text: Annotated[str, Meta(max_length=MAX_CONSTRAINT_CHARS)] = ""

    def validate(self) -> str | None:
        """A human-readable problem with this constraint's fields, or ``None``.

        Checks types, size and that the text parses as its kind (JSON for a schema or
        choices); whether the grammar compiles is :func:`grammar_problem`'s question.
        """
        if not isinstance(self.kind, ConstraintKind):
            return "constraint kind must be one of " + ", ".join(k.value for k in ConstraintKind)
        if not isinstance(self.text, str):
            return "constraint text must be a string"
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            return f"constraint text exceeds {MAX_CONSTRAINT_CHARS} characters"
        if self.kind is ConstraintKind.JSON_OBJECT:
            return None if not self.text else "a json_object constraint has no text"
        if not self.text:
            return f"a {self.kind.value} constraint needs its text"
        if self.kind is ConstraintKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.text)
            except (ValueError, RecursionError) as exc:
                return f"the JSON schema is not valid JSON: {exc}"
            if not isinstance(schema, (dict, bool)):
                return "a JSON schema must be a JSON object (or a boolean)"
        if self.kind is ConstraintKind.CHOICE:
            try:
                choices = json.loads(self.text)
            except (ValueError, RecursionError) as exc:
                return f"the choices are not valid JSON: {exc}"
            if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in choices)):
                return f"choices must be a list of 1 to {MAX_CHOICES} non-empty strings"
        return None

    @property
    def key(self) -> str:
        """Cache key: a hex SHA-256 of kind and text."""
        return hashlib.sha256(f"{self.kind.value}\0{self.text}".encode("utf-8", "surrogatepass")).hexdigest()


COMPILE_FAILED = "the constraint does not compile"  # how the engine's error for such a request begins


class ConstraintError(ValueError):
    """A constraint that does not compile; the message names the problem."""


def grammar_source(constraint: Constraint) -> str:
    """llguidance's grammar (a string ``LLMatcher`` takes) for ``constraint``.

    Raises :class:`ConstraintError` for text that is not of its kind (not JSON, an
    unknown grammar syntax); whether the grammar compiles is checked by
    :func:`grammar_problem` or when a matcher is built.
    """
    import llguidance

    problem = constraint.validate()
    if problem:
        raise ConstraintError(problem)
    kind, text = constraint.kind, constraint.text
    try:
        if kind is ConstraintKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if kind is ConstraintKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        if kind is ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind is ConstraintKind.CHOICE:
            return llguidance.grammar_from("choice", text)
        return llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    except Exception as exc:  # noqa: BLE001 - ValueError mostly; GBNF conversion may raise others
        raise ConstraintError(str(exc) or type(exc).__name__) from None


def grammar_problem(constraint: Constraint, tokenizer=None) -> str | None:
    """Compile ``constraint`` (with ``tokenizer``, an ``llguidance.LLTokenizer``, if
    given) and return its first error in one line of at most 500 characters, or ``None``."""
    import llguidance

    try:
        grammar = grammar_source(constraint)
    except ConstraintError as exc:
        return str(exc)[:500]
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    except Exception as exc:  # noqa: BLE001 - whatever the library raises is this grammar's problem
        error = f"the grammar does not compile: {exc}"
    if error and not error.startswith("WARNING"):
        return " ".join(error.split())[:500]
    return None
