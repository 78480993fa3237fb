"""The wire codec: every message kind round-trips, token ids travel as their own frames (empty,
non-contiguous, long), a field of the wrong type (token ids of another dtype or shape among them,
sampling settings out of range) and malformed frames are a WireError, never a crash."""

import itertools

import msgspec
import numpy as np
import pytest
import zmq

from specsot_mq.messages import (
    KINDS, PROTOCOL, Answer, Ask, BranchTask, FailCode, Heartbeat, MergePlan, PointText, Status, StatusQuery, WireError, decode,
    Tensor, encode, ids, peek,
)  # fmt: skip
from specsot_mq.sampling_params import SamplingParams

TOKEN_IDS = {
    "empty": ids([]),
    "non-contiguous": np.arange(48, dtype=np.int32).reshape(4, 12).T[1],
    "long": np.arange(100_000, dtype=np.int32),
}
NOT_TOKEN_IDS = {
    "float": np.ones(3, dtype=np.float32),
    "2-d": np.zeros((2, 4), dtype=np.int32),
    "scalar": np.int32(7),
    "int64": np.array([1, 2]),
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


@pytest.mark.parametrize("name", TOKEN_IDS)
@pytest.mark.parametrize("over_zmq", [False, True])
def test_token_ids_round_trip_exactly(name, over_zmq):
    t = TOKEN_IDS[name]
    got = round_trip(PointText("r1", 2, "héllo ✓", t), over_zmq).token_ids
    assert got.dtype == np.int32 and got.shape == t.shape and np.array_equal(got, t)


@pytest.mark.parametrize("name", NOT_TOKEN_IDS)
def test_token_ids_of_another_kind_are_refused_when_sent(name):
    with pytest.raises(TypeError):
        encode(PointText("r1", 2, "x", NOT_TOKEN_IDS[name]), "merge", "x")


@pytest.mark.parametrize("body, complaint", [
    ({"rid": 5, "index": 2, "text": "x", "token_ids": msgspec.msgpack.Ext(1, b"\2\0\0\0")}, "Expected `str`"),
    ({"rid": "r", "index": True, "text": "x", "token_ids": msgspec.msgpack.Ext(1, b"\2\0\0\0")}, "Expected `int`"),
    ({"rid": "r", "index": 2, "text": "x", "token_ids": [1, 2]}, "token ids"),
])  # fmt: skip
def test_a_field_of_the_wrong_type_is_a_wire_error(body, complaint):
    frames = [msgspec.msgpack.encode([PROTOCOL, "PointText", "g", "s", None]), msgspec.msgpack.encode(body), ids([1]).tobytes()]
    with pytest.raises(WireError, match=complaint):
        decode(frames)


def test_sampling_settings_are_checked_on_receipt():
    good = encode(Ask("r", "q", SamplingParams(max_tokens=9, stop=("\n\n",)), "always"), "skeleton", "gateway")
    body = msgspec.msgpack.decode(good[1])
    body["params"]["max_tokens"] = 0
    with pytest.raises(WireError, match="max_tokens must be at least 1"):
        decode([good[0], msgspec.msgpack.encode(body)])
    body["params"] = {"max_tokens": 9, "stop": "not a list"}
    with pytest.raises(WireError, match="params.stop"):
        decode([good[0], msgspec.msgpack.encode(body)])


def test_token_ids_travel_as_their_own_frames_not_inside_the_body():
    t = np.arange(1000, dtype=np.int32)
    frames = encode(BranchTask("r", SamplingParams(), t[:10], [1, 2], [t, t[5:]]), "b", "s")
    assert len(frames) == 5 and len(frames[1]) < 1000  # 1000 ids inside would take 3000 bytes
    got = decode(frames).msg
    assert np.array_equal(got.prefix, t[:10]) and np.array_equal(got.suffixes[1], t[5:]) and got.indices == [1, 2]


SAMPLES = {str: "x", int: 3, float: 1.5, bool: True, dict: {"a": [1, "b"]}, list[str]: ["a", "b"], list[int]: [1, 2],
           list[dict]: [{"stage": "x"}], list[dict[str, str]]: [{"role": "user", "content": "hi"}],
           dict[str, list[int]]: {"branch@a": [1, 2]}, list[tuple[int, str]]: [(1, "t")],
           list[tuple[int, str, int]]: [(1, "t", 40)], list[tuple[int, str, str]]: [(1, "t", "text")],
           list[tuple[int, int, str]]: [(3, 1, "t")],
           np.ndarray: ids([1, 2]), list[np.ndarray]: [ids([4]), ids([])],
           SamplingParams: SamplingParams(max_tokens=9, temperature=0.7, top_k=5, top_p=0.9, seed=3, stop=("\n\n", "2.")),
           bytes: b"\x00\x01", Tensor | None: Tensor("float16", [1, 2], b"\x00\x3c\x00\x40"),
           list[Tensor]: [Tensor("float32", [1], b"\x00\x00\x80\x3f")], FailCode: "too_long"}  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_round_trips(kind):
    cls = KINDS[kind]
    hints = msgspec.structs.fields(cls)
    msg = cls(*(SAMPLES[f.type] for f in hints))
    got = round_trip(msg)
    for f in hints:
        a, b = getattr(got, f.name), getattr(msg, f.name)
        if f.type is np.ndarray:
            assert np.array_equal(a, b), f.name
        elif f.type == list[np.ndarray]:
            assert [x.tolist() for x in a] == [x.tolist() for x in b], f.name
        else:
            assert a == b, (kind, f.name)


GOOD = encode(Heartbeat("s", 1, "idle", 0, 0.0, 1.0, 2.0), "gateway", "s")
POINT = encode(PointText("r", 1, "t", ids([1, 2, 3])), "g", "s")
MALFORMED = {
    "one frame": [GOOD[0]],
    "envelope not msgpack": [b"\xc1\xc1", GOOD[1]],
    "envelope of another shape": [msgspec.msgpack.encode([PROTOCOL, "Heartbeat", "g"]), GOOD[1]],
    "other protocol version": [msgspec.msgpack.encode([PROTOCOL + 1, "Heartbeat", "g", "s"]), GOOD[1]],
    "unknown kind": [msgspec.msgpack.encode([PROTOCOL, "Pickle", "g", "s", None]), GOOD[1]],
    "order not [epoch, n]": [msgspec.msgpack.encode([PROTOCOL, "Heartbeat", "g", "s", [1]]), GOOD[1]],
    "body not msgpack": [GOOD[0], b"\xc1"],
    "missing field": [GOOD[0], msgspec.msgpack.encode({"stage": "s"})],
    "extra field": [GOOD[0], msgspec.msgpack.encode({**msgspec.msgpack.decode(GOOD[1]), "x": 1})],
    "missing token-id frame": POINT[:2],
    "token-id frame of odd length": POINT[:2] + [b"\0" * 5],
    "failure code not in its list": [msgspec.msgpack.encode([PROTOCOL, "Failed", "g", "s", None]),
                                     msgspec.msgpack.encode({"rid": "r", "error": "e", "code": "oops"})],
    "unknown extension": [POINT[0], msgspec.msgpack.encode({"rid": "r", "index": 1, "text": "", "token_ids": msgspec.msgpack.Ext(7, b"")}),
                          b"1234"],
}  # fmt: skip


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_frames_are_a_wire_error(name):
    with pytest.raises(WireError):
        decode(MALFORMED[name])


def test_another_protocol_versions_envelope_is_named_by_its_version_whatever_its_shape():
    """A process of another version: the error says to run one version, not that the frame is bad."""
    for old in ([PROTOCOL - 1, "Heartbeat", "g", "s"], [PROTOCOL + 1, "Heartbeat", "g", "s", None, 7]):
        with pytest.raises(WireError, match=f"protocol version {old[0]}, this process speaks {PROTOCOL}"):
            decode([msgspec.msgpack.encode(old), GOOD[1]])


def test_peek_reads_only_the_envelope():
    frames = encode(Answer("r", "a", "sot", "", "", [], {}), "gateway", "merge")
    assert peek([frames[0], b"garbage"]) == ("Answer", "gateway", "merge", None)
    assert peek(encode(Answer("r", "a", "sot", "", "", [], {}), "gateway", "merge", (7, 3)))[3] == (7, 3)


def test_fieldless_and_default_messages():
    assert isinstance(round_trip(StatusQuery()), StatusQuery)
    assert round_trip(Status(True, [{"stage": "x", "up": True}])).stages == [{"stage": "x", "up": True}]
    assert round_trip(Ask("r", "q", SamplingParams())).history == []


def test_objects_that_are_not_plain_data_are_refused():
    with pytest.raises(TypeError):
        encode(MergePlan("r", "sot", "", "", [], {}, {"x": object()}), "a", "b")


def test_a_tensor_is_read_where_a_writable_message_holds_it_else_copied():
    """remote_range.from_wire: over ZeroMQ's own (writable) buffer a tensor field is a view, no
    copy (a range step's logits are megabytes); from immutable bytes it is a copy, so writing the
    tensor never changes the message."""
    import torch

    from specsot_mq.messages import RangeReply
    from specsot_mq.remote_range import from_wire, to_wire

    logits = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    raw = msgspec.msgpack.encode(RangeReply(logits=to_wire(logits)))
    decoder = msgspec.msgpack.Decoder(RangeReply)
    with zmq.Context() as ctx, ctx.socket(zmq.PAIR) as a, ctx.socket(zmq.PAIR) as b:
        address = next(ENDPOINTS)
        a.bind(address)
        b.connect(address)
        a.send(raw, copy=False)
        frame = b.recv(copy=False)
        view = from_wire(decoder.decode(frame.buffer).logits)
        assert torch.equal(view, logits)
        view[0, 0] = 99.0  # the tensor's memory is the frame's
        assert from_wire(decoder.decode(frame.buffer).logits)[0, 0] == 99.0
    copied = from_wire(decoder.decode(raw).logits)
    copied[0, 0] = 99.0
    assert from_wire(decoder.decode(raw).logits)[0, 0] == 0.0 and raw == msgspec.msgpack.encode(RangeReply(logits=to_wire(logits)))
