"""Structured outputs in the engine, on the tiny random Llama (SmolLM2's tokenizer):
rows wait for their grammar, one matcher per row, the batch's bitmask, the output rules
(EOS only where the grammar accepts, ``stop`` when it is complete, ``length`` mid-object),
with ``n``, logprobs, prefix caching and every prefill mode."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import llguidance
import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from engine_proc import grammar as grammar_mod
from engine_proc.grammar import GrammarCache, apply_bitmask
from shared import codec
from shared import protocol as p
from shared.constraints import MAX_CONSTRAINT_CHARS, Constraint, ConstraintKind, grammar_problem, grammar_source
from tests.helpers import make_request, make_scheduler, run_until_idle, tokens_of

PROMPT = [1, 17, 250, 3000, 42]


@pytest.fixture(scope="module")
def sched_factory(tiny_llama):
    """Schedulers on one shared grammar cache (the tokenizer is loaded once)."""
    caches: list[GrammarCache] = []

    def make(**overrides):
        sched = make_scheduler(tiny_llama, **overrides)
        if caches:
            sched.grammars = caches[0]
        else:
            caches.append(sched.grammars)
        return sched

    return make


def schema_c(schema) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


def text_of(tok, outputs) -> str:
    ids = tokens_of(outputs)
    if outputs[-1].finish_reason is p.FinishReason.STOP and ids and ids[-1] == 2:
        ids = ids[:-1]  # the EOS that ended it is not text
    return tok.decode(ids)


def fresh_matcher(sched, constraint: Constraint):
    return llguidance.LLMatcher(sched.grammars.tokenizer(), grammar_source(constraint))


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def test_json_schema_rows_sample_valid_json_and_stop(sched_factory, smol_tokenizer):
    sched = sched_factory()
    c = schema_c(PERSON)
    reqs = [make_request(PROMPT, max_tokens=80, constraint=c, temperature=1.0, seed=s) for s in range(6)]
    out = run_until_idle(sched, {0: reqs})
    stopped = 0
    for r in reqs:
        o = out[r.request_id]
        text = text_of(smol_tokenizer, o)
        if o[-1].finish_reason is p.FinishReason.STOP:
            stopped += 1
            jsonschema.validate(json.loads(text), PERSON)
        else:
            assert o[-1].finish_reason is p.FinishReason.LENGTH
            m = fresh_matcher(sched, c)
            assert m.consume_tokens(tokens_of(o)), text  # a prefix the grammar accepts
    assert stopped >= 4  # bounded strings and arrays: most finish


def test_unconstrained_rows_beside_constrained_ones_sample_what_they_sample_alone(sched_factory, monkeypatch):
    plain = make_request(PROMPT, max_tokens=12)
    alone = run_until_idle(sched_factory(), {0: [plain]})
    plain2 = make_request(PROMPT, max_tokens=12)
    constrained = make_request(PROMPT, max_tokens=12, constraint=Constraint(ConstraintKind.REGEX, "[0-9]{3}-[a-z]+"))
    mixed = run_until_idle(sched_factory(), {0: [plain2, constrained]})
    assert tokens_of(mixed[plain2.request_id]) == tokens_of(alone[plain.request_id])

    # and a batch with no constrained row never builds a bitmask
    def boom(*a, **k):
        raise AssertionError("bitmask work for an unconstrained batch")

    monkeypatch.setattr("engine_proc.sampler.fill_bitmask", boom)
    monkeypatch.setattr("engine_proc.sampler.apply_bitmask", boom)
    again = make_request(PROMPT, max_tokens=12)
    assert tokens_of(run_until_idle(sched_factory(), {0: [again]})[again.request_id]) == \
        tokens_of(alone[plain.request_id])


def test_regex_and_choice(sched_factory, smol_tokenizer):
    sched = sched_factory()
    regex = r"(cat|dog)-[0-9]{2,4}"
    choices = ["yes", "no", "maybe later"]
    r1 = make_request(PROMPT, max_tokens=20, constraint=Constraint(ConstraintKind.REGEX, regex))
    r2 = make_request(PROMPT, max_tokens=20, temperature=1.0, seed=3,
                      constraint=Constraint(ConstraintKind.CHOICE, json.dumps(choices)))
    out = run_until_idle(sched, {0: [r1, r2]})
    assert out[r1.request_id][-1].finish_reason is p.FinishReason.STOP
    assert re.fullmatch(regex, text_of(smol_tokenizer, out[r1.request_id]))
    assert out[r2.request_id][-1].finish_reason is p.FinishReason.STOP
    assert text_of(smol_tokenizer, out[r2.request_id]) in choices


def test_a_lark_grammar(sched_factory, smol_tokenizer):
    grammar = 'start: "(" num (" + " num)* ")"\nnum: /[1-9][0-9]?/'
    r = make_request(PROMPT, max_tokens=30, constraint=Constraint(ConstraintKind.GRAMMAR, grammar))
    out = run_until_idle(sched_factory(), {0: [r]})
    text = text_of(smol_tokenizer, out[r.request_id])
    if out[r.request_id][-1].finish_reason is p.FinishReason.STOP:
        assert re.fullmatch(r"\(\d{1,2}( \+ \d{1,2})*\)", text), text
    else:
        assert re.fullmatch(r"\(\d{0,2}( \+ \d{0,2})*", text), text


def test_max_tokens_mid_object_is_length_and_a_prefix_the_grammar_accepts(sched_factory):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 50}
    c = schema_c(schema)
    sched = sched_factory()
    r = make_request(PROMPT, max_tokens=10, constraint=c)
    out = run_until_idle(sched, {0: [r]})[r.request_id]
    assert out[-1].finish_reason is p.FinishReason.LENGTH and len(tokens_of(out)) == 10
    m = fresh_matcher(sched, c)
    assert m.consume_tokens(tokens_of(out)) and not m.is_accepting()


def test_n_siblings_each_have_their_own_matcher(sched_factory, smol_tokenizer):
    """Same prompt, same constraint, different seeds: each sibling's output matches alone
    (one shared matcher would be advanced by every sibling's tokens and fail)."""
    c = Constraint(ConstraintKind.REGEX, "[a-z]{2,6}( [a-z]{2,6}){0,3}\\.")
    sched = sched_factory(prefix_caching=True)
    reqs = [make_request(PROMPT, max_tokens=40, constraint=c, temperature=1.0, seed=s) for s in range(5)]
    out = run_until_idle(sched, {0: reqs})
    texts = set()
    for r in reqs:
        o = out[r.request_id]
        assert o[-1].finish_reason in (p.FinishReason.STOP, p.FinishReason.LENGTH)
        if o[-1].finish_reason is p.FinishReason.STOP:
            assert re.fullmatch("[a-z]{2,6}( [a-z]{2,6}){0,3}\\.", text_of(smol_tokenizer, o))
        texts.add(text_of(smol_tokenizer, o))
    assert len(texts) > 1


def test_logprobs_are_of_the_constrained_distribution(sched_factory, smol_tokenizer):
    choices = ["alpha", "beta"]
    c = Constraint(ConstraintKind.CHOICE, json.dumps(choices))
    r = make_request(PROMPT, max_tokens=10, constraint=c, logprobs=5)
    out = run_until_idle(sched_factory(), {0: [r]})[r.request_id]
    lps = [lp for o in out for lp in (o.logprobs or [])]
    first = lps[0]
    assert all(not math.isinf(v) for lp in lps for v in lp.top_logprobs)  # forbidden tokens are no alternatives
    allowed = set(first.top_token_ids)
    for t in allowed:  # every alternative starts one of the choices
        piece = smol_tokenizer.decode([t])
        assert any(ch.startswith(piece) for ch in choices), piece
    finite = [v for v in first.top_logprobs if not math.isinf(v)]
    assert finite and sum(math.exp(v) for v in finite) <= 1.0 + 1e-4
    assert first.logprob > -30  # the sampled token is one the grammar allowed
    # the last token completes a choice: its constrained probability is 1
    assert text_of(smol_tokenizer, out) in choices


@pytest.mark.parametrize("mode", ["monolithic", "chunked", "mixed_batch"])
def test_every_prefill_mode_with_prefix_caching(sched_factory, smol_tokenizer, mode):
    overrides = {"prefix_caching": True, "prefill_mode": mode}
    if mode != "monolithic":
        overrides["prefill_chunk_size"] = 8
    if mode == "mixed_batch":
        overrides["max_num_batched_tokens"] = 24
    sched = sched_factory(**overrides)
    prompt = list(range(100, 160))  # several blocks: the second request hits the first's
    c = schema_c({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False})
    first = make_request(prompt, max_tokens=20, constraint=c)
    second = make_request(prompt, max_tokens=20, constraint=c)
    plain = make_request(prompt[:30], max_tokens=5)
    out = run_until_idle(sched, {0: [first, plain], 3: [second]})
    for r in (first, second):
        o = out[r.request_id]
        assert o[-1].finish_reason is p.FinishReason.STOP
        assert json.loads(text_of(smol_tokenizer, o)) in ({"ok": True}, {"ok": False})
    assert tokens_of(out[first.request_id]) == tokens_of(out[second.request_id])  # greedy, same prompt
    assert out[second.request_id][0].num_cached_tokens > 0
    assert len(tokens_of(out[plain.request_id])) == 5


def test_stop_token_ids_and_ignore_eos_under_a_constraint(sched_factory, smol_tokenizer):
    c = Constraint(ConstraintKind.CHOICE, json.dumps(["left", "right"]))
    r = make_request(PROMPT, max_tokens=20, constraint=c, ignore_eos=True)
    out = run_until_idle(sched_factory(), {0: [r]})[r.request_id]
    # ignore_eos cannot extend a complete grammar: the row ends with stop at the choice's end
    assert out[-1].finish_reason is p.FinishReason.STOP
    assert smol_tokenizer.decode(tokens_of(out)) in ("left", "right")
    # an open-ended grammar with ignore_eos runs to max_tokens, never sampling EOS
    r2 = make_request(PROMPT, max_tokens=15, ignore_eos=True,
                      constraint=Constraint(ConstraintKind.REGEX, "[a-z]+( [a-z]+)*"))
    o2 = run_until_idle(sched_factory(), {0: [r2]})[r2.request_id]
    assert o2[-1].finish_reason is p.FinishReason.LENGTH and 2 not in tokens_of(o2)


def test_a_constraint_that_does_not_compile_fails_its_request_only(sched_factory):
    sched = sched_factory()
    bad = make_request(PROMPT, max_tokens=5, constraint=Constraint(ConstraintKind.REGEX, "[a-"))
    bad_schema = make_request(PROMPT, max_tokens=5, constraint=schema_c({"type": "strin"}))
    good = make_request(PROMPT, max_tokens=5)
    out = run_until_idle(sched, {0: [bad, bad_schema, good]})
    for r in (bad, bad_schema):
        assert out[r.request_id][-1].finish_reason is p.FinishReason.ERROR
        assert "does not compile" in out[r.request_id][-1].error
    assert len(tokens_of(out[good.request_id])) == 5
    assert sched.active_kv_reserved == 0 and not sched.has_work()


def test_rows_wait_in_pending_while_their_grammar_compiles_and_aborts_reach_them(sched_factory):
    sched = sched_factory()
    gate = __import__("threading").Event()
    real = sched.grammars._compile
    sched.grammars = GrammarCache(sched.grammars._load_tokenizer, sched.grammars.vocab_size,
                                  sched.grammars.eos_token_ids)
    sched.grammars._tokenizer = sched_factory().grammars.tokenizer()

    def slow(constraint):
        gate.wait(30)
        return real.__func__(sched.grammars, constraint)

    sched.grammars._compile = slow
    c = Constraint(ConstraintKind.REGEX, "[0-9]{4}")
    waiting = make_request(PROMPT, max_tokens=8, constraint=c)
    aborted = make_request(PROMPT, max_tokens=8, constraint=c)
    plain = make_request(PROMPT, max_tokens=3)
    for r in (waiting, aborted, plain):
        sched.add_request(r)
    for _ in range(6):  # the unconstrained row runs to its end; the others wait
        sched.step()
        sched.check_invariants()
    assert plain.status.is_finished and waiting.status is waiting.status.WAITING
    assert sched.stats()["num_awaiting_grammar"] == 2 and sched.only_compiling()
    assert sched.abort_request(aborted.request_id)
    sched.check_invariants()
    gate.set()
    out = run_until_idle(sched, {})
    assert len(tokens_of(out[waiting.request_id])) == 4 and out[waiting.request_id][-1].finish_reason.value == "stop"


def test_the_bitmask_applies_to_bf16_logits_and_only_named_rows():
    logits = torch.zeros(3, 70, dtype=torch.bfloat16)
    words = torch.zeros(2, 3, dtype=torch.int32)
    words[0, 0] = 1 << 5  # row 0 allows token 5
    words[1, 2] = 1 << 1  # row 2 allows token 65
    apply_bitmask(logits, [0, 2], words)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5]
    assert torch.isfinite(logits[1]).all()
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [65]


