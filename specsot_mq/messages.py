"""Every message the stage processes exchange, and the one codec that puts them on the wire.

A message is a msgspec Struct below. On the wire it is a ZeroMQ multipart message:

    frame 0   msgpack [PROTOCOL, kind, dst, src, order]   the envelope (a ring node forwards by it alone)
    frame 1   msgpack {field: value}               the body
    frame 2…  raw token ids                        one frame per array, zero copy both ways

Token ids travel as 1-D int32 numpy arrays (TokenIds): inside the body an array is a msgpack
extension (code 1) holding its frame's number, and on receipt it becomes an array over the frame
itself. Nothing is ever pickled, and reading a message takes no torch: the stages without a model
never import it. msgspec decodes each body into its Struct and checks every field's declared type
(SamplingParams' values too); a frame that is malformed, of another protocol version, of an
unknown kind, or whose fields do not have their declared types raises WireError, which a stage
logs and drops.

`order` is [epoch, n] on a message a ring routes (the sender's nth to that stage since its
transport started, `epoch` naming that start), so that its destination takes a sender's messages
in the order sent whichever way round the ring each went; null where a message has one way only.

Requests are named by `rid` (the client's request id) in every message. Only deltas travel: a
point's new tokens, never the whole sequence so far.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, Literal

import msgspec
import numpy as np

from specsot_mq.errors import SpecSotError
from specsot_mq.sampling_params import SamplingParams

PROTOCOL = 3
BROADCAST = "*"  # dst of a message for every stage
_FRAME = 1  # msgpack extension code: token ids in the frame whose number it holds
TokenIds = np.ndarray  # 1-D int32 (see ids())


class WireError(ValueError):
    """A frame that is not a message of this protocol."""


class Tensor(msgspec.Struct, forbid_unknown_fields=True):
    """A tensor's bytes: `dtype` names torch's (float32, bfloat16, int64, bool, ...). `data` is
    decoded as a view into the received message, not a copy (a step's logits are megabytes)."""

    dtype: str
    shape: list[int]
    data: memoryview


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """A wire message: a body with exactly its fields, each of its declared type."""


# -- lifecycle ---------------------------------------------------------------------------------


class Ready(Message):
    """A stage is up (sent to the gateway once at start, and again after a restart)."""

    stage: str
    pid: int
    host: str
    device: str  # "ip#gpu" for a device stage, "" otherwise


class Heartbeat(Message):
    """A stage's periodic sign of life, with what the launcher's table shows."""

    stage: str
    pid: int
    state: str  # "idle" or "busy"
    inflight: int  # requests it holds
    tokens_per_s: float  # tokens it produced per second, over the last few seconds
    rss_mb: float  # resident memory now
    peak_rss_mb: float  # the most resident memory so far
    slots: int = 0  # cache slots (device stages; 0 elsewhere)
    slots_used: int = 0  # of those, sequences decoding now
    drafts: int = 0  # since start: sequence-steps verified by speculative decoding
    draft_tokens: int = 0  # since start: draft tree nodes verified (roots excluded)
    accepted_tokens: int = 0  # since start: of those, accepted
    prefix_lookups: int = 0  # since start: prompts looked up in the prefix store
    prefix_hits: int = 0  # of those, found a stored beginning
    prefix_tokens: int = 0  # prompt tokens those hits did not compute
    prefix_bytes: int = 0  # the store's size now
    shipped_tokens: int = 0  # since start: prompt tokens whose KV another branch stage sent instead (KV shipping)


class Membership(Message):
    """The gateway tells the scheduler which branch stages are alive."""

    branches: list[str]


class Down(Message):
    """The stages the gateway holds to be down now (gateway -> every stage, straight): a ring
    routes around them until they are back."""

    stages: list[str]


class Abort(Message):
    """Drop everything about this request (broadcast; a stage that holds nothing ignores it)."""

    rid: str
    reason: str = ""


# -- a request's way through the stages --------------------------------------------------------


class Ask(Message):
    """A question to answer (client -> gateway -> skeleton)."""

    rid: str
    question: str
    params: SamplingParams
    sot: str = "auto"  # auto | always | never
    history: list[dict[str, str]] = []  # earlier turns, [{"role", "content"}] (system first)


class SkeletonText(Message):
    """New skeleton text as it is decoded (skeleton -> gateway -> client)."""

    rid: str
    text: str
    token_ids: TokenIds  # the tokens behind the text


class Skeleton(Message):
    """The finished skeleton phase (skeleton -> parse). mode "direct" when the router sent the
    question the direct way (then text is empty)."""

    rid: str
    question: str
    params: SamplingParams
    mode: str  # "sot" or "direct"
    reason: str  # the router's verdict
    text: str  # the whole skeleton, starting with the prefilled "1."
    stats: dict  # {"tokens", "steps", "seconds"} of the skeleton phase
    finish: str = "stop"  # how the skeleton's decoding ended ("length" or "repeat": its last line is unfinished)
    history: list[dict[str, str]] = []  # Ask.history


class Planned(Message):
    """The parsed plan (parse -> schedule). mode "direct" when there is nothing to expand."""

    rid: str
    question: str
    params: SamplingParams
    mode: str
    reason: str
    skeleton: str
    points: list[tuple[int, str, int]]  # (index, title, predicted tokens or 0) per point
    stats: dict  # phase name -> {"tokens", "steps", "seconds"}
    history: list[dict[str, str]] = []  # Ask.history
    count: int = 0  # a direct answer to a question that names its count of points: asked for that many


class BranchTask(Message):
    """The prompts one branch stage decodes for a request (schedule -> branch). Every prompt is
    prefix + its suffix; the prefix is computed once. A direct answer is one prompt, prefix empty."""

    rid: str
    params: SamplingParams  # with the phase's own max_tokens and stop strings
    prefix: TokenIds  # shared by every prompt
    indices: list[int]  # the points (0 for a direct answer), longest predicted first
    suffixes: list[TokenIds]  # one per index
    keep: int = 0  # the prompts' first tokens worth keeping for the conversation's next turn (Job.keep)
    # Another branch stage that holds the computed state of these prompts' first kv_tokens tokens (it
    # decoded the conversation's last turn): the receiver may ask it for that KV instead of recomputing
    kv_from: str = ""
    kv_tokens: int = 0


class KvAsk(Message):
    """Send me the computed state (KV) of your longest stored beginning of `ids` (branch -> branch,
    straight). `probe`: instead, that many bytes of padding, which time the link."""

    rid: str
    ids: TokenIds
    probe: int = 0


class KvPart(Message):
    """A piece of the answer to a KvAsk, each under the link's message cap: keys and values of
    layers [first_layer, first_layer + len) of the stored beginning's `tokens` tokens; the last
    piece (part == parts - 1) also carries the draft head's keys, values and feature. tokens 0:
    nothing is held (or a probe's answer, its padding in `pad`)."""

    rid: str
    tokens: int
    part: int
    parts: int
    first_layer: int = 0
    keys: Tensor | None = None
    values: Tensor | None = None
    draft: list[Tensor] = []
    pad: bytes = b""


class MergePlan(Message):
    """What the merge stage waits for (schedule -> merge; merge forwards it to the gateway, which
    learns which branch stages hold the request and shows the client the plan)."""

    rid: str
    mode: str
    reason: str
    skeleton: str
    points: list[tuple[int, str]]  # (index, title) per point, in plan order ([(0, "")] for a direct answer)
    branches: dict[str, list[int]]  # branch stage -> the indices it decodes
    stats: dict
    question: str = ""  # the question (the merge leaves out points that only say it again)


class Reroute(Message):
    """A branch stage died holding part of this request: send its points to a survivor
    (gateway -> schedule)."""

    rid: str
    dead: str  # the branch stage that died


class Reassign(Message):
    """These points start again on another branch stage (schedule -> merge -> gateway -> client):
    what they wrote so far is dropped, and greedy decoding writes it again, the same."""

    rid: str
    indices: list[int]
    stage: str  # the branch stage that decodes them now
    dead: str  # the one that died


class Again(Message):
    """Points of a counted answer that said nothing, written again from a prompt of their own
    (sot/ordered.py): merge -> schedule, which gives them to a branch stage, then schedule ->
    merge -> gateway -> client with `stage` naming it."""

    rid: str
    points: list[tuple[int, int, str]]  # (its new index, the plan's point it writes again, title)
    stage: str = ""  # the branch stage that decodes them (set by schedule)


class PointText(Message):
    """New text of one point (branch -> merge -> gateway -> client). Index 0: a direct answer."""

    rid: str
    index: int
    text: str
    token_ids: TokenIds


class PointEnd(Message):
    """A point finished (branch -> merge -> gateway -> client)."""

    rid: str
    index: int
    finish: str  # "stop" | "length" | "repeat" | "abort"
    tokens: int
    steps: int  # decoder steps that produced them (tokens / steps is the point's tau)
    seconds: float
    kv_shipped: int = 0  # prompt tokens whose KV another branch stage sent for this task (counted at its first end)


class AnswerText(Message):
    """New text of the merged answer, in order (merge -> gateway -> client): its pieces joined are
    exactly Answer.answer. A planned answer's points decode together, but this streams them one
    after another, each as soon as the points before it have ended (see sot/ordered.py)."""

    rid: str
    text: str


class Answer(Message):
    """The merged answer, the last message of a request (merge -> gateway -> client)."""

    rid: str
    answer: str
    mode: str
    reason: str
    skeleton: str
    points: list[tuple[int, str, str]]  # (index, title, expansion) in plan order
    stats: dict  # phase -> {"tokens", "steps", "seconds"}, "seconds" end to end, "prompt_tokens"
    finish: str = "stop"  # "length" when an output hit its token cap, else "stop"


# Why a request failed, for a client to act on (server/app.py gives each its HTTP status):
#   invalid      the request as sent cannot be answered (a bad field, an id already in flight)
#   too_long     its prompt does not fit a device stage's cache: a chat can leave out its oldest
#                turns and ask again (cli/serve.py, the web chat)
#   unavailable  no stage can take it now (down, restarting, unreachable): retry in a moment
#   timeout      its deadline passed
#   cancelled    its client cancelled it
#   internal     anything else (a stage failed while decoding it)
FailCode = Literal["invalid", "too_long", "unavailable", "timeout", "cancelled", "internal"]


class Failed(Message):
    """The request cannot be answered; error says why and what to do, code what kind of failure."""

    rid: str
    error: str
    code: FailCode


# What a client sees of a request, in order, from the stages or the in-process engine alike
# (sot/flow.py): the skeleton's text, the plan, each point's text and end (Reassign: points that
# start again elsewhere; Again: points written again), the merged answer's text, then the Answer
# or Failed.
ClientEvent = SkeletonText | MergePlan | PointText | PointEnd | Reassign | Again | AnswerText | Answer | Failed


# -- client <-> gateway only -------------------------------------------------------------------


class Cancel(Message):
    """The client gives up on a request (Ctrl+C in chat)."""

    rid: str


class StatusQuery(Message):
    """Ask the gateway for every stage's state."""


class Status(Message):
    """Every stage as the gateway last heard from it."""

    ready: bool  # every stage has said Ready and none is down
    stages: list[dict] = []  # one dict per stage: Heartbeat fields + "up", "age"


KINDS: dict[str, type[Message]] = {cls.__name__: cls for cls in (
    Ready, Heartbeat, Membership, Down, Abort, Ask, SkeletonText, Skeleton, Planned, BranchTask, KvAsk, KvPart, MergePlan,
    Reroute, Reassign, Again, PointText, PointEnd, AnswerText, Answer, Failed, Cancel, StatusQuery, Status)}  # fmt: skip


class Envelope(msgspec.Struct):
    """A decoded message with its routing."""

    msg: Any
    dst: str
    src: str


def ids(tokens) -> TokenIds:
    """Token ids as the int32 array messages carry."""
    return np.asarray(tokens, dtype=np.int32)


# The frames of the message being encoded or decoded on this thread, for the hooks below.
_frames = threading.local()


def _to_frame(obj) -> msgspec.msgpack.Ext:
    if not isinstance(obj, np.ndarray):
        raise TypeError(f"cannot send a {type(obj).__name__} in a message")
    if obj.dtype != np.int32 or obj.ndim != 1:
        raise TypeError(f"token ids travel as 1-D int32 arrays, not {obj.dtype} of shape {obj.shape}")
    _frames.out.append(memoryview(np.ascontiguousarray(obj)).cast("B"))
    return msgspec.msgpack.Ext(_FRAME, struct.pack("<I", len(_frames.out) - 1))


def _from_frame(code: int, data: memoryview) -> TokenIds:
    frames = _frames.received
    if code != _FRAME or len(data) != 4 or not 2 <= (index := struct.unpack("<I", data)[0]) < len(frames):
        raise WireError(f"bad token-id reference (extension {code})")
    buf = frames[index].buffer if hasattr(frames[index], "buffer") else memoryview(frames[index])
    if len(buf) % 4:
        raise WireError(f"token-id frame {index} has {len(buf)} bytes, not a whole number of int32s")
    return np.frombuffer(buf, dtype=np.int32)  # read-only, as the frame is


def _token_ids(kind: type, obj):
    if kind is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise TypeError("expected token ids (a frame reference)")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_to_frame)
