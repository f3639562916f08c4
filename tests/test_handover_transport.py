"""The handover carrier between a prefill and a decode engine: a sealed memfd over the
run directory's unix socket, and ZeroMQ over loopback tcp; hostile messages are refused."""

from __future__ import annotations

import array
import os
import socket
import time

import pytest

from shared import handover_wire as hw
from shared.handover_client import HandoverClient
from shared.handover_transport import HEADER, HandoverServer, socket_path
from shared.protocol import RequestOutput, SamplingParams
from tests.procs import free_port

LAYOUT = hw.KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", paired=False,
                     block_nbytes=2 * 2 * 2 * 8 * 4 * 4)


def _handover(rid: str = "r1", blocks: int = 3) -> hw.Handover:
    return hw.Handover(rid, "fe", list(range(1, 11)), [7], SamplingParams(max_tokens=5), "", 0, 0, None,
                       RequestOutput(rid, [7]), LAYOUT, 10, blocks, blocks * LAYOUT.block_nbytes, time.time())


def _until(server: HandoverServer, client: HandoverClient, want: int, timeout: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += server.poll(10)
        client.connect()
        client.receive()
    return got


def _ready(server: HandoverServer, client: HandoverClient, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not client.ready and time.monotonic() < deadline:
        client.connect()
        server.poll(10)
        client.receive()
    assert client.ready and client.engine_id == "dec" and client.layout == LAYOUT


@pytest.mark.parametrize("carrier", ["shm", "staged", "tcp"])
def test_a_handover_arrives_whole_and_acks_come_back(tmp_path, carrier):
    addr = f"tcp://127.0.0.1:{free_port()}"
    shm = carrier != "tcp"
    server = HandoverServer(hw.DecodeHello("dec", LAYOUT), run_dir=str(tmp_path) if shm else "",
                            tcp_addr=addr if not shm else "")
    client = HandoverClient(str(tmp_path) if shm else addr, staging_bytes=1 << 16 if carrier == "staged" else 0)
    try:
        _ready(server, client)
        h = _handover()
        pattern = bytes(i % 251 for i in range(h.kv_bytes))

        def fill(view):
            view[:] = pattern

        client.send_handover(h, fill)
        client.send(hw.HandoverAbort(["x"]))
        got = _until(server, client, 2)
        assert [type(g.msg) for g in got] == [hw.Handover, hw.HandoverAbort]
        assert got[0].msg == h and bytes(got[0].payload) == pattern
        server.reply(got[0].peer, hw.HandoverAck("r1", True))
        server.reply_all(hw.DecodeReport(1, 0, 10, 8, {"s": 3}))
        msgs, deadline = [], time.monotonic() + 10
        while len(msgs) < 2 and time.monotonic() < deadline:
            server.poll(10)
            msgs += client.receive()
        assert msgs == [hw.HandoverAck("r1", True), hw.DecodeReport(1, 0, 10, 8, {"s": 3})]
        assert client.report.session_tokens == {"s": 3}
        assert server.bad == 0
        if carrier == "staged":  # it went through the staging area, whose room is freed on release
            assert (client.num_staged, client.num_memfd) == (1, 0) and client._room(1 << 16) is None
            server.reply(got[0].peer, hw.KVReleased("r1"))
            deadline = time.monotonic() + 10
            while client._room(1 << 16) is None and time.monotonic() < deadline:
                server.poll(10)
                client.receive()
            assert client._room(1 << 16) == 0
            big = _handover("big", blocks=100)  # larger than the area: a memfd of its own
            client.send_handover(big, lambda view: view.__setitem__(slice(None), b"\x07" * big.kv_bytes))
            got = _until(server, client, 1)
            assert got[0].msg == big and bytes(got[0].payload) == b"\x07" * big.kv_bytes
            assert client.num_memfd == 1
    finally:
        client.disconnect()
        server.close()
    if shm:
        assert not os.path.exists(socket_path(str(tmp_path)))


def _raw(tmp_path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(socket_path(str(tmp_path)))
    return s


def test_hostile_handover_messages_are_counted_and_dropped(tmp_path):
    """An unsealed memfd, a size that differs from the one announced, garbage metadata,
    two fds, a plain file: refused, counted, no fd leaked; the server still serves."""
    server = HandoverServer(hw.DecodeHello("dec", LAYOUT), run_dir=str(tmp_path), max_kv_bytes=1 << 20)
    fds_before = len(os.listdir("/proc/self/fd"))
    sock = _raw(tmp_path)
    try:
        server.poll(10)
        meta = hw.encode(_handover())

        def send(fds, header):
            sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])

        unsealed = os.memfd_create("x", os.MFD_ALLOW_SEALING)
        os.ftruncate(unsealed, 8192)
        send([unsealed], HEADER.pack(b"H", len(meta), 4096))
        plain = os.open(str(tmp_path / "f"), os.O_RDWR | os.O_CREAT)
        send([plain], HEADER.pack(b"H", len(meta), 4096))
        send([unsealed, plain], HEADER.pack(b"H", len(meta), 4096))
        send([], HEADER.pack(b"H", len(meta), 4096))
        send([unsealed], HEADER.pack(b"H", 1 << 40, 4096))
        send([unsealed], HEADER.pack(b"H", len(meta), 1 << 30))  # over max_kv_bytes
        sock.send(b"M" + b"\xc1garbage")
        sock.send(b"Zwhat")
        for fd in (unsealed, plain):
            os.close(fd)
        deadline = time.monotonic() + 10
        while server.bad < 8 and time.monotonic() < deadline:
            assert server.poll(10) == []
        assert server.bad == 8
        # a well-formed client still gets through
        client = HandoverClient(str(tmp_path))
        _ready(server, client)
        client.send_handover(_handover("ok"), lambda view: None)
        got = _until(server, client, 1)
        assert got[0].msg.request_id == "ok"
        client.disconnect()
    finally:
        sock.close()
        server.close()
    got = None
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 1
