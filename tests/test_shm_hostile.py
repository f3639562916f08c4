"""Hostile and careless shared-memory peers against a running engine: each attack of
issue 20's findings, made from this process while a real frontend serves a stream through
the same engine. After each, the peer that misbehaved is retired (or refused), the engine
is the same process with the same id, ``/health`` answered 200 throughout, and the
unrelated streams completed."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from shared import codec, shm, shm_channel, shm_ring
from shared import protocol as p
from shared.transport import topic_for
from tests.procs import Witness, start_stack, stats, wait_for
from tests import shm_peers as peers

pytestmark = pytest.mark.skipif(shm.available() is not None, reason=f"no shared memory here: {shm.available()}")

MAX_PEERS = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    """An engine that serves at most 8 shared-memory frontends, and one real frontend on it."""
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))
    group, base = start_stack(tmp_path_factory.mktemp("hostile"), tiny_model_dir, run, {"transport": "shm"},
                              max_shm_peers=MAX_PEERS)
    try:
        yield group, run, base
    finally:
        group.close()
        shutil.rmtree(run, ignore_errors=True)


def _shm_summary(base: str) -> dict:
    return stats(base)["shm"]


def test_an_overflow_marker_with_no_frame_retires_only_that_peer(stack):
    group, run, base = stack
    retired = _shm_summary(base)["retired"]
    with Witness(base, group.procs) as w:
        rogue = peers.rogue(run, "rogue-overflow")
        assert rogue.outbound.try_write(shm.OVERFLOW_KIND, shm.OWN, 0, b"")  # and no frame on the socket
        shm.ring_doorbell(rogue.out_bell)
        assert peers.closed_by_engine(rogue.sock, 2.0) is not None
        rogue.close()
        # a message on the socket that is not a frame, and frames that no marker claims
        for attack in ("not-a-frame", "unclaimed-frames"):
            rogue = peers.rogue(run, f"rogue-{attack}")
            if attack == "not-a-frame":
                rogue.sock.send(b"hello there")
            else:
                for _ in range(shm.MAX_PENDING_FRAMES + 1):
                    shm.send_frame_fd(rogue.sock, b"x" * 100)
            assert peers.closed_by_engine(rogue.sock, 2.0) is not None, attack
            rogue.close()
    w.check()
    assert _shm_summary(base)["retired"] >= retired + 3


def test_ring_positions_out_of_range_retire_only_that_peer(stack):
    group, run, base = stack
    with Witness(base, group.procs) as w:
        rogue = peers.rogue(run, "rogue-inbound")  # the finding: inbound HEAD = 2^64 - 8, TAIL = 2^64 - 1
        rogue.outbound._idx[shm_ring._HEAD] = shm_ring.M64 - 7
        rogue.outbound._idx[shm_ring._TAIL] = shm_ring.M64
        shm.ring_doorbell(rogue.out_bell)
        assert peers.closed_by_engine(rogue.sock, 2.0) is not None
        rogue.close()
        rogue = peers.rogue(run, "rogue-head")  # the engine's outbound ring: a head past its tail
        rogue.inbound._idx[shm_ring._HEAD] = rogue.inbound._idx[shm_ring._TAIL] + 64
        assert peers.closed_by_engine(rogue.sock, 2.0) is not None  # seen at the next heartbeat's publish
        rogue.close()
        # the engine's own outbound tail, rewritten: ignored (the engine keeps its own), and
        # the next frame republishes it, so this peer reads on as if nothing happened
        rogue = peers.rogue(run, "rogue-tail")
        rogue.inbound._idx[shm_ring._TAIL] = shm_ring.M64
        time.sleep(0.6)
        heard = []
        deadline = time.monotonic() + 3
        while not heard and time.monotonic() < deadline:
            if rogue.poll(100):
                while (got := rogue.recv()) is not None:
                    heard.append(got.msg)
        assert any(isinstance(m, p.EngineHeartbeat) for m in heard)
        rogue.close()
    w.check()


def test_ftruncate_of_a_ring_is_refused(stack):
    group, run, base = stack
    with Witness(base, group.procs) as w:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(5)
        sock.connect(shm.socket_path(str(run)))
        sock.send(shm.HELLO + b"rogue-truncate")
        msg, fds, _, _ = socket.recv_fds(sock, 1024, 4)
        assert msg == shm.WELCOME and len(fds) == 4
        for fd in fds[:2]:  # the finding: ftruncate of a ring killed the engine with SIGBUS
            for size in (0, 4096, 1 << 30):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
        for fd in fds:
            os.close(fd)
        time.sleep(0.5)
        sock.close()
    w.check()


def test_silent_and_trickling_handshakes_are_closed_within_their_deadline(stack):
    group, run, base = stack
    path = shm.socket_path(str(run))
    with Witness(base, group.procs) as w:
        t0 = time.monotonic()
        silent = []
        for _ in range(6):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(path)
            silent.append(s)
        late = peers.rogue(run, "connects-meanwhile")  # handshakes in progress hold up no one
        late.close()
        trickle = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        trickle.connect(path)
        trickle.send(b"t")  # a handshake is one message: a first byte alone is a bad one
        trickle.settimeout(2)
        assert trickle.recv(1024).startswith(shm.REFUSED)
        for s in silent:
            assert peers.closed_by_engine(s, shm.HANDSHAKE_TIMEOUT_S + 1.0) is not None
            s.close()
        assert time.monotonic() - t0 < shm.HANDSHAKE_TIMEOUT_S + 1.5
        trickle.close()
    w.check()


def test_a_live_frontends_id_is_refused_and_a_reconnect_that_closed_first_is_admitted(stack):
    group, run, base = stack
    victim = stats(base)["frontend"]["frontend_id"]
    with Witness(base, group.procs) as w:
        thief = shm_channel.ShmChannel(str(run), victim, topic_for(victim), p.BROADCAST_TOPIC)
        assert not thief.connect()
        assert "held by a live connection" in thief.refusal
        again = peers.rogue(run, "reconnects")
        again.close()  # its old socket closed first (as ShmChannel.connect does)
        assert again.connect(), again.refusal
        again.close()
    w.check()


def test_peers_past_the_cap_are_refused_and_the_broadcast_holds_no_per_peer_map(stack):
    group, run, base = stack
    engine_pid = group.procs[0].popen.pid
    wait_for(lambda: _shm_summary(base)["peers"] == 1, 10, what="only the real frontend connected")
    fds_before = len(os.listdir(f"/proc/{engine_pid}/fd"))
    with Witness(base, group.procs) as w:
        chans = [shm_channel.ShmChannel(str(run), f"crowd-{i}", topic_for(f"crowd-{i}"), p.BROADCAST_TOPIC)
                 for i in range(300)]
        admitted = [c.connect() for c in chans]
        assert sum(admitted) == MAX_PEERS - 1
        refusals = {c.refusal for c, ok in zip(chans, admitted) if not ok}
        assert refusals == {f"the engine serves its maximum of {MAX_PEERS} shared-memory frontends (--max-shm-peers)"}
        # a peer holds 5: its socket, two doorbells, and the fd each ring's mmap keeps
        assert len(os.listdir(f"/proc/{engine_pid}/fd")) <= fds_before + 5 * (MAX_PEERS - 1) + 4
        one = next(c for c, ok in zip(chans, admitted) if ok)
        broadcasts = []  # the last ones, published after every refusal
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (broadcasts and broadcasts[-1]["shm"]["refused"] >= 300 - 7):
            if one.poll(100):
                while (got := one.recv()) is not None:
                    if isinstance(got.msg, p.Stats) and got.msg.nonce == 0:
                        broadcasts.append(got.msg.data)
        assert broadcasts and not any("frontends" in b for b in broadcasts)
        assert broadcasts[-1]["shm"]["peers"] == MAX_PEERS and broadcasts[-1]["shm"]["refused"] >= 300 - 7
        assert len(stats(base)["frontends"]) >= MAX_PEERS  # the per-peer map: on request
        for c in chans:
            c.close()
        wait_for(lambda: _shm_summary(base)["peers"] == 1, 10, what="the crowd retired")
        wait_for(lambda: len(os.listdir(f"/proc/{engine_pid}/fd")) <= fds_before, 10, what="the crowd's fds closed")
    w.check()


def test_a_frame_larger_than_the_socket_buffer_arrives(stack):
    """A 1.2 MB Submit (more than the socket's ~208 KiB buffer and half the inbound ring):
    it travels as its own sealed memfd and the engine answers it (a refusal: too long)."""
    group, run, base = stack
    with Witness(base, group.procs) as w:
        rogue = peers.rogue(run, "big-frame")
        frame = p.Submit("big-0", "big-frame", [40_000] * 400_000, p.SamplingParams(max_tokens=1), None, 0)
        assert len(codec.encode(frame)) > 1_000_000
        rogue.send(frame, timeout_ms=2000)
        ack = None
        deadline = time.monotonic() + 10
        while ack is None and time.monotonic() < deadline:
            if rogue.poll(100):
                while (got := rogue.recv()) is not None:
                    if isinstance(got.msg, p.Ack):
                        ack = got.msg
        assert ack is not None and ack.request_id == "big-0" and not ack.accepted
        assert stats(base)["frontends"]["big-frame"]["overflow_in"] == 1
        rogue.close()
    w.check()
