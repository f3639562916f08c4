"""Disaggregated prefill and decode in-process, on the tiny float32 Llama: a prefill-role
scheduler hands each row through the handover frame (encoded and decoded as on the
wire) to a decode-role scheduler, and the tokens equal a monolithic engine's."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from shared import handover_wire as hw
from shared.codec import DecodeError
from shared.protocol import FinishReason
from tests.helpers import make_request, make_scheduler, run_until_idle, tokens_of


def _prompts(seed: int, n: int, lo: int = 3, hi: int = 60, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class Pair:
    """A prefill scheduler and a decode scheduler joined by an in-memory wire."""

    def __init__(self, model, prefill_kw=None, decode_kw=None, **common):
        common = {"prefill_chunk_size": 16, **common}
        self.prefill = make_scheduler(model, role="prefill", **common, **(prefill_kw or {}))
        self.decode = make_scheduler(model, role="decode", **common, **(decode_kw or {}))
        self.prefill.handover_sink = self._sink
        self.refusals: list[str] = []
        self.frames: list[hw.Handover] = []
        self.in_flight: list[tuple[hw.Handover, torch.Tensor]] = []
        self.hold_in_flight = False  # keep handovers "on the wire" until deliver()

    def _sink(self, handover, fill) -> bool:
        payload = torch.empty(handover.kv_bytes, dtype=torch.uint8)
        fill(payload)
        frame = hw.decode(hw.encode(handover), "decode")  # as the wire carries it
        self.frames.append(frame)
        self.in_flight.append((frame, payload))
        if not self.hold_in_flight:
            self.deliver()
        return True

    def deliver(self) -> None:
        for frame, payload in self.in_flight:
            problem = self.decode.receive_handover(frame, payload)
            if problem is not None:
                self.refusals.append(problem)
        self.in_flight = []

    def run(self, arrivals, max_ticks: int = 5000) -> dict[str, list]:
        outputs: dict[str, list] = {}
        last = max(arrivals, default=-1)
        for tick in range(max_ticks):
            for req in arrivals.get(tick, []):
                self.prefill.add_request(req)
            if tick > last and not (self.prefill.has_work() or self.decode.has_work() or self.in_flight):
                return outputs
            for sched in (self.prefill, self.decode):
                for _, out in sched.step():
                    outputs.setdefault(out.request_id, []).append(out)
                sched.check_invariants()
        raise AssertionError("not idle")


def _monolithic(model, reqs, **kw):
    sched = make_scheduler(model, prefill_mode="chunked", prefill_chunk_size=16, **kw)
    clones = [make_request(r.prompt_token_ids, max_tokens=r.params.max_tokens, **_kw(r)) for r in reqs]
    outs = run_until_idle(sched, {0: clones})
    return [outs[c.request_id] for c in clones]


def _kw(r):
    p = r.params
    return {k: getattr(p, k) for k in ("ignore_eos", "logprobs", "stop_token_ids", "seed", "temperature",
                                       "presence_penalty", "frequency_penalty", "repetition_penalty",
                                       "prompt_logprobs")}


def test_greedy_tokens_equal_monolithic_and_nothing_leaks(tiny_llama):
    """Rows of different lengths, one longer than several chunks, with logprobs: every
    row's tokens and logprobs equal a monolithic engine's; the first output travels in the
    handover (the prefill engine streams none of a handed row); both sides end empty."""
    prompts = _prompts(1, 6, hi=70)
    reqs = [make_request(p, max_tokens=m, ignore_eos=True, logprobs=2) for p, m in zip(prompts, [5, 9, 1, 12, 3, 7])]
    pair = Pair(tiny_llama)
    outs = pair.run({0: reqs[:3], 2: reqs[3:]})
    ref = _monolithic(tiny_llama, reqs)
    for req, want in zip(reqs, ref):
        got = outs[req.request_id]
        assert tokens_of(got) == tokens_of(want)
        assert got[-1].finish_reason is FinishReason.LENGTH
        lps = [lp for o in got for lp in (o.logprobs or [])]
        ref_lps = [lp for o in want for lp in (o.logprobs or [])]
        assert [lp.token_id for lp in lps] == [lp.token_id for lp in ref_lps]
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(lps, ref_lps))
    handed = {f.request_id for f in pair.frames}
    assert handed == {r.request_id for r in reqs if r.params.max_tokens > 1}  # max_tokens 1 ends on prefill
    for s in (pair.prefill, pair.decode):
        assert s.active_kv_reserved == 0 and s.block_pool.num_used_blocks == 0 and not s.has_work()
    assert pair.prefill.stats()["handovers"]["count"] == len(handed)
    dstats = pair.decode.stats()
    assert dstats["role"] == "decode" and dstats["handovers"]["count"] == len(handed)
    assert dstats["handovers"]["bytes"] == sum(f.kv_bytes for f in pair.frames) > 0


def test_prefix_hits_stop_ids_seeded_sampling_and_penalties(tiny_llama):
    """A shared 48-token prefix hits the prefill engine's cache; a stop token id ends a
    row on the decode side; a seeded sampled row with penalties continues on the decode
    engine from the handed-over generator state and counts: all equal monolithic."""
    shared = _prompts(2, 1, lo=48, hi=48)[0]
    tails = _prompts(3, 3, lo=5, hi=20)
    ref_first = _monolithic(tiny_llama, [make_request(shared + tails[0], max_tokens=8, ignore_eos=True)])[0]
    stop = tokens_of(ref_first)[4]
    reqs = [make_request(shared + tails[0], max_tokens=8, ignore_eos=True, stop_token_ids=[stop]),
            make_request(shared + tails[1], max_tokens=10, ignore_eos=True),
            make_request(shared + tails[2], max_tokens=10, ignore_eos=True, temperature=0.9, seed=1234,
                         presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)]
    pair = Pair(tiny_llama)
    outs = pair.run({0: reqs[:1], 3: reqs[1:]})
    ref = _monolithic(tiny_llama, reqs)
    for req, want in zip(reqs, ref):
        assert tokens_of(outs[req.request_id]) == tokens_of(want), req.request_id
    assert outs[reqs[0].request_id][-1].finish_reason is FinishReason.STOP
    assert outs[reqs[0].request_id][-1].token_ids[-1] == stop
    assert sum(f.num_cached_tokens for f in pair.frames) >= 32  # the later rows hit the shared blocks
    assert outs[reqs[1].request_id][0].num_cached_tokens >= 32


def test_n_siblings_and_prompt_logprobs(tiny_llama):
    """Three samples of one prompt (as n=3 sends them) and a row with prompt logprobs:
    the prompt logprobs arrive once, with the first token, from the decode engine."""
    prompt = _prompts(4, 1, lo=30, hi=30)[0]
    sibs = [make_request(prompt, max_tokens=6, ignore_eos=True, temperature=0.8, seed=s) for s in (1, 2, 3)]
    scored = make_request(prompt, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    pair = Pair(tiny_llama)
    outs = pair.run({0: sibs + [scored]})
    ref = _monolithic(tiny_llama, sibs + [scored])
    for req, want in zip(sibs + [scored], ref):
        assert tokens_of(outs[req.request_id]) == tokens_of(want)
    got, want = outs[scored.request_id], ref[-1]
    assert got[0].prompt_logprobs is not None and len(got[0].prompt_logprobs) == len(prompt) - 1
    assert [lp.token_id for lp in got[0].prompt_logprobs] == [lp.token_id for lp in want[0].prompt_logprobs]
    assert all(o.prompt_logprobs is None for o in got[1:])


@pytest.mark.parametrize("where", ["pending", "in_flight", "held", "decoding"])
def test_abort_reaches_the_row_wherever_it_is(tiny_llama, where):
    """An abort on the prefill side (pending), before the handover arrives (in flight:
    a tombstone refuses it), while the decode engine holds it, or while it decodes: the
    row ends, nothing else is disturbed, and no block or reservation leaks anywhere."""
    prompts = _prompts(5, 2, lo=20, hi=30)
    victim, other = (make_request(p, max_tokens=30, ignore_eos=True) for p in prompts)
    decode_kw = {"kv_num_blocks": 4} if where == "held" else {}
    pair = Pair(tiny_llama, decode_kw=decode_kw)
    outputs: dict[str, list] = {}

    def tick():
        for sched in (pair.prefill, pair.decode):
            for _, out in sched.step():
                outputs.setdefault(out.request_id, []).append(out)
            sched.check_invariants()

    pair.prefill.add_request(other)
    if where == "held":  # the decode engine's pool (4 blocks) fits one of these rows, not two
        for _ in range(6):
            tick()
    pair.prefill.add_request(victim)
    if where == "pending":
        assert pair.prefill.abort_request(victim.request_id)
    elif where == "in_flight":
        pair.hold_in_flight = True
        while not any(f.request_id == victim.request_id for f, _ in pair.in_flight):
            tick()
        assert not pair.decode.abort_request(victim.request_id)  # not there yet: tombstoned
        pair.hold_in_flight = False
        pair.deliver()
        assert len(pair.refusals) == 1 and "aborted" in pair.refusals[0]
    elif where == "held":
        while not pair.decode._held:
            tick()
        assert pair.decode.abort_request(victim.request_id)
    else:
        while victim.request_id not in pair.decode._requests:
            tick()
        tick()
        assert pair.decode.abort_request(victim.request_id)
    for _ in range(200):
        if not (pair.prefill.has_work() or pair.decode.has_work()):
            break
        tick()
    assert len(tokens_of(outputs[other.request_id])) == 30
    if where in ("held", "decoding"):
        assert outputs[victim.request_id][-1].finish_reason is FinishReason.ABORT
    for s in (pair.prefill, pair.decode):
        assert s.active_kv_reserved == 0 and s.block_pool.num_used_blocks == 0 and not s.has_work()


def test_a_full_decode_engine_holds_the_handover_then_accepts_it(tiny_llama):
    """Gate 2 on the decode side (budget for one row): the second handover is held,
    never dropped; its first token streams at once; it is admitted when the first row
    finishes, and both rows' tokens equal monolithic."""
    prompts = _prompts(6, 2, lo=20, hi=20)
    reqs = [make_request(p, max_tokens=10, ignore_eos=True) for p in prompts]
    pair = Pair(tiny_llama, decode_kw={"kv_budget_tokens": 40})
    outs: dict[str, list] = {}
    saw_held = False
    for _ in range(300):
        for r in reqs:
            if not pair.prefill.has_request(r.request_id) and r.request_id not in outs and r.status.value == 0:
                pair.prefill.add_request(r)
        for sched in (pair.prefill, pair.decode):
            for _, out in sched.step():
                outs.setdefault(out.request_id, []).append(out)
            sched.check_invariants()
        if pair.decode._held:
            saw_held = True
            held = pair.decode._held[0].req.request_id
            assert len(tokens_of(outs[held])) == 1  # its first token already streamed
            assert pair.decode.active_kv_reserved <= 40
        if not (pair.prefill.has_work() or pair.decode.has_work()):
            break
    assert saw_held and pair.decode.kv_admit_blocked > 0
    for req, want in zip(reqs, _monolithic(tiny_llama, reqs)):
        assert tokens_of(outs[req.request_id]) == tokens_of(want)


