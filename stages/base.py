"""What every stage is: a small async class the runner feeds with messages, found by name.

A stage gets `handle(env)` for each message addressed to it and `abort(rid)` when a request is
dropped everywhere; it sends with `self.send(dst, msg)`. Model work never runs on the event loop
(see worker.py), so a stage keeps answering heartbeats and aborts while it decodes.

Stages are found by name in STAGES; `--stage parse=my_pkg.mod:MyParser` swaps one for any class
with the same interface, leaving the others as they are.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from specsot_mq.errors import SpecSotError
from specsot_mq.messages import Envelope

STAGES = {
    "gateway": "specsot_mq.stages.gateway:Gateway",
    "skeleton": "specsot_mq.stages.skeleton:SkeletonStage",
    "parse": "specsot_mq.stages.parse:ParseStage",
    "schedule": "specsot_mq.stages.schedule:ScheduleStage",
    "branch": "specsot_mq.stages.branch:BranchStage",
    "merge": "specsot_mq.stages.merge:MergeStage",
}


@dataclass(slots=True)
class RunSpec:
    """Everything a stage process needs to know about the run; the launcher writes it once and
    every process (local or remote) gets the same one."""

    topology: str  # "p2p" or "ring"
    table: dict[str, str]  # stage name -> inbox address, in ring order
    kinds: dict[str, str]  # stage name -> its kind (a key of STAGES)
    hosts: dict[str, str]  # stage name -> host it runs on
    devices: dict[str, str]  # device stage name -> "ip#gpu"
    profiles: dict[str, dict]  # branch stage name -> its DeviceProfile fields
    client_address: str  # where the gateway listens for clients
    overrides: dict[str, str] = field(default_factory=dict)  # kind -> "module:Class"
    model: str | None = None  # name or path (None: the default model)
    dtype: str = "auto"
    quantize: str = "auto"  # the weights: as shipped, int4, int8 or none (loader.load_model)
    draft: str | None = "auto"
    tree: dict = field(default_factory=dict)  # TreeParams fields given on the command line (the rest default)
    sot: dict = field(default_factory=dict)  # SoTConfig fields (max_points, skeleton_tokens, ...)
    skeleton_slots: int = 4  # skeletons decoded together (from different requests)
    max_len: int = 2048
    prefix_cache_mb: int = 256  # each device stage's prefix store (a conversation's earlier turns; 0 = off)
    heartbeat_s: float = 0.5
    dead_after_s: float = 5.0  # a stage silent this long is down
    restart_wait_s: float = 60.0  # a new request waits this long for a down stage to be back
    threads: dict[str, int] = field(default_factory=dict)  # CPU device stage -> torch threads (default: its host's cores)
    curve: bool = False  # tcp links authenticated with the run's CURVE keys (given to each stage on its stdin)
    # --split layers: range server name -> {"layers": [first, last], "address", "device"}, in layer
    # order; the device stages then hold no layers and run the model through these (remote_range.py)
    ranges: dict[str, dict] = field(default_factory=dict)
    prefill_chunk: int = 128  # over ranges: tokens per piece of a pipelined prefill (0: one piece)
    kv_ship: str = "auto"  # branch stages ask each other for a prompt beginning's KV: auto (where that beats recomputing), always, never

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls(**json.loads(text))

    def named(self, kind: str) -> list[str]:
        """The stages of one kind, in ring order."""
        return [name for name, k in self.kinds.items() if k == kind]


class Stage:
    """The interface the runner drives. Subclasses override what they need."""

    def __init__(self, name: str, spec: RunSpec, send: Callable[[str, object], Awaitable[None]],
                 direct: Callable[[str, object], Awaitable[None]] | None = None):  # fmt: skip
        """send: through the topology; direct: straight to a stage's inbox (the control plane)."""
        self.name, self.spec, self.send, self.direct = name, spec, send, direct or send
        self.route_around: Callable[[list[str]], None] = lambda stages: None  # the transport's set_down
        self.keys: dict | None = None  # the run's CURVE keys (a run over tcp), for sockets of its own
        self.tokens = 0  # tokens produced so far (device stages), for the tokens/s column

    async def start(self) -> None:
        """Load what the stage needs (a model, a tokenizer); called once before Ready is sent."""

    async def handle(self, env: Envelope) -> None:
        """One message addressed to this stage."""

    async def abort(self, rid: str) -> None:
        """Forget a request (it failed or was cancelled); its work must stop soon."""

    async def stop(self) -> None:
        """Release what start() took; called once on SIGTERM."""

    def inflight(self) -> int:
        """Requests this stage holds now."""
        return 0

    def counters(self) -> dict:
        """Heartbeat fields beyond the common ones (a device stage's cache slots and speculative
        decoding counters; see messages.Heartbeat)."""
        return {}


def stage_class(kind: str, overrides: dict[str, str] | None = None) -> type:
    """The class for a stage kind: an override "module:Class" if given, else the built-in one."""
    target = (overrides or {}).get(kind) or STAGES.get(kind)
    if target is None:
        raise SpecSotError(f"unknown stage '{kind}': the stages are {', '.join(STAGES)}")
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise SpecSotError(f"stage {kind}={target} cannot be loaded ({exc}): give it as module.path:ClassName") from None
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise SpecSotError(f"stage {kind}={target} is not a Stage subclass (specsot_mq.stages.base.Stage)")
    return cls


def parse_overrides(items: list[str]) -> dict[str, str]:
    """`--stage kind=module:Class` flags as {kind: "module:Class"}, each checked to load."""
    overrides = {}
    for item in items:
        kind, eq, target = item.partition("=")
        if not eq or ":" not in target or kind not in STAGES:
            raise SpecSotError(
                f"--stage {item!r} must be KIND=module.path:ClassName with KIND one of {', '.join(STAGES)}"
            )
        overrides[kind] = target
        stage_class(kind, overrides)
    return overrides
