"""The two transports. Every stage binds one PULL inbox at its address; what differs is who a
message is handed to: the destination itself (p2p) or the next stage of the ring (ring)."""

from __future__ import annotations

import logging
import random
import time
from collections import deque

import zmq
import zmq.asyncio

from specsot_mq.client import secure
from specsot_mq.messages import BROADCAST, Envelope, WireError, decode, encode, peek

log = logging.getLogger("specsot.transport")
TOPOLOGIES = ("p2p", "ring")
_HWM = 100_000  # messages queued per link before a send waits (a dead peer holds them until it is back)
MAX_MESSAGE = 64 << 20  # bytes: a peer that sends a larger message is disconnected (it is not read)


class Transport:
    """One stage's link to the others. `table` maps every stage name to its address (tcp://ip:port,
    ipc://path or inproc://name), in ring order."""

    def __init__(self, me: str, table: dict[str, str], ctx: zmq.asyncio.Context | None = None, keys: dict | None = None):
        """keys: the run's CURVE keys, for its tcp links (see client.secure)."""
        if me not in table:
            raise ValueError(f"stage {me!r} is not in the address table")
        self.me, self.table, self.keys = me, dict(table), keys
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.inbox = self._socket(zmq.PULL)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        secure(self.inbox, table[me], keys, server=True)
        self.inbox.bind(table[me])
        self._out: dict[str, zmq.asyncio.Socket] = {}
        self.dropped = 0  # malformed frames received and dropped
        self.down: set[str] = set()  # stages held to be down (the gateway's Down): a ring routes around them
        self.ready: deque = deque()  # frames that arrived and may be taken now (a ring's, in their order)

    def set_down(self, stages) -> None:
        self.down = set(stages) - {self.me}

    def _socket(self, kind):
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _HWM)
        sock.setsockopt(zmq.RCVHWM, _HWM)
        return sock

    def _link(self, name: str) -> zmq.asyncio.Socket:
        if name not in self._out:
            sock = self._socket(zmq.PUSH)
            secure(sock, self.table[name], self.keys, server=False)
            sock.connect(self.table[name])
            self._out[name] = sock
        return self._out[name]

    async def send(self, dst: str, msg) -> None:
        """Send msg to the stage named dst (BROADCAST: every other stage)."""
        if dst != BROADCAST and dst not in self.table:
            raise ValueError(f"no stage named {dst!r} (known: {', '.join(self.table)})")
        await self._route(dst, encode(msg, dst, self.me, self._number(dst)))

    def _number(self, dst: str) -> tuple[int, int] | None:
        """The envelope's `order` for a message to dst (messages.py): none where each sender has
        one way to each stage."""
        return None

    async def send_direct(self, dst: str, msg) -> None:
        """Send straight to dst's inbox whatever the topology: the control plane (Ready,
        Heartbeat, Abort, Membership), so that a stage's liveness is judged by its own messages,
        never through whichever stages would forward them, and a dead ring node cuts no control."""
        await self._link(dst).send_multipart(encode(msg, dst, self.me), copy=False)

    async def _route(self, dst: str, frames: list) -> None:
        raise NotImplementedError

    async def _frames(self) -> list:
        return await self.inbox.recv_multipart(copy=False)

    async def recv(self) -> Envelope:
        """The next message for this stage; malformed frames are logged and dropped."""
        while True:
            try:
                if self.ready:
                    return decode(self.ready.popleft())
                frames = await self._frames()
                if frames is not None:
                    await self._arrived(frames)
            except WireError as exc:
                self.dropped += 1
                log.warning("%s dropped a malformed message: %s", self.me, exc)

    async def _arrived(self, frames: list) -> None:
        """Frames that came in: for this stage (onto `ready`), or to pass on."""
        self.ready.append(frames)

    def close(self) -> None:
        for sock in [self.inbox, *self._out.values()]:
            sock.close(linger=0)


class P2P(Transport):
    """Senders connect straight to the receiver's inbox."""

    async def _route(self, dst: str, frames: list) -> None:
        names = [n for n in self.table if n != self.me] if dst == BROADCAST else [dst]
        for name in names:
            await self._link(name).send_multipart(frames, copy=False)


