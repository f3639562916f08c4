"""Scheduling policies: exact pick order for FCFS and Fair (VTC), and a randomized
check that no interleaving of hooks loses or duplicates a request."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_proc.policy import FairPolicy, FCFSPolicy, SchedulingPolicy, make_policy
from engine_proc.request import Request
from shared.config import PolicyName
from shared.protocol import SamplingParams

_seq = itertools.count()


def req(session: str = "", priority: int = 0, name: str = "") -> Request:
    seq = next(_seq)
    return Request(request_id=name or f"r{seq}", frontend_id="f", prompt_token_ids=[1, 2, 3],
                   params=SamplingParams(), session_id=session, priority=priority,
                   arrival_seq=seq)


def drain(policy: SchedulingPolicy) -> list[str]:
    out = []
    while len(policy):
        out.append(policy.pick_next().request_id)
    return out


def arrive_all(policy: SchedulingPolicy, *reqs: Request) -> None:
    for r in reqs:
        policy.on_request_arrived(r)


# ---- FCFS -----------------------------------------------------------------------


def test_fcfs_priority_then_arrival():
    p = FCFSPolicy()
    arrive_all(p, req(name="a"), req(name="b", priority=1), req(name="c"),
               req(name="d", priority=1), req(name="e", priority=-1))
    assert [r.request_id for r in p] == ["b", "d", "a", "c", "e"]
    assert p.peek_next().request_id == "b"
    assert len(p) == 5
    assert drain(p) == ["b", "d", "a", "c", "e"]


def test_fcfs_empty_queue():
    p = FCFSPolicy()
    assert p.peek_next() is None
    with pytest.raises(IndexError):
        p.pick_next()


def test_fcfs_remove():
    p = FCFSPolicy()
    a, b, c = req(name="a"), req(name="b"), req(name="c")
    arrive_all(p, a, b, c)
    assert p.remove(a) is True
    assert p.remove(a) is False
    assert p.remove(req()) is False
    assert len(p) == 2 and p.peek_next() is b
    p.on_request_finished(c)  # finishing a waiting request removes it
    assert drain(p) == ["b"]


def test_fcfs_readded_request_ignores_its_stale_entry():
    p = FCFSPolicy()
    a, b = req(name="a"), req(name="b")
    arrive_all(p, a, b)
    p.remove(a)
    a.priority = -1
    p.on_request_arrived(a)
    assert drain(p) == ["b", "a"]
    assert p.peek_next() is None


def test_duplicate_arrival_rejected():
    for p in (FCFSPolicy(), FairPolicy()):
        a = req()
        p.on_request_arrived(a)
        with pytest.raises(ValueError):
            p.on_request_arrived(a)


def test_fcfs_lazy_removal_compacts():
    p = FCFSPolicy()
    reqs = [req() for _ in range(1000)]
    arrive_all(p, *reqs)
    for r in reqs[:-1]:
        p.remove(r)
    assert len(p._queue._heap) <= 2 * len(p) + 33
    assert p.pick_next() is reqs[-1]


# ---- Fair (VTC) -----------------------------------------------------------------


def counters(p: FairPolicy) -> dict[str, float]:
    return p.snapshot()["counters"]


def test_fair_light_session_goes_first_after_heavy_charges():
    p = FairPolicy()
    h1, h2, l1 = req("heavy", name="h1"), req("heavy", name="h2"), req("light", name="l1")
    arrive_all(p, h1, h2, l1)
    assert p.pick_next() is h1  # counters tie at 0 → arrival order
    p.on_request_admitted(h1)
    p.on_tokens_processed(h1, prompt_tokens=100, output_tokens=0)
    p.on_tokens_processed(h1, prompt_tokens=0, output_tokens=1)
    assert counters(p) == {"heavy": 102.0, "light": 0.0}
    assert p.pick_next() is l1  # h2 arrived earlier, but its session has spent more
    assert p.pick_next() is h2


def test_fair_new_session_lifted_to_current_minimum():
    p = FairPolicy()
    a1, b1 = req("a"), req("b")
    arrive_all(p, a1, b1)
    for r, spent in ((p.pick_next(), 500), (p.pick_next(), 300)):
        p.on_request_admitted(r)
        p.on_tokens_processed(r, spent, 0)
    a2, c1, c2 = req("a", name="a2"), req("c", name="c1"), req("c", name="c2")
    arrive_all(p, a2, c1, c2)
    assert counters(p)["c"] == 300.0  # min over busy sessions (a, b), not 0
    # no catch-up burst: once c has been served a little, a's older request goes next
    assert p.pick_next() is c1
    p.on_request_admitted(c1)
    p.on_tokens_processed(c1, 250, 0)
    assert p.pick_next() is a2
    assert p.pick_next() is c2


def test_fair_returning_session_lifted_but_keeps_higher_counter():
    p = FairPolicy()
    a1, b1 = req("a"), req("b")
    arrive_all(p, a1, b1)
    for r in (p.pick_next(), p.pick_next()):
        p.on_request_admitted(r)
    p.on_tokens_processed(b1, 10, 0)
    p.on_request_finished(b1)  # b has no work any more
    p.on_tokens_processed(a1, 400, 0)
    b2 = req("b")
    p.on_request_arrived(b2)
    assert counters(p)["b"] == 400.0  # lifted from 10 to a's counter
    # a returning session whose own counter is higher keeps it
    p.on_request_admitted(p.pick_next())
    p.on_tokens_processed(b2, 1000, 0)
    p.on_request_finished(b2)
    p.on_request_arrived(req("b"))
    assert counters(p)["b"] == 1400.0


def test_fair_newcomer_on_idle_engine_lifts_to_last_idle_session():
    """Nobody has work: the newcomer starts at the counter of the session that went
    idle last, so when that heavy session returns, the newcomer has no catch-up burst."""
    p = FairPolicy()
    a1 = req("a")
    p.on_request_arrived(a1)
    p.on_request_admitted(p.pick_next())
    p.on_tokens_processed(a1, 50, 0)
    p.on_request_finished(a1)
    p.on_request_arrived(req("b"))
    assert counters(p)["b"] == 50.0
    a2 = req("a")
    p.on_request_arrived(a2)  # a returns while b waits: a and b are level, arrival order decides
    assert counters(p) == {"a": 50.0, "b": 50.0}
    assert p.peek_next().session_id == "b"


def test_fair_running_work_counts_as_busy():
    p = FairPolicy()
    a1 = req("a")
    p.on_request_arrived(a1)
    p.on_request_admitted(p.pick_next())  # a has running, no queued work
    p.on_tokens_processed(a1, 70, 0)
    p.on_request_arrived(req("b"))
    assert counters(p)["b"] == 70.0


def test_fair_priority_beats_counters():
    p = FairPolicy()
    a1, low = req("a"), req("b", name="low")
    arrive_all(p, a1, low)
    assert p.pick_next() is a1
    p.on_request_admitted(a1)
    p.on_tokens_processed(a1, 10_000, 0)
    urgent = req("a", priority=1, name="urgent")
    p.on_request_arrived(urgent)
    assert [r.request_id for r in p] == ["urgent", "low"]
    assert drain(p) == ["urgent", "low"]


def test_fair_anonymous_session_and_weights():
    p = make_policy("fair", prompt_weight=0.5, output_weight=3.0)
    a = req("")
    p.on_request_arrived(a)
    p.on_tokens_processed(a, prompt_tokens=4, output_tokens=2)
    assert p.snapshot() == {"policy": "fair", "counters": {"": 8.0}, "num_sessions": 1,
                            "num_sessions_with_work": 1, "counter_floor": 8.0}


def test_fair_remove_and_empty():
    p = FairPolicy()
    assert p.peek_next() is None
    with pytest.raises(IndexError):
        p.pick_next()
    a, b = req("a"), req("b")
    arrive_all(p, a, b)
    assert p.remove(a) and not p.remove(a)
    assert len(p) == 1 and p.peek_next() is b
    p.check_invariants()


def test_make_policy():
    assert isinstance(make_policy("fcfs"), FCFSPolicy)
    assert isinstance(make_policy(PolicyName.FAIR), FairPolicy)
    assert make_policy("fcfs").snapshot() == {"policy": "fcfs"}
    fair = make_policy(PolicyName.FAIR)
    assert (fair.prompt_weight, fair.output_weight) == (1.0, 2.0)
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_policy("lottery")


# ---- randomized: nothing lost, nothing duplicated --------------------------------

_ops = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 3), st.integers(-1, 1)),
    st.tuples(st.just("pick"), st.just(0), st.just(0)),
    st.tuples(st.just("remove"), st.integers(0, 63), st.just(0)),
    st.tuples(st.just("charge"), st.integers(0, 63), st.integers(0, 300)),
    st.tuples(st.just("finish"), st.integers(0, 63), st.just(0)),
), max_size=80)


def _key(p: SchedulingPolicy, r: Request) -> tuple:
    if isinstance(p, FairPolicy):
        return (-r.priority, counters(p)[r.session_id], r.arrival_seq)
    return (-r.priority, r.arrival_seq)


@pytest.mark.parametrize("name", ["fcfs", "fair"])
@settings(max_examples=300, deadline=None)
@given(ops=_ops)
def test_random_interleavings_never_lose_or_duplicate(name, ops):
    p = make_policy(name)
    arrived: list[Request] = []
    waiting: set[Request] = set()
    taken: list[Request] = []  # picked or removed, each exactly once
    for op, a, b in ops:
        if op == "arrive":
            r = req(f"s{a}", priority=b)
            p.on_request_arrived(r)
            arrived.append(r)
            waiting.add(r)
        elif op == "pick" and waiting:
            head = p.peek_next()
            assert _key(p, head) == min(_key(p, r) for r in waiting)
            assert p.pick_next() is head
            p.on_request_admitted(head)
            waiting.remove(head)
            taken.append(head)
        elif op == "pick":
            assert p.peek_next() is None
            with pytest.raises(IndexError):
                p.pick_next()
        elif arrived:
            r = arrived[a % len(arrived)]
            if op == "remove":
                assert p.remove(r) is (r in waiting)
            elif op == "charge":
                p.on_tokens_processed(r, b, 1)
            else:
                p.on_request_finished(r)
            if op in ("remove", "finish") and r in waiting:
                waiting.remove(r)
                taken.append(r)
        assert len(p) == len(waiting)
        assert set(p) == waiting
        assert [_key(p, r) for r in p] == sorted(_key(p, r) for r in waiting)
        p.check_invariants()
    while waiting:
        r = p.pick_next()
        waiting.remove(r)
        taken.append(r)
    assert len(p) == 0 and p.peek_next() is None
    assert len(taken) == len(set(taken)) == len(arrived)


class _KeepAll(FairPolicy):
    """VTC that never forgets a session: the reference for the bounded one."""

    def _forget_served_sessions(self) -> None:
        pass


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["arrive", "pick", "finish", "charge"]), st.integers(0, 40),
                          st.integers(1, 300)), min_size=1, max_size=300))
def test_fair_forgetting_served_sessions_changes_no_decision(ops):
    """Finding 7: counters were kept for every session ever seen. A session is now
    forgotten once idle at or below the floor; the pick order is exactly that of VTC
    keeping every counter, over random arrivals, picks, charges and finishes."""
    bounded, reference = FairPolicy(), _KeepAll()
    live: dict[int, list[tuple[Request, Request]]] = {}  # running pairs (bounded's, reference's)
    waiting: list[tuple[Request, Request]] = []
    for op, session, amount in ops:
        sid = f"s{session}"
        if op == "arrive":
            a, b = req(sid, name=f"a{next(_seq)}"), None
            b = Request(request_id=a.request_id, frontend_id="f", prompt_token_ids=[1], params=SamplingParams(),
                        session_id=sid, arrival_seq=a.arrival_seq)
            bounded.on_request_arrived(a)
            reference.on_request_arrived(b)
            waiting.append((a, b))
        elif op == "pick" and len(bounded):
            a, b = bounded.pick_next(), reference.pick_next()
            assert a.request_id == b.request_id
            bounded.on_request_admitted(a)
            reference.on_request_admitted(b)
            live.setdefault(session, []).append((a, b))
        elif op == "charge" and live.get(session):
            a, b = live[session][-1]
            bounded.on_tokens_processed(a, amount, 1)
            reference.on_tokens_processed(b, amount, 1)
        elif op == "finish" and live.get(session):
            a, b = live[session].pop()
            bounded.on_request_finished(a)
            reference.on_request_finished(b)
        bounded.check_invariants()
    assert drain(bounded) == drain(reference)
    assert bounded.num_sessions <= reference.num_sessions


def test_fair_state_stays_bounded_over_five_thousand_sessions():
    policy = FairPolicy()
    busy = req("busy")
    policy.on_request_arrived(busy)
    policy.pick_next()
    policy.on_request_admitted(busy)
    for i in range(5000):  # each visitor comes once, is served a little, leaves
        r = req(f"visitor-{i}")
        policy.on_request_arrived(r)
        policy.pick_next()
        policy.on_request_admitted(r)
        policy.on_tokens_processed(r, 3, 1)
        policy.on_request_finished(r)
        policy.on_tokens_processed(busy, 10, 5)  # the busy session is served more than any visitor
    assert policy.num_sessions < 10
    snap = policy.snapshot()
    assert len(snap["counters"]) <= FairPolicy.SNAPSHOT_SESSIONS and snap["num_sessions"] == policy.num_sessions