# ---------------------------------------------------------------- hypothesis schemas

LEAF = st.sampled_from([
    {"type": "boolean"}, {"type": "integer", "minimum": -50, "maximum": 50}, {"type": "null"},
    {"type": "string", "maxLength": 6}, {"enum": ["x", "y", "z"]}, {"type": "number", "minimum": 0, "maximum": 9},
])


def _objects(children):
    return st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5), children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})


SCHEMAS = st.recursive(LEAF, lambda children: _objects(children) | children.map(
    lambda items: {"type": "array", "items": items, "maxItems": 3}), max_leaves=6)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(schema=SCHEMAS, seed=st.integers(0, 1000))
def test_hypothesis_schemas_stop_valid_or_are_cut_as_an_accepted_prefix(sched_factory, smol_tokenizer, schema,
                                                                        seed):
    sched = sched_factory()
    c = schema_c(schema)
    assert grammar_problem(c) is None
    r = make_request(PROMPT, max_tokens=48, constraint=c, temperature=0.7, seed=seed)
    out = run_until_idle(sched, {0: [r]})[r.request_id]
    if out[-1].finish_reason is p.FinishReason.STOP:
        jsonschema.validate(json.loads(text_of(smol_tokenizer, out)), schema)
    else:
        assert out[-1].finish_reason is p.FinishReason.LENGTH
        assert fresh_matcher(sched, c).consume_tokens(tokens_of(out))