class Ring(Transport):
    """Each stage sends only to its successor (the next name in the table, wrapping around, past
    the stages that are down); a stage forwards what is not for it without decoding the body. A
    broadcast goes once around. A message for a stage that is down is dropped (else it would
    circle for ever).

    The way round changes while messages travel (a stage is held down, or is back), so two
    messages from one stage to another may take different ways and the later one arrive first. So
    each carries its number among its sender's messages to that stage (messages.py's `order`),
    and the destination holds one that comes early until those before it arrive: a stream's
    pieces (a skeleton's, a point's) join in the order they were written. One before it that is
    not there within `patience` seconds was lost (a dead stage held it): what is held then goes on
    in its order, past the gap."""

    def __init__(self, me: str, table: dict[str, str], ctx: zmq.asyncio.Context | None = None, keys: dict | None = None,
                 patience: float = 1.0):  # fmt: skip
        super().__init__(me, table, ctx, keys)
        self.order = list(table)
        self.forwarded = 0
        self.patience = patience
        self.epoch = random.getrandbits(31)  # this start of the transport (a restarted sender counts afresh)
        self.sent: dict[str, int] = {}  # dst -> messages sent to it
        self.expected: dict[tuple[str, int], int] = {}  # (src, its epoch) -> the number of its next message
        self.early: dict[tuple[str, int], dict[int, list]] = {}  # (src, epoch) -> number -> frames that came early
        self.waiting_since: dict[tuple[str, int], float] = {}  # (src, epoch) -> when its oldest gap opened

    @property
    def successor(self) -> str:
        i = self.order.index(self.me)
        later = self.order[i + 1 :] + self.order[:i]
        return next((name for name in later if name not in self.down), self.me)

    def _number(self, dst: str) -> tuple[int, int] | None:
        if dst == BROADCAST or dst in self.down:  # a broadcast is not numbered; one for a stage that is down is dropped
            return None
        n = self.sent[dst] = self.sent.get(dst, -1) + 1
        return self.epoch, n

    async def _route(self, dst: str, frames: list) -> None:
        if dst in self.down:
            log.warning("%s dropped a message for %s, which is down", self.me, dst)
            return
        await self._link(self.successor).send_multipart(frames, copy=False)

    async def _frames(self) -> list | None:
        """The next frames in, or None once the oldest gap has waited `patience` seconds."""
        if not self.waiting_since:
            return await super()._frames()
        wait = min(self.waiting_since.values()) + self.patience - time.monotonic()
        if wait > 0 and await self.inbox.poll(wait * 1000, zmq.POLLIN):
            return await super()._frames()
        self._skip_gaps()
        return None

    async def _arrived(self, frames: list) -> None:
        _, dst, src, order = peek(frames)
        if dst == self.me:
            self._in_order(src, order, frames)
        elif dst == BROADCAST:
            if self.successor != src:
                await self._route(dst, frames)
            if src != self.me:
                self.ready.append(frames)
        else:
            self.forwarded += 1
            await self._route(dst, frames)

    def _in_order(self, src: str, order: tuple[int, int] | None, frames: list) -> None:
        if order is None:  # sent straight (the control plane)
            self.ready.append(frames)
            return
        key, n = (src, order[0]), order[1]
        # The first message heard from a sender's start is where its count begins here (this stage
        # may have started after it, or come back from a restart).
        expected = self.expected.get(key, n)
        if n > expected:
            self.early.setdefault(key, {})[n] = frames
            self.waiting_since.setdefault(key, time.monotonic())
            return
        self.ready.append(frames)  # the next one (or one given up for lost that came after all)
        if n == expected:
            self._release(key, n + 1)

    def _release(self, key: tuple[str, int], n: int) -> None:
        """Onto `ready`, the messages of `key` held from number n on that follow without a gap."""
        early = self.early.get(key, {})
        while n in early:
            self.ready.append(early.pop(n))
            n += 1
        self.expected[key] = n
        self.waiting_since.pop(key, None)
        if early:
            self.waiting_since[key] = time.monotonic()
        else:
            self.early.pop(key, None)

    def _skip_gaps(self) -> None:
        """The gaps that waited `patience` seconds are given up: what is held after each goes on."""
        now = time.monotonic()
        for key, since in list(self.waiting_since.items()):
            if now - since >= self.patience:
                log.warning("%s: %d messages from %s waited %.1f s for an earlier one that did not come: "
                            "passing them on", self.me, len(self.early[key]), key[0], now - since)  # fmt: skip
                self._release(key, min(self.early[key]))


def make_transport(topology: str, me: str, table: dict[str, str], ctx=None, keys: dict | None = None) -> Transport:
    """The transport of this topology for stage `me` (keys: the run's CURVE keys, for tcp links)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"--topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")
    return (P2P if topology == "p2p" else Ring)(me, table, ctx, keys)
