"""The wire codec: every message kind round-trips, token-id tensors travel as their own frames
(empty, non-contiguous, long), a field of the wrong type (a tensor of another dtype or shape
among them) and malformed frames are a WireError, never a crash."""

import itertools

import msgpack
import pytest
import torch
import zmq

from specsot_mq.messages import (
    KINDS, PROTOCOL, Answer, Ask, BranchTask, Heartbeat, PointText, Status, StatusQuery, WireError, decode,
    encode, params_from_wire, params_to_wire, peek,
)  # fmt: skip
from specsot_mq.sampling import SamplingParams

TENSORS = {
    "empty": torch.empty(0, dtype=torch.int32),
    "non-contiguous": torch.arange(48, dtype=torch.int32).reshape(4, 12).t()[1],
    "long": torch.arange(100_000, dtype=torch.int32),
}
NOT_TOKEN_IDS = {
    "bf16": torch.randn(3, 5).to(torch.bfloat16),
    "2-d": torch.zeros(2, 4, dtype=torch.int32),
    "scalar": torch.tensor(7, dtype=torch.int32),
    "int64": torch.tensor([1, 2]),
    "bool": torch.tensor([True, False, True]),
}
ENDPOINTS = (f"inproc://codec-test-{n}" for n in itertools.count())  # closing unbinds asynchronously: never reuse one


def round_trip(msg, over_zmq=False):
    frames = encode(msg, "merge", "branch@x")
    if over_zmq:  # through real sockets, with zero-copy sends and receives
        ctx = zmq.Context.instance()
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        endpoint = next(ENDPOINTS)
        a.bind(endpoint)
        b.connect(endpoint)
        a.send_multipart(frames, copy=False)
        frames = b.recv_multipart(copy=False)
        a.close(), b.close()
    env = decode(frames)
    assert (env.dst, env.src) == ("merge", "branch@x")
    return env.msg


@pytest.mark.parametrize("name", TENSORS)
@pytest.mark.parametrize("over_zmq", [False, True])
def test_tensors_round_trip_exactly(name, over_zmq):
    t = TENSORS[name]
    got = round_trip(PointText("r1", 2, "héllo ✓", t), over_zmq).token_ids
    assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)


@pytest.mark.parametrize("name", NOT_TOKEN_IDS)
def test_a_field_of_the_wrong_type_is_a_wire_error(name):
    with pytest.raises(WireError, match="PointText.token_ids must be torch.Tensor"):
        round_trip(PointText("r1", 2, "x", NOT_TOKEN_IDS[name]))
    for bad in (PointText(5, 2, "x", TENSORS["empty"]), PointText("r", True, "x", TENSORS["empty"]),
                BranchTask("r", {}, TENSORS["empty"], [1], [[1, 2]])):  # fmt: skip
        with pytest.raises(WireError, match="must be"):
            round_trip(bad)


def test_tensors_travel_as_their_own_frames_not_inside_the_body():
    t = torch.arange(1000, dtype=torch.int32)
    frames = encode(BranchTask("r", {}, t[:10], [1, 2], [t, t[5:]]), "b", "s")
    assert len(frames) == 5 and len(frames[1]) < 200
    got = decode(frames).msg
    assert torch.equal(got.prefix, t[:10]) and torch.equal(got.suffixes[1], t[5:]) and got.indices == [1, 2]


def test_every_kind_round_trips():
    for kind, cls in KINDS.items():
        import dataclasses

        values = {}
        for f in dataclasses.fields(cls):
            values[f.name] = {"str": "x", "int": 3, "float": 1.5, "dict": {"a": [1, "b"]}, "list": [[1, "t"]],
                              "bool": True, "list[str]": ["a", "b"], "list[int]": [1, 2],
                              "list[torch.Tensor]": [torch.tensor([4], dtype=torch.int32)]}.get(
                str(f.type), torch.tensor([1, 2], dtype=torch.int32))  # fmt: skip
        msg = cls(**values)
        got = round_trip(msg)
        for f in dataclasses.fields(cls):
            a, b = getattr(got, f.name), getattr(msg, f.name)
            assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, (kind, f.name)


def test_sampling_params_round_trip():
    p = SamplingParams(max_tokens=9, temperature=0.7, top_k=5, top_p=0.9, seed=3, stop=("\n\n", "2."))
    assert params_from_wire(round_trip(Ask("r", "q", params_to_wire(p))).params) == p


GOOD = encode(Heartbeat("s", 1, "idle", 0, 0.0, 1.0, 2.0), "gateway", "s")
MALFORMED = {
    "one frame": [GOOD[0]],
    "envelope not msgpack": [b"\xc1\xc1", GOOD[1]],
    "other protocol version": [msgpack.packb([PROTOCOL + 1, "Heartbeat", "g", "s"]), GOOD[1]],
    "unknown kind": [msgpack.packb([PROTOCOL, "Pickle", "g", "s"]), GOOD[1]],
    "body not msgpack": [GOOD[0], b"\xc1"],
    "missing field": [GOOD[0], msgpack.packb({"stage": "s"})],
    "extra field": [GOOD[0], msgpack.packb({**msgpack.unpackb(GOOD[1]), "x": 1})],
    "missing tensor frame": encode(PointText("r", 1, "t", torch.ones(3)), "g", "s")[:2],
    "short tensor frame": encode(PointText("r", 1, "t", torch.ones(3)), "g", "s")[:2] + [b"\0" * 5],
    "unknown dtype": [msgpack.packb([PROTOCOL, "PointText", "g", "s"]), msgpack.packb(
        {"rid": "r", "index": 1, "text": "", "token_ids": msgpack.ExtType(1, msgpack.packb([2, "complex", [1]]))}), b"12345678"],
}  # fmt: skip


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_frames_are_a_wire_error(name):
    with pytest.raises(WireError):
        decode(MALFORMED[name])


def test_peek_reads_only_the_envelope():
    frames = encode(Answer("r", "a", "sot", "", "", [], {}), "gateway", "merge")
    assert peek([frames[0], b"garbage"]) == ("Answer", "gateway", "merge")


def test_fieldless_and_default_messages():
    assert isinstance(round_trip(StatusQuery()), StatusQuery)
    assert round_trip(Status(True, [{"stage": "x", "up": True}])).stages == [{"stage": "x", "up": True}]


def test_objects_that_are_not_plain_data_are_refused():
    with pytest.raises(TypeError):
        encode(Ask("r", "q", {"x": object()}), "a", "b")
