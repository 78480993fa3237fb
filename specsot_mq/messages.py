"""Every message the stage processes exchange, and the one codec that puts them on the wire.

A message is a dataclass below. On the wire it is a ZeroMQ multipart message:

    frame 0   msgpack [PROTOCOL, kind, dst, src]   the envelope (a ring node forwards by it alone)
    frame 1   msgpack {field: value}               the body
    frame 2…  raw tensor bytes                     one frame per tensor, zero copy both ways

A tensor inside the body is a msgpack extension (code 1) holding [frame number, dtype, shape]; on
receipt it becomes `torch.frombuffer` over the frame itself. Nothing is ever pickled. A frame that is
malformed, of another protocol version, of an unknown kind, or whose fields do not have their
declared types (every tensor a message carries is int32 token ids, 1-D) raises WireError, which a
stage logs and drops.

Requests are named by `rid` (the client's request id) in every message. Only deltas travel: a
point's new tokens, never the whole sequence so far.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

PROTOCOL = 1
BROADCAST = "*"  # dst of a message for every stage
_TENSOR = 1  # msgpack extension code
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}  # fmt: skip


class WireError(ValueError):
    """A frame that is not a message of this protocol."""


# -- lifecycle ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Ready:
    """A stage is up (sent to the gateway once at start, and again after a restart)."""

    stage: str
    pid: int
    host: str
    device: str  # "ip#gpu" for a device stage, "" otherwise


@dataclass(slots=True)
class Heartbeat:
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


@dataclass(slots=True)
class Membership:
    """The gateway tells the scheduler which branch stages are alive."""

    branches: list[str]


@dataclass(slots=True)
class Down:
    """The stages the gateway holds to be down now (gateway -> every stage, straight): a ring
    routes around them until they are back."""

    stages: list[str]


@dataclass(slots=True)
class Abort:
    """Drop everything about this request (broadcast; a stage that holds nothing ignores it)."""

    rid: str
    reason: str = ""


# -- a request's way through the stages --------------------------------------------------------


@dataclass(slots=True)
class Ask:
    """A question to answer (client -> gateway -> skeleton)."""

    rid: str
    question: str
    params: dict  # SamplingParams fields (see params_to_wire)
    sot: str = "auto"  # auto | always | never
    history: list = field(default_factory=list)  # earlier turns, [{"role", "content"}] (system first)


@dataclass(slots=True)
class SkeletonText:
    """New skeleton text as it is decoded (skeleton -> gateway -> client)."""

    rid: str
    text: str
    token_ids: torch.Tensor  # int32, the tokens behind the text


@dataclass(slots=True)
class Skeleton:
    """The finished skeleton phase (skeleton -> parse). mode "direct" when the router sent the
    question the direct way (then text is empty)."""

    rid: str
    question: str
    params: dict
    mode: str  # "sot" or "direct"
    reason: str  # the router's verdict
    text: str  # the whole skeleton, starting with the prefilled "1."
    stats: dict  # {"tokens", "steps", "seconds"} of the skeleton phase
    finish: str = "stop"  # how the skeleton's decoding ended ("length" or "repeat": its last line is unfinished)
    history: list = field(default_factory=list)  # Ask.history


@dataclass(slots=True)
class Planned:
    """The parsed plan (parse -> schedule). mode "direct" when there is nothing to expand."""

    rid: str
    question: str
    params: dict
    mode: str
    reason: str
    skeleton: str
    points: list  # [index, title, predicted tokens or 0] per point
    stats: dict  # phase name -> {"tokens", "steps", "seconds"}
    history: list = field(default_factory=list)  # Ask.history


@dataclass(slots=True)
class BranchTask:
    """The prompts one branch stage decodes for a request (schedule -> branch). Every prompt is
    prefix + its suffix; the prefix is computed once. A direct answer is one prompt, prefix empty."""

    rid: str
    params: dict  # with the phase's own max_tokens and stop strings
    prefix: torch.Tensor  # int32 token ids shared by every prompt
    indices: list[int]  # the points (0 for a direct answer), longest predicted first
    suffixes: list[torch.Tensor]  # int32 token ids, one per index
    keep: int = 0  # the prompts' first tokens worth keeping for the conversation's next turn (Job.keep)


@dataclass(slots=True)
class MergePlan:
    """What the merge stage waits for (schedule -> merge; merge forwards it to the gateway, which
    learns which branch stages hold the request and shows the client the plan)."""

    rid: str
    mode: str
    reason: str
    skeleton: str
    points: list  # [index, title] per point, in plan order ([[0, ""]] for a direct answer)
    branches: dict  # branch stage -> the indices it decodes
    stats: dict


@dataclass(slots=True)
class Reroute:
    """A branch stage died holding part of this request: send its points to a survivor
    (gateway -> schedule)."""

    rid: str
    dead: str  # the branch stage that died


@dataclass(slots=True)
class Reassign:
    """These points start again on another branch stage (schedule -> merge -> gateway -> client):
    what they wrote so far is dropped, and greedy decoding writes it again, the same."""

    rid: str
    indices: list[int]
    stage: str  # the branch stage that decodes them now
    dead: str  # the one that died


@dataclass(slots=True)
class PointText:
    """New text of one point (branch -> merge -> gateway -> client). Index 0: a direct answer."""

    rid: str
    index: int
    text: str
    token_ids: torch.Tensor  # int32


@dataclass(slots=True)
class PointEnd:
    """A point finished (branch -> merge -> gateway -> client)."""

    rid: str
    index: int
    finish: str  # "stop" | "length" | "repeat" | "abort"
    tokens: int
    steps: int  # decoder steps that produced them (tokens / steps is the point's tau)
    seconds: float


@dataclass(slots=True)
class AnswerText:
    """New text of the merged answer, in order (merge -> gateway -> client): its pieces joined are
    exactly Answer.answer. A planned answer's points decode together, but this streams them one
    after another, each as soon as the points before it have ended (see sot/ordered.py)."""

    rid: str
    text: str


@dataclass(slots=True)
class Answer:
    """The merged answer, the last message of a request (merge -> gateway -> client)."""

    rid: str
    answer: str
    mode: str
    reason: str
    skeleton: str
    points: list  # [index, title, expansion] in plan order
    stats: dict  # phase -> {"tokens", "steps", "seconds"}, "seconds" end to end, "prompt_tokens"
    finish: str = "stop"  # "length" when an output hit its token cap, else "stop"


@dataclass(slots=True)
class Failed:
    """The request cannot be answered; error says why and what to do."""

    rid: str
    error: str


# What a client sees of a request, in order, from the stages or the in-process engine alike
# (sot/flow.py): the skeleton's text, the plan, each point's text and end (Reassign: points that
# start again elsewhere), the merged answer's text, then the Answer or Failed.
ClientEvent = SkeletonText | MergePlan | PointText | PointEnd | Reassign | AnswerText | Answer | Failed


# -- client <-> gateway only -------------------------------------------------------------------


@dataclass(slots=True)
class Cancel:
    """The client gives up on a request (Ctrl+C in chat)."""

    rid: str


@dataclass(slots=True)
class StatusQuery:
    """Ask the gateway for every stage's state."""