# ---------------------------------------------------------------- the wire form


def _submit(constraint) -> p.Submit:
    return p.Submit("s-1", "fe", [1, 2, 3], p.SamplingParams(max_tokens=4, constraint=constraint))


def test_the_constraint_crosses_as_source_text():
    c = schema_c(PERSON)
    back = codec.decode(codec.encode(_submit(c)), "engine")
    assert back.params.constraint == c and back.params.constraint.kind is ConstraintKind.JSON_SCHEMA
    assert back.params.validate() is None


@pytest.mark.parametrize("wire", [
    ["json_schemaX", "{}"],  # unknown kind
    [7, "{}"],  # kind of the wrong type
    ["regex", 12],  # text of the wrong type
    ["regex", "a" * (MAX_CONSTRAINT_CHARS + 1)],  # too large
    ["regex", "abc", "extra"],  # an unknown field
    "regex",  # not a struct
])
def test_a_malformed_constraint_is_not_a_message(wire):
    frame = msgspec.msgpack.decode(codec.encode(_submit(None)))
    params = list(frame[4])
    params += [None] * (len(p.SamplingParams.__struct_fields__) - len(params))
    params[p.SamplingParams.__struct_fields__.index("constraint")] = wire
    frame[4] = params
    with pytest.raises(codec.DecodeError):
        codec.decode(msgspec.msgpack.encode(frame), "engine")


