"""A client of a running topology: connects to the gateway, sends questions, and gets each
request's messages (SkeletonText, MergePlan, PointText and AnswerText, then Answer or Failed) as
they come.

    async with Client(address) as client:
        async for msg in client.ask("How do I start running?"):
            ...

Several requests may be in flight on one client; each has its own queue.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from specsot_mq.errors import SpecSotError
from specsot_mq.messages import Answer, Ask, Cancel, Failed, Status, StatusQuery, WireError, decode, encode
from specsot_mq.sampling_params import SamplingParams


ALIVE_S = 5.0  # a request silent this long checks that the gateway still answers


def secure(sock, address: str, keys: dict | None, server: bool) -> None:
    """ZeroMQ CURVE on a tcp socket of a run whose links are authenticated: keys {"public",
    "secret"} (z85) are the run's own, the one identity every stage and client of the run holds.
    A server socket accepts only peers that hold it (the stage's authenticator checks); ipc and
    inproc sockets, and runs without keys, are left as they are."""
    if not keys or not address.startswith("tcp://"):
        return
    sock.curve_secretkey = keys["secret"].encode()
    sock.curve_publickey = keys["public"].encode()
    if server:
        sock.curve_server = True
    else:
        sock.curve_serverkey = keys["public"].encode()


class Client:
    def __init__(self, address: str, ctx: zmq.asyncio.Context | None = None, keys: dict | None = None):
        """keys: the run's CURVE keys (its run file has them) when the gateway listens on tcp."""
        self.address = address
        self.sock = (ctx or zmq.asyncio.Context.instance()).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure(self.sock, address, keys, server=False)
        self.sock.connect(address)
        self.queues: dict[str, asyncio.Queue] = {}
        self.status_waiters: list[asyncio.Future] = []
        self._reader = None
        self.closed = False
        self.finals: dict[str, int] = {}  # request id -> Answers and Faileds received (more than 1: a duplicate)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.closed = True
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close(linger=0)

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = decode(frames).msg
            except WireError:
                continue
            if isinstance(msg, Status):
                waiters, self.status_waiters = self.status_waiters, []
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(msg)
            else:
                if isinstance(msg, (Answer, Failed)):
                    self.finals[msg.rid] = self.finals.get(msg.rid, 0) + 1
                if getattr(msg, "rid", None) in self.queues:
                    self.queues[msg.rid].put_nowait(msg)

    async def status(self, timeout: float = 2.0) -> Status:
        """Every stage's state, or SpecSotError when the gateway does not answer in time."""
        self._ensure_reader()
        fut = asyncio.get_running_loop().create_future()
        self.status_waiters.append(fut)
        try:
            # A send waits while no connection is up (a gateway gone, or a tcp run's keys missing).
            await asyncio.wait_for(self.sock.send_multipart(encode(StatusQuery(), "gateway", "client")), timeout)
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise SpecSotError(f"no gateway answers at {self.address}: is `specsot launch` running (and, for a run "
                               "over tcp, are its keys given: attach with --run)?") from None

    async def ask(self, question: str, params: SamplingParams | None = None, sot: str = "auto",
                  rid: str | None = None, timeout: float | None = None, history: list[dict] = ()) -> AsyncIterator:  # fmt: skip
        """Send a question; yield its messages up to and including the Answer or Failed. With
        `timeout`, a request silent that long ends with a Failed. A request silent for
        `ALIVE_S` checks that the gateway still answers, and ends with a Failed if it does not.
        `history`: the conversation's earlier turns, [{"role", "content"}] (a system message first)."""
        self._ensure_reader()
        rid = rid or uuid.uuid4().hex[:12]
        queue = self.queues[rid] = asyncio.Queue()
        done = False
        try:
            ask = Ask(rid, question, params or SamplingParams(), sot, list(history))
            try:
                await asyncio.wait_for(self.sock.send_multipart(encode(ask, "gateway", "client")), ALIVE_S)
            except asyncio.TimeoutError:
                done = True  # nothing was sent: nothing to cancel
                yield Failed(rid, f"cannot reach the gateway at {self.address}: is `specsot launch` running (and, for "
                                  "a run over tcp, are its keys given: attach with --run)?", "unavailable")  # fmt: skip
                return
            deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
            while True:
                msg = await self._next(queue, rid, deadline)
                done = isinstance(msg, (Answer, Failed))
                yield msg
                if done:
                    return
        finally:
            self.queues.pop(rid, None)
            if not done and not self.closed:  # the caller stopped reading (Ctrl+C): stop the work everywhere
                asyncio.ensure_future(self.cancel(rid))

    async def _next(self, queue: asyncio.Queue, rid: str, deadline: float | None):
        """The request's next message; a Failed past the deadline or when the gateway is gone."""
        loop = asyncio.get_running_loop()
        while True:
            wait = ALIVE_S if deadline is None else min(ALIVE_S, deadline - loop.time())
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel (Ctrl+C)
                # that lands as the message does, and the chat would then wait on for the next one.
                async with asyncio.timeout(max(0.0, wait)):
                    return await queue.get()
            except TimeoutError:
                pass
            if deadline is not None and loop.time() >= deadline:
                return Failed(rid, f"no answer from the gateway at {self.address} in time: is `specsot launch` still running?",
                              "timeout")  # fmt: skip
            try:
                await self.status(timeout=ALIVE_S)
            except SpecSotError:
                return Failed(rid, f"the gateway at {self.address} stopped answering: is `specsot launch` still running?",
                              "unavailable")  # fmt: skip

    async def cancel(self, rid: str) -> None:
        """Stop a request everywhere (nothing when this client is closed already)."""
        if self.closed:
            return
        try:
            await self.sock.send_multipart(encode(Cancel(rid), "gateway", "client"))
        except zmq.ZMQError:  # closed meanwhile
            pass

    async def answer(self, question: str, params: SamplingParams | None = None, sot: str = "auto",
                     timeout: float | None = None, history: list[dict] = ()) -> Answer | Failed:  # fmt: skip
        """Only the last message of a request: its Answer or Failed."""
        async for msg in self.ask(question, params, sot, timeout=timeout, history=history):
            last = msg
        return last
