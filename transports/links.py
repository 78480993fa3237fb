"""The two transports. Every stage binds one PULL inbox at its address; what differs is who a
message is handed to: the destination itself (p2p) or the next stage of the ring (ring)."""

from __future__ import annotations

import logging

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
        await self._route(dst, encode(msg, dst, self.me))

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
            frames = await self._frames()
            try:
                env = await self._arrived(frames)
                if env is not None:
                    return env
            except WireError as exc:
                self.dropped += 1
                log.warning("%s dropped a malformed message: %s", self.me, exc)

    async def _arrived(self, frames: list) -> Envelope | None:
        return decode(frames)

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
    circle for ever)."""

    def __init__(self, me: str, table: dict[str, str], ctx: zmq.asyncio.Context | None = None, keys: dict | None = None):
        super().__init__(me, table, ctx, keys)
        self.order = list(table)
        self.forwarded = 0

    @property
    def successor(self) -> str:
        i = self.order.index(self.me)
        later = self.order[i + 1 :] + self.order[:i]
        return next((name for name in later if name not in self.down), self.me)

    async def _route(self, dst: str, frames: list) -> None:
        if dst in self.down:
            log.warning("%s dropped a message for %s, which is down", self.me, dst)
            return
        await self._link(self.successor).send_multipart(frames, copy=False)

    async def _arrived(self, frames: list) -> Envelope | None:
        _, dst, src = peek(frames)
        if dst == self.me:
            return decode(frames)
        if dst == BROADCAST:
            if self.successor != src:
                await self._route(dst, frames)
            return decode(frames) if src != self.me else None
        self.forwarded += 1
        await self._route(dst, frames)
        return None


def make_transport(topology: str, me: str, table: dict[str, str], ctx=None, keys: dict | None = None) -> Transport:
    """The transport of this topology for stage `me` (keys: the run's CURVE keys, for tcp links)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"--topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")
    return (P2P if topology == "p2p" else Ring)(me, table, ctx, keys)