def _frame(pair: Pair, prompt_len: int = 20):
    pair.hold_in_flight = True
    req = make_request(_prompts(7, 1, lo=prompt_len, hi=prompt_len)[0], max_tokens=5, ignore_eos=True)
    pair.prefill.add_request(req)
    while not pair.in_flight:
        pair.prefill.step()
    (frame, payload), = pair.in_flight
    pair.in_flight = []
    return frame, payload


def test_bad_handovers_are_refused_and_the_engine_survives(tiny_llama):
    """Wrong layout, sizes, token ids, a duplicate id, garbage bytes: each is refused with
    a reason (no row, no block, no reservation taken); a good one then decodes."""
    pair = Pair(tiny_llama)
    frame, payload = _frame(pair)
    lay = frame.layout
    bad = {
        "layers": msgspec.structs.replace(frame, layout=msgspec.structs.replace(lay, num_layers=lay.num_layers + 1)),
        "heads": msgspec.structs.replace(frame, layout=msgspec.structs.replace(lay, num_kv_heads=lay.num_kv_heads * 2)),
        "dtype": msgspec.structs.replace(frame, layout=msgspec.structs.replace(lay, dtype="bfloat16")),
        "block": msgspec.structs.replace(frame, layout=msgspec.structs.replace(lay, block_size=lay.block_size * 2)),
        "tokens": msgspec.structs.replace(frame, num_kv_tokens=frame.num_kv_tokens + 1),
        "blocks": msgspec.structs.replace(frame, num_blocks=frame.num_blocks + 1),
        "bytes": msgspec.structs.replace(frame, kv_bytes=frame.kv_bytes - 1),
        "vocab": msgspec.structs.replace(frame, output_token_ids=[10 ** 6]),
        "first": msgspec.structs.replace(frame, first_output=msgspec.structs.replace(frame.first_output,
                                                                                       request_id="other")),
    }
    for name, h in bad.items():
        assert pair.decode.receive_handover(h, payload) is not None, name
    assert pair.decode.receive_handover(frame, payload[:-1]) is not None  # short payload
    assert pair.decode.receive_handover(frame, payload.view(torch.int8)) is not None  # not bytes
    for junk in (b"", b"\x93\x01\x02", hw.encode(hw.HandoverAbort(["a"]))[:-1], b"\xff" * 64):
        with pytest.raises(DecodeError):
            hw.decode(junk, "decode")
    with pytest.raises(DecodeError):  # a prefill-bound message at the decode side
        hw.decode(hw.encode(hw.HandoverAck("r", True)), "decode")
    assert pair.decode.handovers_refused == len(bad) + 2
    assert not pair.decode.has_work() and pair.decode.block_pool.num_used_blocks == 0
    assert pair.decode.receive_handover(frame, payload) is None
    assert pair.decode.receive_handover(frame, payload) is not None  # the same id again
    outs = run_until_idle(pair.decode)
    assert len(tokens_of(outs[frame.request_id])) == 5
    assert pair.decode.block_pool.num_used_blocks == 0 and pair.decode.active_kv_reserved == 0


