"""The gateway: where clients connect (a ROUTER socket at `client_address`), and the one stage that
knows every request in flight and every stage's health.

A question goes to the skeleton stage; everything a client should see (skeleton text, the plan,
point text, the answer, a failure) comes back here and goes out to that client. Every stage sends
Ready once and a Heartbeat every `heartbeat_s`; a stage silent for `dead_after_s` is down. A down
branch stage's points go to a surviving branch stage in the p2p topology (the scheduler resends their tasks, the merge
stage drops what they wrote and the client is told, Reassign), and the scheduler stops using it
until it is heard from again. In a ring, a dead node may also have taken with it messages of any
request that passed through it, so every request in flight starts again from its question, under a
new wire id (`rid~N`; the old attempt is aborted everywhere and its late messages dropped): the
redo writes the same text (greedy, or sampled with the seed fixed here at admission), and the
client is sent only what goes beyond what it already has (_Shown). A request fails, with a message
naming the dead stage, when that stage held it and no stage of its kind survives (the skeleton,
parse and schedule stages hold it until its plan is out, merge to the end), or after MAX_REROUTES
redos. Liveness travels straight to the gateway in both topologies, so the stage named is the one
that died. A new or restarted request that needs a stage which is down (restarting) or not up yet
waits for it, up to `restart_wait_s`.

A question whose prompt cannot fit a device stage's cache (`max_len` tokens per sequence) fails at
once, before any stage sees it. A request that runs longer than REPORT_S gets a log line saying
which stages hold it and what was last heard of it, and again each time its age doubles.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from msgspec.structs import asdict, replace

from specsot_mq.messages import (
    Abort, Again, Answer, AnswerText, Ask, Down, Reassign, Reroute, Cancel, Failed, FailCode, Heartbeat, Membership, MergePlan, PointEnd, PointText, Ready,
    SkeletonText, Status, StatusQuery, WireError, decode, encode,
)  # fmt: skip
from specsot_mq.client import secure
from specsot_mq.errors import PromptTooLong, SpecSotError
from specsot_mq.sot.flow import Flow, SoTConfig
from specsot_mq.stages.base import Stage

log = logging.getLogger("specsot.gateway")
LINEAR = ("skeleton", "parse", "schedule", "merge")  # kinds every request passes through
MAX_REROUTES = 3  # a request whose work must be redone more often than this (stages died) fails
REPORT_S = 5.0  # a request running this long is logged with where it is (then at each doubling of its age)


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
        return row | (asdict(self.beat) if self.beat else {})


@dataclass(slots=True)
class _Shown:
    """What a client has been sent of each of a request's streams (its skeleton, each point, the
    answer), and how much of each the current attempt has written: after a restart the redo
    writes the same again, and only what goes beyond reaches the client."""

    texts: dict[str, str] = field(default_factory=dict)  # stream -> text sent
    tokens: dict[str, int] = field(default_factory=dict)  # stream -> token ids sent
    written: dict[str, tuple[int, int]] = field(default_factory=dict)  # stream -> (chars, tokens) of this attempt
    ended: set[int] = field(default_factory=set)  # points whose PointEnd was sent

    def forget(self, index: int) -> None:
        """A point starts again from nothing, and the client knows (Reassign)."""
        for record in (self.texts, self.tokens, self.written):
            record.pop(f"point {index}", None)
        self.ended.discard(index)

    def fresh(self, stream: str, text: str, tokens: int) -> tuple[str, int] | None:
        """A new piece of `stream` from the current attempt: (its text the client has not seen,
        how many of its leading token ids the client has), or None if it differs from what the
        client was sent (a redo that did not write the same)."""
        chars, toks = self.written.get(stream, (0, 0))
        sent = self.texts.get(stream, "")
        overlap = sent[chars : chars + len(text)]
        if not text.startswith(overlap):
            return None
        self.written[stream] = (chars + len(text), toks + tokens)
        new = text[len(overlap) :]
        self.texts[stream] = sent + new
        seen = min(tokens, max(0, self.tokens.get(stream, 0) - toks))
        self.tokens[stream] = self.tokens.get(stream, 0) + tokens - seen
        return new, seen


@dataclass(slots=True)
class _Request:
    client: bytes  # the client's ROUTER identity
    ask: Ask  # as the client sent it (a sampled one with its seed fixed)
    started: float
    deadline: float | None = None  # waiting for a down stage until then (None: admitted)
    holders: set = field(default_factory=set)  # stages that hold part of it
    reroutes: int = 0  # times its work was redone after a stage died
    attempt: int = 0  # times it started again from its question (a ring node died)
    planned: bool = False  # the client has its plan
    shown: _Shown = field(default_factory=_Shown)
    heard: str = "nothing yet"  # the last message about it from a stage, and which stage sent it
    report_after: float = REPORT_S  # its age at the next log line about where it is

    @property
    def wire(self) -> str:
        """The id the stages know the current attempt by."""
        return self.ask.rid if not self.attempt else f"{self.ask.rid}~{self.attempt}"


class Gateway(Stage):
    async def start(self) -> None:
        from specsot_mq.pull import resolve_model
        from specsot_mq.tokenizer import load_tokenizer

        # The prompts' sizes, to refuse a question that cannot fit a cache before any stage sees it.
        self.flow = Flow(SoTConfig(**self.spec.sot), load_tokenizer(resolve_model(self.spec.model)))
        self.clients = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.clients.setsockopt(zmq.LINGER, 0)
        self.clients.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        secure(self.clients, self.spec.client_address, self.keys, server=True)
        self.clients.bind(self.spec.client_address)
        self.requests: dict[str, _Request] = {}  # client's request id -> it, admitted or waiting
        self.wired: dict[str, str] = {}  # an admitted attempt's wire id -> the client's request id
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
            return
        rid = self.wired.get(getattr(msg, "rid", None))
        if rid is None:
            return  # a request that ended, or an attempt that was restarted: its late messages
        request = self.requests[rid]
        request.heard = f"{type(msg).__name__} from {env.src}"
        if isinstance(msg, (SkeletonText, PointText, AnswerText)):
            await self._stream(rid, request, msg)
        elif isinstance(msg, MergePlan):  # planned: the skeleton, parse and schedule stages are done with it
            request.holders.difference_update(n for n in self.linear if self.spec.kinds[n] != "merge")
            request.holders.update(msg.branches)
            if not request.planned:  # a redo plans the same points
                request.planned = True
                await self._send_client(request.client, replace(msg, rid=rid))
        elif isinstance(msg, PointEnd):
            if msg.index not in request.shown.ended:  # a redo ends it again
                request.shown.ended.add(msg.index)
                await self._send_client(request.client, replace(msg, rid=rid))
        elif isinstance(msg, Again):  # points to write again: the scheduler holds them, then a branch stage
            schedule = self.spec.named("schedule")[0]
            if not msg.stage:
                request.holders.add(schedule)
            else:
                request.holders.discard(schedule)
                request.holders.add(msg.stage)
                await self._send_client(request.client, replace(msg, rid=rid))
        elif isinstance(msg, Reassign):
            request.holders.add(msg.stage)
            for index in msg.indices:
                request.shown.forget(index)
            await self._send_client(request.client, replace(msg, rid=rid))
        elif isinstance(msg, Answer):
            self._forget(rid)
            msg.stats["seconds"] = time.monotonic() - request.started
            if request.attempt:
                msg.stats["restarts"] = request.attempt
            await self._send_client(request.client, replace(msg, rid=rid))
        elif isinstance(msg, Failed):
            await self._fail(rid, msg.error, msg.code)

    async def _stream(self, rid: str, request: _Request, msg) -> None:
        """Text for the client, less what it already has from an earlier attempt."""
        stream = "skeleton" if isinstance(msg, SkeletonText) else "answer" if isinstance(msg, AnswerText) else f"point {msg.index}"
        tokens = getattr(msg, "token_ids", None)
        fresh = request.shown.fresh(stream, msg.text, 0 if tokens is None else len(tokens))
        if fresh is None:
            await self._fail(rid, f"this request started again after a stage died, and its redo wrote another {stream} "
                                  "than the one streamed (a sampled request without a reproducible seed): retry it",
                             "unavailable")  # fmt: skip
            return
        text, seen = fresh
        if text or (tokens is not None and seen < len(tokens)):
            update = {"rid": rid, "text": text} | ({"token_ids": tokens[seen:]} if tokens is not None else {})
            await self._send_client(request.client, replace(msg, **update))

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
        if not was_up:
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
            await self._unpark()
            self._report(now)

    def _report(self, now: float) -> None:
        """A log line for each request that has run long enough: where it is now."""
        for rid, request in self.requests.items():
            age = now - request.started
            if age < request.report_after:
                continue
            request.report_after *= 2
            if request.deadline is not None:
                where = f"waits for the stages {', '.join(self._down()) or 'it needs'} to be up"
            else:
                where = f"held by {', '.join(sorted(request.holders)) or 'no stage'}; last heard: {request.heard}"
            log.info("%s: running %.0f s, %s", rid, age, where)

    async def _stage_down(self, name: str, silent: float) -> None:
        """A stage went silent: the work it held is redone elsewhere (p2p: a dead branch stage's
        points move to a survivor; ring: every request in flight starts again), or its requests
        fail when no stage of its kind survives or a request was redone MAX_REROUTES times."""
        error = (f"stage {name} stopped answering (no heartbeat for {silent:.1f} s), so this request was "
                 "dropped; the launcher restarts the stage, retry in a moment")  # fmt: skip
        kind = self.spec.kinds[name]
        if kind == "branch":
            await self._membership()  # before any reroute: the scheduler must not pick the dead stage
        survivors = any(self.health[n].up for n in self.spec.named(kind))
        ring = self.spec.topology == "ring"
        for rid, request in list(self.requests.items()):
            held = name in request.holders and request.deadline is None
            if not held and not (ring and request.deadline is None):
                continue
            if (held and not survivors) or request.reroutes >= MAX_REROUTES:
                await self._fail(rid, error, "unavailable")
                continue
            request.reroutes += 1
            if ring:
                await self._restart(rid, request, name)
            else:
                request.holders.discard(name)
                log.warning("%s: rerouting the points %s held", rid, name)
                await self.send(self.spec.named("schedule")[0], Reroute(request.wire, name))

    async def _restart(self, rid: str, request: _Request, dead: str) -> None:
        """Start a request again from its question under a new wire id, once the stages it needs
        are up (its old attempt is forgotten everywhere)."""
        log.warning("%s: starting it again (%s died, and its messages may have passed through it)", rid, dead)
        await self._abort(request.wire, f"restarted: {dead} died")
        del self.wired[request.wire]
        request.attempt += 1
        request.shown.written.clear()
        request.deadline = time.monotonic() + self.spec.restart_wait_s
        await self._unpark()

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
            if msg.rid in self.requests:
                await self._send_client(client, Failed(msg.rid, f"request id {msg.rid} is already in flight", "invalid"))
            elif bad := self._bad_ask(msg):
                await self._send_client(client, bad)
            else:
                if msg.params.temperature > 0 and msg.params.seed is None:
                    msg.params.seed = secrets.randbits(31)  # a redo after a fault then writes the same
                now = time.monotonic()  # a request that needs a stage which is (re)starting waits, for a while
                self.requests[msg.rid] = _Request(client, msg, now, now + self.spec.restart_wait_s)
                await self._unpark()
        elif isinstance(msg, Cancel):
            await self._fail(msg.rid, "cancelled by the client", "cancelled")

    def _down(self) -> list[str]:
        """The stages a new request needs that are not up (any branch stage will do)."""
        down = [n for n in self.linear if not self.health[n].up]
        if not any(self.health[n].up for n in self.branches):
            down += self.branches
        return down

    async def _unpark(self) -> None:
        """Admit the waiting requests once every stage they need is up; fail those that waited
        restart_wait_s in vain, naming the stage."""
        now, down = time.monotonic(), self._down()
        for rid, request in list(self.requests.items()):
            if request.deadline is None:
                continue
            if not down:
                request.deadline, request.holders = None, set(self.linear)
                self.wired[request.wire] = rid
                await self.send(self.spec.named("skeleton")[0], replace(request.ask, rid=request.wire))
            elif now > request.deadline:
                state = "is not up yet" if not all(self.health[n].ever_up for n in down) else "is down"
                await self._fail(rid, f"stage {down[0]} {state} (waited {self.spec.restart_wait_s:.0f} s): retry in a moment",
                                 "unavailable")  # fmt: skip

    def _forget(self, rid: str) -> _Request | None:
        request = self.requests.pop(rid, None)
        if request is not None:
            self.wired.pop(request.wire, None)
        return request

    async def _fail(self, rid: str, error: str, code: FailCode) -> None:
        request = self._forget(rid)
        if request is None:
            return
        if request.deadline is None:
            await self._abort(request.wire, error)
        await self._send_client(request.client, Failed(rid, error, code))

    async def _abort(self, wire: str, error: str) -> None:
        for name in self.spec.kinds:  # straight to each: in a ring, past a dead node too
            if name != self.name:
                await self.direct(name, Abort(wire, error))

    async def _send_client(self, client: bytes, msg) -> None:
        await self.clients.send_multipart([client, *encode(msg, "client", self.name)], copy=False)


    def _bad_ask(self, msg: Ask) -> Failed | None:
        """What is wrong with a question as a client sent it (the stages after take it as checked)."""
        from specsot_mq.prompts import check_history

        if not msg.question.strip():
            return Failed(msg.rid, "the question must be a non-empty string", "invalid")
        if "~" in msg.rid:
            return Failed(msg.rid, f"request id {msg.rid!r} has a '~', which marks a restarted request's attempts: "
                                   "choose another id", "invalid")  # fmt: skip
        try:
            check_history(msg.history)
            fix = "start the stages with a longer cache (specsot launch or serve --max-len)"
            self.flow.check_fits(msg, self.spec.max_len, fix)
        except PromptTooLong as exc:
            return Failed(msg.rid, str(exc), "too_long")
        except SpecSotError as exc:
            return Failed(msg.rid, str(exc), "invalid")
        return None
