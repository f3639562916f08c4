"""Wire format, transport and configuration: fast, no model."""

from __future__ import annotations

import argparse
import tempfile
import time

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import codec, config as cfg
from shared import protocol as p
from shared.transport import ClientChannel, EngineInbound, EngineOutbound, SequenceGap, topic_for

PARAMS = p.SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7,
                          presence_penalty=0.1, frequency_penalty=-0.2, repetition_penalty=1.1,
                          logit_bias={5: -100.0, 9: 2.5}, stop_token_ids=[2, 3], ignore_eos=True,
                          min_tokens=2, logprobs=3)

EXAMPLES = [
    p.Hello("fe-1"),
    p.Submit("r1", "fe-1", [1, 2, 3], PARAMS, "alice", 2),
    p.Submit("r2", "fe-1", [7], p.SamplingParams()),
    p.Abort("fe-1", ["r1", "r2"]),
    p.Heartbeat("fe-1"),
    p.Goodbye("fe-1"),
    p.StatsRequest("fe-1", 42),
    p.Welcome("eng", 2048, [2], 256, 0.25),
    p.Welcome("eng", 2048, [2], 256, 0.25, p.RuntimeInfo("/m", "cpu", "float32", 1, "paged", "chunked", "fcfs")),
    p.Ack("r1", True),
    p.Ack("r2", False, p.RejectReason(p.RejectCode.KV_BUDGET, "too big", 900, 512)),
    p.StepOutput([p.RequestOutput("r1", [5, 6], None, [p.TokenLogprob(5, -0.1, [5, 8], [-0.1, -2.0]),
                                                        p.TokenLogprob(6, -0.3)], 3, 0),
                  p.RequestOutput("r2", [], p.FinishReason.ABORT, None, 1, 0, "gone")]),
    p.Stats(42, {"num_active": 3, "nested": {"a": [1, 2]}}),
    p.EngineHeartbeat("eng", 123.5),
]


def test_every_message_type_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(codec.TAGS.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert codec.decode(codec.encode(msg)) == msg


@pytest.mark.parametrize("frame", [b"", b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([999, 1]),
                                   msgpack.packb([2, "r1"]), msgpack.packb(["x"]),
                                   msgpack.packb([2, "r", "f", [1], [1, 2, 3], None, 0])])
def test_malformed_frames_raise_decode_error(frame):
    with pytest.raises(codec.DecodeError):
        codec.decode(frame)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_decode_error(data):
    try:
        codec.decode(data)
    except codec.DecodeError:
        pass


def test_sampling_params_validation_messages():
    assert p.SamplingParams().validate() is None
    assert "temperature" in p.SamplingParams(temperature=3).validate()
    assert "min_tokens" in p.SamplingParams(max_tokens=2, min_tokens=3).validate()
    assert p.RejectCode.QUEUE_FULL.http_status == 429
    assert p.RejectCode.CONTEXT_LENGTH.http_status == 400


def test_zmq_classes_implement_the_transport_protocols():
    from shared import transport as t

    for impl, proto in ((t.EngineInbound, t.Inbound), (t.EngineOutbound, t.Outbound),
                        (t.ClientChannel, t.Client)):
        wanted = {n for n in vars(proto) if not n.startswith("_")} - {"sock"}
        assert wanted and wanted <= set(vars(impl)), (impl, wanted - set(vars(impl)))


def test_pub_sub_sequence_gap_is_detected():
    ctx = zmq.Context()
    d = tempfile.mkdtemp(prefix="ts-", dir="/tmp")
    out = EngineOutbound(ctx, f"ipc://{d}/out.sock")
    EngineInbound(ctx, f"ipc://{d}/in.sock").close()
    topic = topic_for("fe-a")
    chan = ClientChannel(ctx, f"ipc://{d}/in.sock", f"ipc://{d}/out.sock", topic)
    try:
        deadline = time.monotonic() + 5
        got = None
        while got is None and time.monotonic() < deadline:  # slow joiner: publish until seen
            out.publish(topic, p.Heartbeat("x"))
            if chan.poll(50):
                got = chan.recv()
        assert got is not None
        while chan.poll(50):
            chan.recv()
        out._seq[topic] += 1  # one frame lost
        out.publish(topic, p.Heartbeat("x"))
        assert chan.poll(2000)
        with pytest.raises(SequenceGap):
            chan.recv()
        # A longer topic that merely starts with ours is not delivered to us.
        out.publish(topic_for("fe-a") + b"zz", p.Heartbeat("y"))
        out.publish(topic, p.Heartbeat("z"))
        assert chan.poll(2000)
        msgs = []
        while chan.poll(200):
            r = chan.recv()
            if r:
                msgs.append(r.msg)
        assert msgs == [p.Heartbeat("z")]
    finally:
        chan.close()
        out.close()
        ctx.term()


def test_config_precedence_flags_over_env_over_defaults():
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, cfg.EngineConfig)
    env = {"TICKSERVE_MAX_BATCH_SIZE": "7", "TICKSERVE_POLICY": "fair"}
    c = cfg.build(cfg.EngineConfig, parser.parse_args(["--policy", "fcfs"]), env)
    assert (c.max_batch_size, c.policy, c.max_queue_size) == (7, "fcfs", cfg.EngineConfig().max_queue_size)
    with pytest.raises(ValueError, match="TICKSERVE_MAX_BATCH_SIZE"):
        cfg.build(cfg.EngineConfig, None, {"TICKSERVE_MAX_BATCH_SIZE": "many"})
    again = cfg.build(cfg.EngineConfig, parser.parse_args(cfg.to_argv(c)), {})
    assert again == c


def test_prefill_mode_derivation_and_problems():
    assert cfg.EngineConfig(prefill_chunk_size=0).resolved_prefill_mode is cfg.PrefillMode.MONOLITHIC
    assert cfg.EngineConfig(prefill_chunk_size=64).resolved_prefill_mode is cfg.PrefillMode.CHUNKED
    assert cfg.EngineConfig(prefill_mode="monolithic").resolved_prefill_mode is cfg.PrefillMode.MONOLITHIC
    assert cfg.EngineConfig(prefill_mode="bogus").problems()
    assert cfg.EngineConfig(prefill_mode="chunked", prefill_chunk_size=0).problems()
    assert cfg.EngineConfig(policy="lottery").problems()