def test_roles_in_the_configuration(tiny_llama):
    from shared.config import EngineConfig, PrefillMode

    assert EngineConfig(role="decode").resolved_prefill_mode is PrefillMode.DISAGGREGATED
    assert EngineConfig(role="decode").problems() == []
    assert EngineConfig(role="prefill", decode_engines="/tmp/d,tcp://h:5600").problems() == []
    for kw, says in [({"role": "both"}, "unknown role"), ({"role": "prefill"}, "--decode-engines"),
                     ({"role": "decode", "backend": "hf"}, "backend paged"),
                     ({"role": "prefill", "decode_engines": "udp://x"}, "decode engine"),
                     ({"role": "prefill", "decode_engines": "/d", "prefill_mode": "chunked"}, "disaggregated"),
                     ({"prefill_mode": "disaggregated"}, "role prefill or decode"),
                     ({"handover_addr": "tcp://h:1"}, "role decode")]:
        assert any(says in p for p in EngineConfig(**kw).problems()), kw
    with pytest.raises(NotImplementedError):
        make_scheduler(tiny_llama, prefill_mode="disaggregated")


class _StubClient:
    """A decode engine link that reports what it is told to and records handovers."""

    def __init__(self, target, layout, report):
        self.target, self.layout, self.report, self.ready, self.engine_id = target, layout, report, True, target
        self.sent, self.inbox = [], []

    def connect(self):
        return True

    def receive(self):
        msgs, self.inbox = self.inbox, []
        for m in msgs:
            if isinstance(m, hw.DecodeReport):
                self.report = m
        return msgs

    def send_handover(self, h, fill):
        fill(memoryview(bytearray(h.kv_bytes)))
        self.sent.append(h)


