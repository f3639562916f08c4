"""The engine's rolling stats window: rates, latency percentiles, hit rate, sessions
(a fake clock; no processes)."""

from __future__ import annotations

import pytest

from engine_proc.stats_window import GROWTH, RollingHistogram, StatsWindow
from shared.protocol import FinishReason, RejectCode, RequestOutput


def out(rid: str, n: int = 1, finish: FinishReason | None = None, prompt: int = 0, cached: int = 0):
    return RequestOutput(rid, list(range(n)), finish, num_prompt_tokens=prompt, num_cached_tokens=cached)


def test_histogram_quantiles_are_within_one_bucket():
    h = RollingHistogram(60)
    values = [0.001 * i for i in range(1, 1001)]  # 1 ms .. 1 s
    for v in values:
        h.add(v, now=100.0)
    p50, p99 = h.quantiles((0.5, 0.99), now=100.5)
    assert p50 == pytest.approx(0.5, rel=GROWTH - 1)
    assert p99 == pytest.approx(0.99, rel=GROWTH - 1)
    assert h.count(100.5) == 1000


def test_histogram_forgets_samples_older_than_the_window():
    h = RollingHistogram(60)
    h.add(5.0, now=10.0)
    h.add(0.01, now=65.0)
    assert h.count(65.0) == 2
    assert h.count(71.0) == 1  # second 10 fell out
    assert h.quantiles((0.99,), now=71.0)[0] == pytest.approx(0.01, rel=GROWTH - 1)
    assert h.quantiles((0.5,), now=200.0) == [None]


def test_ttft_itl_and_prefix_hit_rate_from_outputs():
    w = StatsWindow(interval_s=0.25)
    w.on_arrival("a", "alice", arrival_time=10.0)
    w.on_outputs([out("a", prompt=100, cached=25)], now=10.2)  # TTFT 0.2 s
    w.on_outputs([out("a", n=2)], now=10.3)  # ITL 0.05 s per token
    w.on_outputs([out("a", n=0, finish=FinishReason.LENGTH)], now=10.4)
    snap = w.publish({"num_generated_tokens": 3}, now=10.5)
    assert snap["ttft_p50_s"] == pytest.approx(0.2, rel=GROWTH - 1)
    assert snap["itl_p50_s"] == pytest.approx(0.05, rel=GROWTH - 1)
    assert snap["ttft_count"] == 1 and snap["itl_count"] == 1
    assert snap["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert "a" not in w._live  # finished requests are forgotten


def test_rates_over_the_rate_window_and_rejects_by_code():
    w = StatsWindow(interval_s=0.25, rate_window_s=5.0)
    w.publish({"num_generated_tokens": 0, "kv_admit_blocked": 0}, now=0.0)
    for _ in range(3):
        w.on_reject(RejectCode.QUEUE_FULL)
    snap = w.publish({"num_generated_tokens": 200, "kv_admit_blocked": 10}, now=2.0)
    assert snap["output_tokens_per_s"] == pytest.approx(100.0)
    assert snap["kv_admit_blocked_per_s"] == pytest.approx(5.0)
    assert snap["rejects_per_s"]["queue_full"] == pytest.approx(1.5)
    assert snap["rejects_per_s"]["kv_budget"] == 0
    assert snap["rejects_total"]["queue_full"] == 3
    # Once the rate window has moved past the burst, the rate falls back to zero.
    w.publish({"num_generated_tokens": 200, "kv_admit_blocked": 10}, now=8.0)
    snap = w.publish({"num_generated_tokens": 200, "kv_admit_blocked": 10}, now=14.0)
    assert snap["output_tokens_per_s"] == 0


def test_busiest_sessions_by_service_rate_with_vtc_counters():
    w = StatsWindow(interval_s=0.25, top_sessions=2)
    w.publish({}, now=0.0)
    for i, (session, tokens) in enumerate([("heavy", 30), ("light", 5), ("idle", 1)]):
        w.on_arrival(f"r{i}", session, 0.0)
        w.on_outputs([out(f"r{i}", n=tokens)], now=0.5)
    snap = w.publish({"counters": {"heavy": 90.0, "light": 15.0, "idle": 3.0}}, now=1.0)
    assert [s["session"] for s in snap["sessions"]] == ["heavy", "light"]
    assert snap["sessions"][0]["tokens_per_s"] == pytest.approx(30.0)
    assert snap["sessions"][0]["vtc_counter"] == 90.0


def test_publication_is_rate_limited():
    w = StatsWindow(interval_s=0.25)
    assert w.due(now=0.0)
    w.publish({}, now=0.0)
    assert not w.due(now=0.1)
    assert w.due(now=0.25)
    assert not StatsWindow(interval_s=0).due(now=100.0)


def test_a_handed_over_row_counts_ttft_on_prefill_and_itl_on_decode():
    """Disaggregated: the prefill engine's window takes the row's TTFT at its handover;
    the decode engine's counts its tokens and later gaps, never a second TTFT."""
    prefill, decode = StatsWindow(interval_s=0.25), StatsWindow(interval_s=0.25)
    prefill.on_arrival("a", "alice", arrival_time=10.0)
    prefill.on_handed_over("a", now=10.5)
    assert prefill.ttft.count(10.5) == 1 and prefill.ttft.quantiles((0.5,), now=10.5)[0] == pytest.approx(0.5, rel=0.1)
    decode.on_taken_over("a", "alice")
    decode.on_outputs([out("a")], now=10.6)  # the first token, forwarded
    decode.on_outputs([out("a")], now=10.65)
    decode.on_outputs([out("a", finish=FinishReason.LENGTH)], now=10.7)
    assert decode.ttft.count(10.7) == 0 and decode.itl.count(10.7) == 2
    assert decode.itl.quantiles((0.5,), now=10.7)[0] == pytest.approx(0.05, rel=0.1)