@pytest.mark.parametrize("constraint, says", [
    (Constraint(ConstraintKind.JSON_SCHEMA, "{not json"), "not valid JSON"),
    (Constraint(ConstraintKind.JSON_SCHEMA, "[1]"), "JSON object"),
    (Constraint(ConstraintKind.CHOICE, "[]"), "choices"),
    (Constraint(ConstraintKind.CHOICE, '["a", 3]'), "choices"),
    (Constraint(ConstraintKind.REGEX, ""), "needs its text"),
    (Constraint(ConstraintKind.JSON_OBJECT, "x"), "no text"),
])
def test_decoded_constraints_are_validated_before_the_queue(constraint, says):
    back = codec.decode(codec.encode(_submit(constraint)), "engine")
    problem = back.params.validate()
    assert problem and says in problem


def test_grammar_problems_name_the_problem():
    assert "strin" in grammar_problem(schema_c({"type": "strin"}))
    assert "regex" in grammar_problem(Constraint(ConstraintKind.REGEX, "[a-"))
    assert grammar_problem(Constraint(ConstraintKind.GRAMMAR, "start: foo")) is not None
    assert grammar_problem(Constraint(ConstraintKind.JSON_OBJECT)) is None
    assert grammar_mod.GrammarError.__mro__[1] is ValueError


def test_a_model_whose_tokenizer_does_not_load_fails_constrained_requests_only(sched_factory):
    sched = sched_factory()

    def no_tokenizer():
        raise OSError("no tokenizer.json here")

    sched.grammars = GrammarCache(no_tokenizer, sched.grammars.vocab_size, sched.grammars.eos_token_ids)
    constrained = make_request(PROMPT, max_tokens=4, constraint=Constraint(ConstraintKind.REGEX, "[0-9]+"))
    plain = make_request(PROMPT, max_tokens=4)
    out = run_until_idle(sched, {0: [constrained, plain]})
    assert out[constrained.request_id][-1].finish_reason is p.FinishReason.ERROR
    assert "tokenizer does not load" in out[constrained.request_id][-1].error
    assert len(tokens_of(out[plain.request_id])) == 4