def test_decode_reports_charge_vtc_on_the_prefill_side_and_full_engines_take_nothing(tiny_llama):
    """Fair/VTC across roles: a decode engine's per-session token counts are charged to the
    prefill engine's policy (w_q per token); a decode engine holding a batch's worth of
    handovers is skipped, the less loaded one takes the row, and with none left the row
    waits on the prefill engine, its reservation still counted there."""
    from engine_proc.handover_link import DecodeTargets

    sched = make_scheduler(tiny_llama, role="prefill", policy="fair", prefill_chunk_size=16)
    targets = DecodeTargets("/tmp/a,/tmp/b", sched)
    full = _StubClient("/tmp/a", sched.kv_layout, hw.DecodeReport(8, 8, 100, 8))
    free = _StubClient("/tmp/b", sched.kv_layout, hw.DecodeReport(1, 0, 100, 8))
    targets.clients = [full, free]
    free.inbox.append(hw.DecodeReport(1, 0, 100, 8, {"alice": 5}))
    before = sched.policy._counters.get("alice", 0.0)
    targets.service()
    assert sched.policy._counters["alice"] == before + 5 * sched.policy.output_weight
    req = make_request(_prompts(8, 1, lo=20, hi=20)[0], max_tokens=6, ignore_eos=True)
    sched.add_request(req)
    for _ in range(5):
        sched.step()
    assert [h.request_id for h in free.sent] == [req.request_id] and not full.sent
    assert sched.active_kv_reserved == 0 and sched.block_pool.num_used_blocks == 0
    free.report = hw.DecodeReport(8, 8, 0, 8)  # both full now
    other = make_request(_prompts(9, 1, lo=20, hi=20)[0], max_tokens=6, ignore_eos=True)
    sched.add_request(other)
    for _ in range(5):
        sched.step()
    assert len(free.sent) == 1 and sched.has_request(other.request_id)
    assert sched.active_kv_reserved == other.max_total_tokens and sched.stats()["handovers"]["waiting"] == 1
    assert sched.only_waiting_for_decode  # the engine's tick loop waits instead of spinning
    free.report = hw.DecodeReport(0, 0, 100, 8)
    targets._sent_since_report.clear()
    sched.step()
    assert [h.request_id for h in free.sent] == [req.request_id, other.request_id]
    assert free.sent[1].first_output.token_ids and sched.active_kv_reserved == 0
    assert not sched.only_waiting_for_decode


