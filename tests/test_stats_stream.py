"""The stats event stream on its own: framing, rate limit, engine down/up (no processes)."""

from __future__ import annotations

import asyncio
import json

from frontend.stats_stream import KEEPALIVE_S, StatsHub, sse_frame


def parse(frame: str) -> dict:
    """Fields of one SSE event; every line is ``name: value``, the event ends with a blank line."""
    assert frame.endswith("\n\n") and "\n\n" not in frame[:-2]
    fields = dict(line.split(": ", 1) for line in frame[:-2].split("\n"))
    return fields


def test_frame_is_one_event_with_single_line_json():
    frame = sse_frame(7, "stats", {"a": "x\ny", "b": [1, 2]})
    fields = parse(frame)
    assert fields["id"] == "7" and fields["event"] == "stats"
    assert json.loads(fields["data"]) == {"a": "x\ny", "b": [1, 2]}


class Engine:
    def __init__(self):
        self.up, self.engine_id = True, "e1"

    def status(self):
        return self.up, self.engine_id


async def collect(hub: StatsHub, seconds: float, max_hz: float) -> list[str]:
    frames: list[str] = []

    async def read():
        async for f in hub.events(max_hz):
            frames.append(f)

    task = asyncio.create_task(read())
    await asyncio.sleep(seconds)
    task.cancel()
    return frames


def test_stream_starts_with_retry_and_sends_each_publication():
    async def main():
        eng = Engine()
        hub = StatsHub(eng.status)
        hub.update({"engine_id": "e1", "num_active": 1})

        async def publish():
            for i in range(3):
                await asyncio.sleep(0.1)
                hub.update({"engine_id": "e1", "num_active": 2 + i})

        pub = asyncio.create_task(publish())
        frames = await collect(hub, 0.6, max_hz=50)
        await pub
        return frames

    frames = asyncio.run(main())
    assert frames[0] == "retry: 1000\n\n"
    assert parse(frames[1])["event"] == "history"
    actives = [json.loads(parse(f)["data"])["stats"]["num_active"] for f in frames[2:]]
    assert actives == [1, 2, 3, 4]


def test_a_new_viewer_gets_the_last_minute_one_point_a_second():
    """A dashboard opened now draws the minute before it (it used to start empty)."""
    wall = [1000.0]
    hub = StatsHub(Engine().status, wall=lambda: wall[0])
    for i in range(300):  # 75 s of broadcasts, four a second
        hub.update({"engine_id": "e1", "num_active": i, "window": {"output_tokens_per_s": 2.0 * i},
                    "runtime": {"device": "cpu"}})
        wall[0] += 0.25
    history = json.loads(parse(hub.history_frame())["data"])
    points = history["points"]
    assert history["now"] == wall[0] and 58 <= len(points) <= 60
    assert all(wall[0] - p["t"] <= 60 for p in points)
    assert all(b["t"] - a["t"] >= 1.0 for a, b in zip(points, points[1:]))  # one a second, oldest first
    assert points[-1]["num_active"] == 296 and points[-1]["window"]["output_tokens_per_s"] == 592.0
    assert "runtime" not in points[-1]  # only what the charts draw


def test_sessions_without_an_id_are_one_row_across_engines():
    from frontend.dashboard import merge_sessions

    rows = merge_sessions([{"session": None, "tokens_per_s": 3.0, "vtc_counter": 10.0},
                           {"session": "a", "tokens_per_s": 1.0, "vtc_counter": 4.0},
                           {"session": None, "tokens_per_s": 2.0, "vtc_counter": 5.0},
                           {"session": "", "tokens_per_s": 1.0, "vtc_counter": None}])
    assert rows == [{"session": None, "tokens_per_s": 6.0, "vtc_counter": 15.0},
                    {"session": "a", "tokens_per_s": 1.0, "vtc_counter": 4.0}]