_DECODERS = {kind: msgspec.msgpack.Decoder(cls, ext_hook=_from_frame, dec_hook=_token_ids) for kind, cls in KINDS.items()}
_ENVELOPE = msgspec.msgpack.Decoder(tuple[int, str, str, str, tuple[int, int] | None])


def encode(msg: Message, dst: str, src: str, order: tuple[int, int] | None = None) -> list:
    """The frames of one message (token ids as zero-copy buffers); `order`: see the module's note."""
    kind = type(msg).__name__
    if KINDS.get(kind) is not type(msg):
        raise TypeError(f"{kind} is not a wire message")
    _frames.out = frames = [msgspec.msgpack.encode((PROTOCOL, kind, dst, src, order)), None]
    try:
        frames[1] = _ENCODER.encode(msg)
    finally:
        _frames.out = None
    return frames


def peek(frames: list) -> tuple[str, str, str, tuple[int, int] | None]:
    """(kind, dst, src, order) from the envelope frame alone, without decoding the body."""
    try:
        version, kind, dst, src, order = _ENVELOPE.decode(_bytes(frames[0]))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        try:  # another version's envelope may have another shape: say which version it is
            version = msgspec.msgpack.decode(_bytes(frames[0]))[0]
        except Exception:
            version = PROTOCOL
        if version == PROTOCOL or not isinstance(version, int):
            raise WireError(f"bad envelope frame ({exc})") from None
    if version != PROTOCOL:
        raise WireError(f"protocol version {version}, this process speaks {PROTOCOL}: run one version everywhere")
    if kind not in KINDS:
        raise WireError(f"unknown message kind {kind!r}")
    return kind, dst, src, order