def test_a_handover_that_fails_to_adopt_fails_only_its_row(tiny_llama, monkeypatch):
    """Copying a held row's KV in raises: that row ends with an error, its blocks and
    reservation are back, and the next handover decodes."""
    pair = Pair(tiny_llama)
    frame, payload = _frame(pair)
    cache = pair.decode.backend.cache
    real = cache.copy_blocks_in
    monkeypatch.setattr(cache, "copy_blocks_in", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    assert pair.decode.receive_handover(frame, payload) is None
    outs = run_until_idle(pair.decode)
    assert outs[frame.request_id][-1].finish_reason is FinishReason.ERROR and "boom" in outs[frame.request_id][-1].error
    assert pair.decode.block_pool.num_used_blocks == 0 and pair.decode.active_kv_reserved == 0
    monkeypatch.setattr(cache, "copy_blocks_in", real)
    frame2, payload2 = _frame(pair)
    assert pair.decode.receive_handover(frame2, payload2) is None
    assert len(tokens_of(run_until_idle(pair.decode)[frame2.request_id])) == 5


def test_constrained_rows_keep_their_grammar_across_the_handover(tiny_llama, smol_tokenizer):
    """A JSON-schema row and a choice row: the decode engine rebuilds each row's matcher from
    the constraint's source text in the handover and advances it over the first token, so the
    greedy output equals a monolithic engine's, and it is still the constrained output (an
    unconstrained decode engine would give the random model's free text)."""
    import json

    from shared.constraints import Constraint, ConstraintKind

    schema = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}))
    choice = Constraint(ConstraintKind.CHOICE, json.dumps(["alpha beta gamma", "delta"]))
    prompts = _prompts(5, 4, hi=40)
    reqs = [make_request(pr, max_tokens=24, constraint=c) for pr, c in zip(prompts, [schema, choice, schema, None])]
    pair = Pair(tiny_llama)
    pair.decode.grammars = pair.prefill.grammars  # one tokenizer load; compiled once, cached by hash
    for c in (schema, choice):
        pair.prefill.grammars.get(c).result(timeout=120)
    outs = pair.run({0: reqs})
    mono = make_scheduler(tiny_llama, prefill_mode="chunked", prefill_chunk_size=16)
    mono.grammars = pair.prefill.grammars
    clones = [make_request(r.prompt_token_ids, max_tokens=24, constraint=r.params.constraint) for r in reqs]
    ref = run_until_idle(mono, {0: clones})
    handed = {f.request_id for f in pair.frames}
    for req, clone in zip(reqs, clones):
        assert req.request_id in handed
        assert tokens_of(outs[req.request_id]) == tokens_of(ref[clone.request_id])
        assert outs[req.request_id][-1].finish_reason is ref[clone.request_id][-1].finish_reason
    assert any(f.params.constraint is not None for f in pair.frames)
    tok = smol_tokenizer
    ids = [t for t in tokens_of(outs[reqs[1].request_id]) if t not in pair.prefill.eos_token_ids]
    assert tok.decode(ids) in ("alpha beta gamma", "delta")
    for s in (pair.prefill, pair.decode):
        assert s.active_kv_reserved == 0 and s.block_pool.num_used_blocks == 0 and not s.has_work()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_arrivals_and_aborts_keep_both_sides_consistent(tiny_llama, seed):
    """Random prompts, lengths and aborts (on the prefill side, in flight, on the decode
    side), a small decode pool that soft-holds: after every tick both schedulers' invariants
    hold, every row ends exactly once, and at the end neither side holds a block or a token
    of reservation."""
    rng = random.Random(seed)
    pair = Pair(tiny_llama, decode_kw={"kv_num_blocks": 10, "max_batch_size": 4})
    reqs = [make_request(p, max_tokens=rng.randint(1, 12), ignore_eos=True)
            for p in _prompts(100 + seed, 16, lo=3, hi=50)]
    arrivals = {rng.randrange(0, 30): [] for _ in range(8)}
    for r in reqs:
        arrivals.setdefault(rng.choice(list(arrivals)), []).append(r)
    finished: dict[str, int] = {}
    for tick in range(2000):
        for r in arrivals.get(tick, []):
            pair.prefill.add_request(r)
        if arrivals.get(tick) and rng.random() < 0.5:  # one of them aborted while it is pending
            pair.prefill.abort_request(rng.choice(arrivals[tick]).request_id)
        pair.hold_in_flight = rng.random() < 0.3
        if not pair.hold_in_flight:
            pair.deliver()
        if rng.random() < 0.3:
            victim = rng.choice([r for r in reqs if r.request_id not in finished] or reqs)
            pair.prefill.abort_request(victim.request_id)
            pair.decode.abort_request(victim.request_id)
        for sched in (pair.prefill, pair.decode):
            for _, out in sched.step():
                if out.finish_reason is not None:
                    finished[out.request_id] = finished.get(out.request_id, 0) + 1
            sched.check_invariants()
            assert sched.active_kv_reserved <= sched.kv_budget_tokens
        if tick > 30 and not (pair.prefill.has_work() or pair.decode.has_work() or pair.in_flight):
            break
    else:
        raise AssertionError("not idle")
    refused = {f.request_id for f in pair.frames} - set(finished)  # tombstoned in flight: the prefill side fails them
    assert all(n == 1 for n in finished.values())
    assert set(finished) | refused == {r.request_id for r in reqs}
    assert len(refused) == len(pair.refusals)
    assert pair.decode.kv_admit_blocked > 0  # the decode side soft-held
    assert pair.prefill.num_aborted > 0 and pair.decode.num_aborted > 0  # aborts met rows on both sides
    for s in (pair.prefill, pair.decode):
        assert s.active_kv_reserved == 0 and s.block_pool.num_used_blocks == 0 and not s.has_work()