def test_rate_limit_bounds_events_per_viewer_whatever_the_publication_rate():
    async def main():
        eng = Engine()
        hub = StatsHub(eng.status)
        stop = False

        async def flood():
            i = 0
            while not stop:
                i += 1
                hub.update({"engine_id": "e1", "n": i})
                await asyncio.sleep(0.002)

        pub = asyncio.create_task(flood())
        frames = await collect(hub, 1.0, max_hz=4)
        stop = True
        await pub
        return frames, hub.version

    frames, published = asyncio.run(main())
    assert published > 30  # publications came far faster than 4 a second
    assert 3 <= len(frames) - 1 <= 6, len(frames)  # ≈ 4 a second, not hundreds


def test_viewers_share_one_encoded_frame():
    eng = Engine()
    hub = StatsHub(eng.status)
    hub.update({"engine_id": "e1"})
    assert hub.frame() is hub.frame()


def test_engine_down_then_restarted_is_reported_and_counted():
    async def main():
        eng = Engine()
        hub = StatsHub(eng.status)
        hub.update({"engine_id": "e1", "num_active": 1})
        events: list[dict] = []

        async def read():
            async for f in hub.events(max_hz=20):
                if f.startswith("id:"):
                    events.append(json.loads(parse(f)["data"]))

        task = asyncio.create_task(read())
        await asyncio.sleep(0.2)
        eng.up, eng.engine_id = False, None  # the client lost the engine's heartbeats
        await asyncio.sleep(KEEPALIVE_S + 0.3)  # no publication: the keep-alive reports it
        eng.up, eng.engine_id = True, "e2"
        hub.update({"engine_id": "e2", "num_active": 0})
        await asyncio.sleep(0.3)
        task.cancel()
        return events

    events = asyncio.run(main())
    assert events[0]["engine"] == {"up": True, "engine_id": "e1", "restarts": 0}
    down = [e for e in events if not e["engine"]["up"]]
    assert down and all(e["stats"] is None for e in down)
    assert events[-1]["engine"] == {"up": True, "engine_id": "e2", "restarts": 1}
    assert events[-1]["stats"]["engine_id"] == "e2"


def test_malformed_publications_are_dropped():
    hub = StatsHub(Engine().status)
    for bad in (None, [], {"engine_id": 3}, {"engine_id": ""}, {"num_active": 1}):
        hub.update(bad)
    assert hub.num_dropped == 5 and hub.version == 0 and hub.latest is None


def test_several_engines_are_one_row_each_and_summed():
    """A frontend with two engines: the event lists both (address, state, own stats)
    and its ``stats`` is their sum; the rates add up, the percentiles are the worst."""
    from frontend.dashboard import merge_windows
    from frontend.engine_set import aggregate

    state = [(True, "e1"), (True, "e2")]
    hub = StatsHub(status=lambda: list(state), addresses=["/run/engine-0", "/run/engine-1"],
                   merge=lambda stats: merge_windows(aggregate(stats, 2), stats))

    def engine_stats(eid, active, used, p99):
        return {"engine_id": eid, "num_active": active, "num_pending": 0, "num_prefilling": 0,
                "blocks": {"num_used_blocks": used, "num_blocks": 100},
                "window": {"output_tokens_per_s": 10.0 * active, "ttft_p99_s": p99, "sessions": []}}

    hub.update(engine_stats("e1", 3, 10, 0.5), 0)
    hub.update(engine_stats("e2", 5, 30, 0.9), 1)
    event = json.loads(parse(hub.frame())["data"])
    assert [e["address"] for e in event["engines"]] == ["/run/engine-0", "/run/engine-1"]
    assert [e["stats"]["num_active"] for e in event["engines"]] == [3, 5]
    merged = event["stats"]
    assert merged["num_active"] == 8 and merged["kv_pressure"] == 0.2
    assert merged["window"]["output_tokens_per_s"] == 80.0 and merged["window"]["ttft_p99_s"] == 0.9
    state[1] = (False, None)  # the second engine goes down: its row says so, the sum drops it
    event = json.loads(parse(hub.frame())["data"])
    assert event["engines"][1]["up"] is False and event["engines"][1]["stats"] is None
    assert event["stats"]["num_active"] == 3 and event["engine"]["up"] is True