@dataclass(slots=True)
class Status:
    """Every stage as the gateway last heard from it."""

    ready: bool  # every stage has said Ready and none is down
    stages: list = field(default_factory=list)  # one dict per stage: Heartbeat fields + "up", "age"


KINDS: dict[str, type] = {cls.__name__: cls for cls in (
    Ready, Heartbeat, Membership, Down, Abort, Ask, SkeletonText, Skeleton, Planned, BranchTask, MergePlan, Reroute,
    Reassign, PointText, PointEnd, AnswerText, Answer, Failed, Cancel, StatusQuery, Status)}  # fmt: skip
_FIELDS = {name: tuple(f.name for f in dataclasses.fields(cls)) for name, cls in KINDS.items()}
_TYPES = {name: {f.name: f.type for f in dataclasses.fields(cls)} for name, cls in KINDS.items()}
_PLAIN = {"str": str, "int": int, "float": (int, float), "bool": bool, "dict": dict, "list": list, "torch.Tensor": torch.Tensor}


def _conforms(value, annotation: str) -> bool:
    """Whether a received field's value has its declared type (a tensor: int32 token ids, 1-D)."""
    if annotation.startswith("list[") and annotation.endswith("]"):
        return isinstance(value, list) and all(_conforms(v, annotation[5:-1]) for v in value)
    if isinstance(value, bool) and annotation in ("int", "float"):
        return False
    if isinstance(value, torch.Tensor):
        return annotation == "torch.Tensor" and value.dtype == torch.int32 and value.dim() == 1
    return isinstance(value, _PLAIN[annotation])


