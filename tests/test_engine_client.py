"""The frontend's engine client over shared memory, against a stand-in engine in this
process (the engine's own :class:`ShmFrontends`, driven by a thread the test can pause):
an abort is retried past a full ring until the engine has it, no send stalls the event
loop, and the receiver thread survives a ring the engine broke (and anything unexpected),
connects again and comes back up."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time

import pytest
import zmq

from engine_proc.shm_frontends import ShmFrontends
from frontend.engine_client import EngineClient, EngineUnavailable
from shared import codec, shm, shm_ring
from shared import protocol as p
from shared.config import FrontendConfig
from shared.transport import RoutedOutbound, topic_for
from tests import shm_peers as peers

pytestmark = pytest.mark.skipif(shm.available() is not None, reason=f"no shared memory here: {shm.available()}")


class _NoPub:
    addr = "none"

    def publish_frame(self, topic, payload):
        pass

    def forget(self, topic):
        pass

    def close(self):
        pass


class StandInEngine:
    """Accepts shared-memory frontends, answers Hello and Submit, records Aborts, sends a
    heartbeat every 0.1 s. ``reading = False``: stops reading the rings (they fill);
    ``paused = True``: does nothing at all."""

    def __init__(self, run_dir: str):
        self.outbound = RoutedOutbound(_NoPub())
        self.frontends = ShmFrontends(run_dir, 7, self.outbound, ring_bytes=1 << 14)  # 4 KiB inbound rings
        self.aborted: list[str] = []
        self.reading, self.paused = True, False
        self.held = threading.Event()  # set once the loop has seen ``paused`` or ``reading`` False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        poller = zmq.Poller()
        self.frontends.register(poller)
        next_beat = 0.0
        while not self._stop.is_set():
            if self.paused:
                self.held.set()
                time.sleep(0.01)
                continue
            if time.monotonic() >= next_beat:
                self.outbound.publish(p.BROADCAST_TOPIC,
                                      p.EngineHeartbeat("standin", time.time()))
                next_beat = time.monotonic() + 0.1
            if not self.reading:
                self.held.set()
                time.sleep(0.01)
                continue
            self.held.clear()
            events = dict(poller.poll(20))
            self.frontends.handle(events, time.monotonic() + 0.005, self._on_frame, lambda fid, why: None)

    def _on_frame(self, frame: bytes, fid: str):
        msg = codec.decode(frame, "engine")
        if isinstance(msg, p.Hello):
            self.outbound.publish(topic_for(fid), p.Welcome("standin", 2048, [2], 16, 0.1))
        elif isinstance(msg, p.Submit):
            self.outbound.publish(topic_for(fid), p.Ack(msg.request_id, True))
        elif isinstance(msg, p.Abort):
            self.aborted.extend(msg.request_ids)

    async def hold(self, **flags) -> None:
        """Set ``paused`` / ``reading`` and wait until the loop has seen them."""
        for name, value in flags.items():
            setattr(self, name, value)
        self.held.clear()  # the loop sets it again on each pass it skips
        await peers.until(self.held.is_set, 2, f"the stand-in engine held ({flags})")

    def peer(self) -> shm.ShmPeer:
        return next(iter(self.frontends.peers.values()))

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.frontends.close()


@pytest.fixture
def standin():
    run = tempfile.mkdtemp(prefix="ts-", dir="/tmp")
    engine = StandInEngine(run)
    yield run, engine
    engine.close()
    shutil.rmtree(run, ignore_errors=True)


def _with_client(run: str, body) -> None:
    """Run ``await body(client, stream)`` on a fresh event loop: a started client, up
    (welcomed), with one request ("in-flight") whose stream is ``stream``; closed after."""
    async def main():
        client = EngineClient(FrontendConfig(run_dir=run, transport="shm", frontend_id="fe-under-test"))
        client.start(asyncio.get_running_loop())
        try:
            await peers.until(lambda: client.is_up, 10, "client up")
            await body(client, await client.submit("in-flight", [5, 6, 7], p.SamplingParams(max_tokens=8)))
        finally:
            client.close()

    asyncio.run(main())


def test_an_abort_is_retried_past_a_full_ring_and_no_send_stalls_the_event_loop(standin):
    run, engine = standin

    async def body(client, stream):
        await engine.hold(reading=False)
        lag = peers.LoopLag()
        for _ in range(300):  # fill the 4 KiB ring (each tried once, then given up)
            client.post(p.Heartbeat(client.frontend_id), 0.0)
        await peers.until(lambda: client.channel.outbound.free() < 64, 5, "ring full")
        client.abort(["in-flight"])  # the client left: the engine must hear of it
        with pytest.raises(EngineUnavailable):  # a send that cannot go fails its caller, in time
            await client.stats(timeout=3.0)
        await asyncio.sleep(0.3)
        assert client.aborts_pending == 1 and engine.aborted == []
        # the stats request was retried for its whole 1 s deadline: had any send run on the
        # loop, it would have stalled 1 s (a loaded host deschedules it for a tenth of that)
        assert lag.worst < 0.5, f"the event loop stalled {lag.worst:.3f}s"
        engine.reading = True
        await peers.until(lambda: "in-flight" in engine.aborted, 5, "the abort delivered")
        assert client.aborts_pending == 0
        lag.stop()

    _with_client(run, body)


def test_the_receiver_survives_a_bad_ring_and_anything_unexpected_and_comes_back_up(standin):
    run, engine = standin

    async def body(client, stream):
        await engine.hold(paused=True)
        peer = engine.peer()
        peer.outbound._idx[shm_ring._TAIL] = shm_ring.M64  # the engine's tail, out of range
        shm.ring_doorbell(peer.out_bell)
        out = await asyncio.wait_for(stream.queue.get(), 5)
        assert out.finish_reason == p.FinishReason.ERROR  # the in-flight request failed, loudly
        await peers.until(lambda: not client.channel.connected or client.channel.connections > 1, 5, "dropped")
        engine.paused = False
        await peers.until(lambda: client.is_up and client.channel.connections == 2, 10, "up again")
        assert client._thread.is_alive() and engine.frontends.accepted == 2
        # anything unexpected in the receiver: it drops the connection and connects again
        real_poll, calls = client.channel.poll, []

        def broken_poll(timeout_ms):
            if not calls:
                calls.append(1)
                raise RuntimeError("unexpected")
            return real_poll(timeout_ms)

        client.channel.poll = broken_poll
        await peers.until(lambda: calls and client.is_up and client.channel.connections == 3, 10, "up after a bug")
        assert client._thread.is_alive()
        await client.submit("after", [5, 6], p.SamplingParams(max_tokens=2))

    _with_client(run, body)