def decode(frames: list) -> Envelope:
    """The message in these frames, or WireError naming what is wrong with them."""
    if len(frames) < 2:
        raise WireError(f"a message has at least 2 frames, got {len(frames)}")
    kind, dst, src, _ = peek(frames)
    _frames.received = frames
    try:
        msg = _DECODERS[kind].decode(_bytes(frames[1]))
    except (msgspec.MsgspecError, SpecSotError, ValueError, TypeError) as exc:  # SamplingParams' checks raise SpecSotError
        raise WireError(f"bad {kind} body ({exc})") from None
    finally:
        _frames.received = None
    return Envelope(msg, dst, src)


def _bytes(frame):
    return frame.buffer if hasattr(frame, "buffer") else frame


# -- a layer range served to another process (split.py's RemoteRange and RangeServer) ----------
# These travel on a socket of their own, a request and its reply, between the process that runs a
# model's first layers and the one that holds a later range: a tagged msgpack body, tensors as raw
# bytes (no pickle, and no torch needed to read one).


class RangeHello(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Which layers the server holds (RangeReply.first_layer, last_layer)."""


class RangeNewCache(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Allocate a KV cache for the range under the caller's name for it (one it had there before
    is made again, empty); `free`: caches the caller no longer holds, dropped first."""

    name: int
    slots: int
    capacity: int
    free: list[int] = []


class RangeForward(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """One forward of the range (model.Step's fields): x is token ids [B, T] for a range that holds
    the embedding, else the hidden state before its first layer [B, T, H]."""

    cache: int  # which (RangeNewCache's reply)
    x: Tensor
    slots: list[int]
    starts: list[int]
    positions: Tensor
    mask: Tensor | None
    logit_rows: list[int] | None
    hidden_layers: list[int]


class RangeCacheOp(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """A cache operation of the slot manager's (kv_cache.KVCache's copy, move, snapshot, restore)."""

    cache: int
    op: str
    slot: int
    slots: list[int] = []  # copy's destinations
    positions: list[int] = []  # move's sources
    at: int = 0  # copy's length, move's destination, snapshot's length
    kv: list[Tensor] = []  # restore's keys and values


class RangeStop(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """The server's last request: it answers, then ends."""


RANGE_REQUESTS = RangeHello | RangeNewCache | RangeForward | RangeCacheOp | RangeStop


class RangeReply(msgspec.Struct, forbid_unknown_fields=True):
    """What a range request gives back; `error` says what failed instead."""

    error: str = ""
    epoch: str = ""  # the server process's own id: a new one means it restarted and holds no cache of before
    caches: list[int] = []  # a hello's: the names of the caches it holds
    logits: Tensor | None = None
    hidden: list[Tensor] = []
    kv: list[Tensor] = []  # a snapshot's keys and values
    held: int = 0  # entries a restore put back
    in_place: bool = False  # a new cache's: its forwards attend in place (LlamaModel.attends_in_place)
    first_layer: int = 0
    last_layer: int = 0