@dataclass(slots=True)
class Envelope:
    """A decoded message with its routing."""

    msg: Any
    dst: str
    src: str


def encode(msg, dst: str, src: str) -> list:
    """The frames of one message (tensors as zero-copy buffers)."""
    kind = type(msg).__name__
    if kind not in KINDS:
        raise TypeError(f"{kind} is not a wire message")
    frames: list = [None, None]

    def tensor(obj):
        if not isinstance(obj, torch.Tensor):
            raise TypeError(f"cannot send a {type(obj).__name__} in a message")
        name = str(obj.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"cannot send a {obj.dtype} tensor")
        flat = obj.detach().to("cpu").contiguous().reshape(-1)
        frames.append(memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b"")
        return msgpack.ExtType(_TENSOR, msgpack.packb([len(frames) - 1, name, list(obj.shape)]))

    body = {name: getattr(msg, name) for name in _FIELDS[kind]}
    frames[0] = msgpack.packb([PROTOCOL, kind, dst, src])
    frames[1] = msgpack.packb(body, default=tensor)
    return frames


def peek(frames: list) -> tuple[str, str, str]:
    """(kind, dst, src) from the envelope frame alone, without decoding the body."""
    try:
        version, kind, dst, src = msgpack.unpackb(_bytes(frames[0]))
    except Exception as exc:
        raise WireError(f"bad envelope frame ({exc})") from None
    if version != PROTOCOL:
        raise WireError(f"protocol version {version}, this process speaks {PROTOCOL}: run one version everywhere")
    if kind not in KINDS:
        raise WireError(f"unknown message kind {kind!r}")
    return kind, dst, src


def decode(frames: list) -> Envelope:
    """The message in these frames, or WireError naming what is wrong with them."""
    if len(frames) < 2:
        raise WireError(f"a message has at least 2 frames, got {len(frames)}")
    kind, dst, src = peek(frames)

    def ext(code, data):
        if code != _TENSOR:
            raise WireError(f"unknown extension {code}")
        index, dtype, shape = msgpack.unpackb(data)
        if not 2 <= index < len(frames) or dtype not in _DTYPES:
            raise WireError(f"bad tensor reference (frame {index}, dtype {dtype!r})")
        buf = _buffer(frames[index])
        dt = _DTYPES[dtype]
        numel = 1
        for n in shape:
            numel *= n
        if len(buf) != numel * dt.itemsize:
            raise WireError(f"tensor frame {index} has {len(buf)} bytes, {dtype} {shape} needs {numel * dt.itemsize}")
        if numel == 0:
            return torch.empty(shape, dtype=dt)
        with warnings.catch_warnings():  # received frames are read-only; the tensor is too, by convention
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(buf, dtype=dt).reshape(shape)

    try:
        body = msgpack.unpackb(_bytes(frames[1]), ext_hook=ext)
    except WireError:
        raise
    except Exception as exc:
        raise WireError(f"bad {kind} body ({exc})") from None
    if not isinstance(body, dict) or set(body) != set(_FIELDS[kind]):
        raise WireError(f"{kind} body must have exactly the fields {', '.join(_FIELDS[kind]) or '(none)'}")
    for name, annotation in _TYPES[kind].items():
        if not _conforms(body[name], annotation):
            raise WireError(f"{kind}.{name} must be {annotation}, got {type(body[name]).__name__}")
    return Envelope(KINDS[kind](**body), dst, src)


def _bytes(frame) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def _buffer(frame):
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def params_to_wire(params) -> dict:
    """SamplingParams as a plain dict."""
    return {f.name: (list(v) if isinstance(v := getattr(params, f.name), tuple) else v)
            for f in dataclasses.fields(params)}  # fmt: skip


def params_from_wire(data: dict):
    """SamplingParams back from params_to_wire's dict (raises SpecSotError on bad values)."""
    from specsot_mq.sampling import SamplingParams

    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(data) - names
    if unknown:
        from specsot_mq.errors import SpecSotError

        raise SpecSotError(f"unknown sampling setting {sorted(unknown)[0]!r}: use {', '.join(sorted(names))}")
    values = dict(data)
    if "stop" in values:
        values["stop"] = tuple(values["stop"])
    return SamplingParams(**values)


def ids(tokens: list[int]) -> torch.Tensor:
    """Token ids as the int32 tensor messages carry."""
    return torch.tensor(tokens, dtype=torch.int32)
