"""The gateway: where clients connect (a ROUTER socket at `client_address`), and the one stage that
knows every request in flight and every stage's health.

A question goes to the skeleton stage; everything a client should see (skeleton text, the plan,
point text, the answer, a failure) comes back here and goes out to that client. Every stage sends
Ready once and a Heartbeat every `heartbeat_s`; a stage silent for `dead_after_s` is down. A down
branch stage's points go to a surviving branch stage in the p2p topology (the scheduler resends their tasks, the merge
stage drops what they wrote and the client is told, Reassign), and the scheduler stops using it
until it is heard from again. Every request a down linear stage holds (the skeleton, parse and
schedule stages until its plan is out, merge to the end), or a branch stage with no survivor,
fails with a message naming it and is aborted everywhere; in a ring, a
down stage of any kind fails every request in flight (it cut their path). Liveness travels
straight to the gateway in both topologies, so the stage named is the one that died. A new request
that needs a stage which is down (restarting) or not up yet waits for it, up to `restart_wait_s`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from specsot_mq.messages import (
    Abort, Answer, AnswerText, Ask, Down, Reassign, Reroute, Cancel, Failed, Heartbeat, Membership, MergePlan, PointText, Ready,
    SkeletonText, Status, StatusQuery, WireError, decode, encode,
)  # fmt: skip
from specsot_mq.client import secure
from specsot_mq.stages.base import Stage

log = logging.getLogger("specsot.gateway")
LINEAR = ("skeleton", "parse", "schedule", "merge")  # kinds every request passes through
MAX_REROUTES = 3  # a request whose branch stages die more often than this fails


@dataclass(slots=True)
class _Health:
    """What the gateway last heard from one stage."""

    kind: str
    host: str
    device: str
    up: bool  # heard from within dead_after_s
    ever_up: bool  # has been up since the launch (a stage that never was is starting, not down)
    seen: float  # time.monotonic() when it was last heard from
    pid: int | None = None  # from its Ready
    beat: Heartbeat | None = None  # its latest

    def row(self, name: str, now: float) -> dict:
        """As a Status sends it: the latest Heartbeat's fields once one came, kind, host, device,
        up, ever_up, and `age` (seconds since it was last heard from)."""
        row = {"stage": name, "kind": self.kind, "host": self.host, "device": self.device, "up": self.up,
               "ever_up": self.ever_up, "age": now - self.seen}  # fmt: skip
        if self.pid is not None:
            row["pid"] = self.pid
        return row | (dataclasses.asdict(self.beat) if self.beat else {})


@dataclass(slots=True)
class _Request:
    client: bytes  # the client's ROUTER identity
    started: float
    holders: set = field(default_factory=set)  # stages that hold part of it
    reroutes: int = 0  # times a dead branch stage's points were sent elsewhere


class Gateway(Stage):
    async def start(self) -> None:
        self.clients = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.clients.setsockopt(zmq.LINGER, 0)
        self.clients.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        secure(self.clients, self.spec.client_address, self.keys, server=True)
        self.clients.bind(self.spec.client_address)
        self.requests: dict[str, _Request] = {}
        self.parked: list[tuple[bytes, Ask, float]] = []  # (client, question, deadline) waiting for a stage to come up
        now = time.monotonic()
        self.health = {name: _Health(kind, self.spec.hosts.get(name, ""), self.spec.devices.get(name, ""),
                                     name == self.name, name == self.name, now)
                       for name, kind in self.spec.kinds.items()}  # fmt: skip
        self.linear = [n for n, kind in self.spec.kinds.items() if kind in LINEAR]
        self.branches = self.spec.named("branch")
        self._tasks = [asyncio.create_task(self._serve_clients()), asyncio.create_task(self._watch())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.clients.close(linger=0)

    def inflight(self) -> int:
        return len(self.requests)

    # -- from stages ---------------------------------------------------------------------------

    async def handle(self, env) -> None:
        msg = env.msg
        if isinstance(msg, (Ready, Heartbeat)):
            await self.handle_local(msg)
        elif isinstance(msg, (SkeletonText, PointText, AnswerText)):
            await self._to_client(msg.rid, msg)
        elif isinstance(msg, MergePlan):
            if msg.rid in self.requests:  # planned: the skeleton, parse and schedule stages are done with it
                holders = self.requests[msg.rid].holders
                holders.difference_update(n for n in self.linear if self.spec.kinds[n] != "merge")
                holders.update(msg.branches)
            await self._to_client(msg.rid, msg)
        elif isinstance(msg, Reassign):
            if msg.rid in self.requests:
                self.requests[msg.rid].holders.add(msg.stage)
            await self._to_client(msg.rid, msg)
        elif isinstance(msg, Answer):
            request = self.requests.pop(msg.rid, None)
            if request is not None:
                msg.stats["seconds"] = time.monotonic() - request.started
                await self._send_client(request.client, msg)
        elif isinstance(msg, Failed):
            await self._fail(msg.rid, msg.error)

    async def handle_local(self, msg: Ready | Heartbeat) -> None:
        """A stage's sign of life (the gateway's own heartbeat comes here too)."""
        entry = self.health.get(msg.stage)
        if entry is None:
            return
        was_up = entry.up
        entry.up = entry.ever_up = True
        entry.seen = time.monotonic()
        if isinstance(msg, Heartbeat):
            entry.beat = msg
        else:
            entry.pid, entry.host, entry.device = msg.pid, msg.host, msg.device
            log.info("%s is ready (pid %d on %s)", msg.stage, msg.pid, msg.host)
        if not was_up:
            await self._down_changed()
        elif isinstance(msg, Ready):  # a stage that restarted before it was seen down: it learns the set
            await self.direct(msg.stage, Down(self._down_names()))
        if not was_up and entry.kind == "branch":
            await self._membership()
        if not was_up and self.parked:
            await self._unpark()

    # -- health --------------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.spec.heartbeat_s)
            now = time.monotonic()
            for name, entry in self.health.items():
                silent = now - entry.seen
                if name != self.name and entry.up and silent > self.spec.dead_after_s:
                    entry.up = False
                    log.error("%s is down (no heartbeat for %.1f s)", name, silent)
                    await self._down_changed()
                    await self._stage_down(name, silent)
            if self.parked:
                await self._unpark()

    async def _stage_down(self, name: str, silent: float) -> None:
        """A stage went silent: the requests it held fail, but in p2p a dead branch stage's points
        go to a surviving branch stage (at most MAX_REROUTES times per request)."""
        error = (f"stage {name} stopped answering (no heartbeat for {silent:.1f} s), so this request was "
                 "dropped; the launcher restarts the stage, retry in a moment")  # fmt: skip
        if name in self.branches:
            await self._membership()  # before any reroute: the scheduler must not pick the dead stage
        survivors = any(self.health[n].up for n in self.branches)
        for rid, request in list(self.requests.items()):
            # A dead ring node also lost the messages in flight that passed through it, whoever
            # sent them: rerouting would leave requests waiting for points that never arrive.
            if self.spec.topology == "ring":
                await self._fail(rid, error)
            elif name not in request.holders:
                continue
            elif name in self.branches and survivors and request.reroutes < MAX_REROUTES:
                request.reroutes += 1
                request.holders.discard(name)
                log.warning("%s: rerouting the points %s held", rid, name)
                await self.send(self.spec.named("schedule")[0], Reroute(rid, name))
            else:
                await self._fail(rid, error)

    def _down_names(self) -> list[str]:
        return [n for n, e in self.health.items() if e.ever_up and not e.up]

    async def _down_changed(self) -> None:
        """Every stage (the gateway's own transport too) learns which stages are down, straight."""
        down = self._down_names()
        self.route_around(down)
        for name in self.spec.kinds:
            if name != self.name and name not in down:
                await self.direct(name, Down(down))

    async def _membership(self) -> None:
        alive = [n for n in self.branches if self.health[n].up]
        for name in self.spec.named("schedule"):
            await self.direct(name, Membership(alive))

    # -- clients -------------------------------------------------------------------------------

    async def _serve_clients(self) -> None:
        while True:
            client, *frames = await self.clients.recv_multipart(copy=False)
            client = client.bytes
            try:
                msg = decode(frames).msg
            except WireError as exc:
                log.warning("dropped a malformed client message: %s", exc)
                continue
            try:
                await self._from_client(client, msg)
            except Exception:
                log.exception("failed on a client's %s", type(msg).__name__)

    async def _from_client(self, client: bytes, msg) -> None:
        if isinstance(msg, StatusQuery):
            now = time.monotonic()
            stages = [entry.row(name, now) for name, entry in self.health.items()]
            ready = all(e.up for e in self.health.values())
            await self._send_client(client, Status(ready, stages))
        elif isinstance(msg, Ask):
            if msg.rid in self.requests or any(ask.rid == msg.rid for _, ask, _ in self.parked):
                await self._send_client(client, Failed(msg.rid, f"request id {msg.rid} is already in flight"))
            elif bad := _bad_ask(msg):
                await self._send_client(client, Failed(msg.rid, bad))
            elif self._down():  # a stage it needs is starting or restarting: it waits, for a while
                self.parked.append((client, msg, time.monotonic() + self.spec.restart_wait_s))
            else:
                await self._admit(client, msg)
        elif isinstance(msg, Cancel):
            await self._fail(msg.rid, "cancelled by the client")

    def _down(self) -> list[str]:
        """The stages a new request needs that are not up (any branch stage will do)."""
        down = [n for n in self.linear if not self.health[n].up]
        if not any(self.health[n].up for n in self.branches):
            down += self.branches
        return down

    async def _admit(self, client: bytes, msg: Ask) -> None:
        self.requests[msg.rid] = _Request(client, time.monotonic(), set(self.linear))
        await self.send(self.spec.named("skeleton")[0], msg)

    async def _unpark(self) -> None:
        """Admit the waiting requests once every stage they need is up; fail those that waited
        restart_wait_s in vain, naming the stage."""
        now, down = time.monotonic(), self._down()
        waiting, self.parked = self.parked, []
        for client, ask, deadline in waiting:
            if not down:
                await self._admit(client, ask)
            elif now > deadline:
                state = "is not up yet" if not all(self.health[n].ever_up for n in down) else "is down"
                await self._send_client(client, Failed(ask.rid, f"stage {down[0]} {state} (waited "
                                                                f"{self.spec.restart_wait_s:.0f} s): retry in a moment"))  # fmt: skip
            else:
                self.parked.append((client, ask, deadline))

    async def _fail(self, rid: str, error: str) -> None:
        self.parked = [p for p in self.parked if p[1].rid != rid]
        request = self.requests.pop(rid, None)
        if request is None:
            return
        for name in self.spec.kinds:  # straight to each: in a ring, past a dead node too
            if name != self.name:
                await self.direct(name, Abort(rid, error))
        await self._send_client(request.client, Failed(rid, error))

    async def _to_client(self, rid: str, msg) -> None:
        request = self.requests.get(rid)
        if request is not None:
            await self._send_client(request.client, msg)

    async def _send_client(self, client: bytes, msg) -> None:
        await self.clients.send_multipart([client, *encode(msg, "client", self.name)], copy=False)


def _bad_ask(msg: Ask) -> str | None:
    """What is wrong with a question as a client sent it (the stages after take it as checked)."""
    from specsot_mq.errors import SpecSotError
    from specsot_mq.prompts import check_history

    if not isinstance(msg.question, str) or not msg.question.strip():
        return "the question must be a non-empty string"
    try:
        check_history(msg.history)
    except SpecSotError as exc:
        return str(exc)
    return None
