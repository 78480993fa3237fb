"""A range of a model's layers in another process (issue 44: a model larger than one device).

`RangeServer` holds layers [first, last) of a model (loaded alone: `load_model(..., layers=)`) and
the KV caches its callers asked for (one per cache a caller holds, named by the caller), and
answers requests on a ZeroMQ socket: each forward's hidden state comes in as a frame and what the
range computes goes back (the next hidden state, or the logits where the range ends the model),
and the slot manager's cache operations (copy a prefix, compact an accepted draft path, snapshot
and restore for the prefix store) are carried out on its own cache, so its entries stay those of
the whole model's cache.

`RemoteRange` stands for such a range in split.py's SplitModel: the process runs its own ranges
and sends the hidden state on, so the generation loop and the SoT engine run over the split model
unchanged and greedy output equals the whole model's, token for token. An EAGLE head reads the
embedding and the output layer: where those ranges are remote, the process holds a copy of them
(SplitModel's edges), and the head's features come back from the ranges that hold those layers.
A range may have replicas (several servers of the same layers): see RemoteRange.

    python -m specsot_mq.remote_range --model NAME --layers 15:30 --bind tcp://127.0.0.1:5700

The messages are messages.py's Range* (tensors as raw bytes, read where ZeroMQ received them). A
request that fails answers with its error, which the caller raises naming the server; a server
that goes away while a request is pending (its socket is watched), or that does not answer within
the timeout, is named too, and every reply carries the server process's epoch, so a restart is
seen.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import time
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path

# Before torch loads OpenMP: a server waiting for its next request takes no core (stages/runner.py).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import msgspec  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402
from torch import nn  # noqa: E402

from specsot_mq.core_share import CoreShare  # noqa: E402
from specsot_mq.errors import SpecSotError  # noqa: E402
from specsot_mq.messages import (RANGE_REQUESTS, RangeCacheOp, RangeForward, RangeHello,  # noqa: E402
                                 RangeNewCache, RangeReply, RangeStop, Tensor)  # fmt: skip
from specsot_mq.model import ForwardOutput, LlamaModel, Step  # noqa: E402

log = logging.getLogger("specsot.remote_range")

_REQUESTS = msgspec.msgpack.Decoder(RANGE_REQUESTS)
_REPLY = msgspec.msgpack.Decoder(RangeReply)
_ENCODER = msgspec.msgpack.Encoder()


def to_wire(t: torch.Tensor) -> Tensor:
    """The tensor as a message field: a view of its bytes (encoding the message copies them once)."""
    t = t.detach().contiguous().cpu()
    return Tensor(str(t.dtype).removeprefix("torch."), list(t.shape), memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def from_wire(w: Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor over the field's bytes where they lie in the received message, if it is writable
    (a range's frames are ZeroMQ's own buffers: no copy on a CPU; the tensor keeps the message
    alive), else over a copy (a message decoded from immutable bytes)."""
    dtype = getattr(torch, w.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise SpecSotError(f"a tensor of unknown dtype {w.dtype!r} came over the wire")
    if not len(w.data):
        return torch.empty(w.shape, dtype=dtype, device=device)
    data = w.data if isinstance(w.data, memoryview) and not w.data.readonly else bytearray(w.data)
    return torch.frombuffer(data, dtype=dtype).reshape(w.shape).to(device)


class RangeServer:
    """Layers [first, last) of a model and their cache, answering RemoteRange's requests."""

    def __init__(self, model: LlamaModel, share: CoreShare | None = None):
        """share: this server's place on its host's board of range servers (core_share.py), where
        its torch threads follow how many of them are busy; None: a fixed thread count."""
        self.model, self.share = model, share
        self.threads = torch.get_num_threads()
        self.caches: dict[int, object] = {}  # by name: each RemoteCache of the callers'
        self.epoch = uuid.uuid4().hex[:12]  # every reply carries it: a caller sees a restart

    def answer(self, request) -> RangeReply:
        try:
            reply = self._answer(request)
        except Exception as e:  # every failure goes back to the caller, which raises it
            reply = RangeReply(error=f"{type(e).__name__}: {e}")
        reply.epoch = self.epoch
        return reply

    def _answer(self, request) -> RangeReply:
        model = self.model
        if isinstance(request, (RangeHello, RangeStop)):
            return RangeReply(first_layer=model.first_layer, last_layer=model.last_layer, caches=list(self.caches))
        if isinstance(request, RangeNewCache):
            for name in request.free:
                self.caches.pop(name, None)
            self.caches.pop(request.name, None)
            cache = self.caches[request.name] = model.new_cache(request.slots, request.capacity)
            with torch.inference_mode():  # (as its forwards run)
                return RangeReply(in_place=model.attends_in_place(cache))
        cache = self.caches.get(request.cache)
        if cache is None:
            raise SpecSotError(f"no cache {request.cache} here: ask for one first (RangeNewCache)")
        if isinstance(request, RangeCacheOp):
            if request.op == "copy":
                cache.copy(request.slot, request.slots, request.at)
            elif request.op == "move":
                cache.move(request.slot, request.positions, request.at)
            elif request.op == "snapshot":
                return RangeReply(kv=[to_wire(t) for t in cache.snapshot(request.slot, request.at)])
            elif request.op == "restore":
                k, v = (from_wire(t, cache.k.device) for t in request.kv)
                return RangeReply(held=cache.restore(request.slot, (k, v)))
            else:
                raise SpecSotError(f"unknown cache operation {request.op!r}")
            return RangeReply()
        dev = model.device
        mask = None if request.mask is None else from_wire(request.mask, dev)
        step = Step(request.slots, request.starts, from_wire(request.positions, dev), mask, request.logit_rows,
                    tuple(request.hidden_layers))  # fmt: skip
        with torch.inference_mode():
            out = model(from_wire(request.x, dev), cache, step)
        ends = model.last_layer == model.cfg.num_layers
        return RangeReply(logits=to_wire(out.logits) if ends else None, hidden=[to_wire(h) for h in out.hidden])

    def serve(self, address: str) -> None:
        """Answer requests on a ZeroMQ router socket bound at `address` until a RangeStop: each
        caller's requests in order, one at a time (as a reply socket would, but it can tell
        whether another request waits before it answers)."""
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind(address)
        print(f"serving layers {self.model.first_layer}:{self.model.last_layer} at {address}", file=sys.stderr, flush=True)
        try:
            while True:
                # (the caller's id, the empty delimiter, the request), as ZeroMQ's own buffers: a
                # hidden state or KV in it is read where it lies
                *route, raw = sock.recv_multipart(copy=False)
                try:
                    request = _REQUESTS.decode(raw.buffer)
                except msgspec.MsgspecError as e:
                    sock.send_multipart([*route, _ENCODER.encode(RangeReply(error=f"a malformed request ({e})"))])
                    continue
                if self.share is not None and isinstance(request, RangeForward):
                    # its share of the host's cores: all of them while the other ranges wait for
                    # work (one request's steps go through the ranges in turn), split while several
                    # compute at once (requests in flight: a pipeline)
                    if (n := self.share.take()) != self.threads:
                        torch.set_num_threads(n)
                        self.threads = n
                reply = _ENCODER.encode(self.answer(request))
                # out of work before the reply goes, where no request waits: the next range, which
                # the reply sets to work, then finds this one's cores free
                if self.share is not None and not sock.poll(0):
                    self.share.idle()
                sock.send_multipart([*route, reply], copy=False)
                if isinstance(request, RangeStop):
                    return
        finally:
            sock.close(linger=0)


class _Peer:
    """One server of a range (a range with replicas has several, each holding the same layers):
    a dealer socket to its router socket (an empty frame before each message), so requests may be
    sent ahead of their replies, which come back in order (a pipelined prefill's chunks); and a
    monitor of it, which tells when the server goes away or connects again."""

    def __init__(self, address: str, label: str):
        self.address, self.label = address, label
        self.epoch = ""  # its process's id, from its replies
        self.state = "sync"  # "sync": it holds what this side's caches hold; "down": unused until it rejoins
        self.lost = False  # it went away while nothing was pending: whether it restarted is checked first
        self.connect()

    def connect(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        self.sock.connect(self.address)
        self.pending = 0  # requests sent, replies not yet read
        self.owed = 0  # of those, the first ones whose replies are dropped (another peer answered them)
        self.gone = self.back = False  # it disconnected; it connected (again) since

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)

    def reset(self) -> None:
        """A new socket: a reply still on its way never answers a later request."""
        self.close()
        self.connect()

    def send(self, raw: bytes) -> None:
        self.sock.send_multipart([b"", raw], copy=False)
        self.pending += 1

    def events(self) -> None:
        """Read what the monitor says (gone, back)."""
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.gone, self.back = True, False  # back: connected again since it last went away
            elif event == zmq.EVENT_CONNECTED:
                self.back = True

    def wait(self, timeout_ms: int) -> RangeReply | str:
        """The next reply, or why none came: "went away ..." or "did not answer ..."."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            ready = dict(poller.poll(max(0.0, deadline - time.monotonic()) * 1000))
            if self.sock in ready:
                self.pending -= 1
                # the reply's logits are read where ZeroMQ received them (from_wire)
                return _REPLY.decode(self.sock.recv_multipart(copy=False)[-1].buffer)
            if self.monitor in ready:
                self.events()
                if self.gone:
                    return "went away before it answered (its process died?)"
            elif time.monotonic() >= deadline:
                return (f"did not answer in {timeout_ms / 1000:.0f} s: is its server running "
                        "(python -m specsot_mq.remote_range)?")  # fmt: skip

    def drain(self) -> None:
        """Drop the owed replies that have come."""
        while self.owed and self.sock.poll(0):
            self.sock.recv_multipart()
            self.pending -= 1
            self.owed -= 1


class RemoteRange(nn.Module):
    """A SplitModel part whose layers a RangeServer at `address` holds (see the module docstring),
    or several (a list of addresses: replicas). Every request goes to each replica in sync, the
    first of them answers; when it dies the next one answers in its place, from the same cache
    entries (it ran the same requests), so nothing is lost. A replica that went away rejoins once
    it is back, between two requests: its caches made again and their entries in use copied to it."""

    def __init__(self, address: str | Sequence[str], cfg, dtype: torch.dtype, device: torch.device | str = "cpu",
                 timeout_s: float = 120.0, name: str | Sequence[str] | None = None):  # fmt: skip
        """name: how errors name each server, beside its address (a launch's range stages)."""
        super().__init__()
        addresses = [address] if isinstance(address, str) else list(address)
        self.cfg, self.timeout_ms = cfg, int(timeout_s * 1000)
        self._dtype, self._device = dtype, torch.device(device)
        self._freed: list[int] = []  # the names of caches no longer held here
        self._caches: weakref.WeakSet[RemoteCache] = weakref.WeakSet()  # the live ones
        # this side's caches' names: a random 40-bit prefix of its own (other processes use the same
        # servers), then a count
        self._prefix = int.from_bytes(os.urandom(5), "little")
        self._names = itertools.count(self._prefix << 20)
        names = [name] * len(addresses) if name is None or isinstance(name, str) else list(name)
        self.peers = [_Peer(a, f"{n} at {a}" if n else f"at {a}") for a, n in zip(addresses, names)]
        self.label = self.peers[0].label  # how errors name the range
        try:
            hellos = [self._ask(peer, RangeHello()) for peer in self.peers]
        except SpecSotError:
            for peer in self.peers:
                peer.close()
            raise
        layers = {(h.first_layer, h.last_layer) for h in hellos}
        if len(layers) > 1:
            raise SpecSotError(f"the replicas {', '.join(addresses)} hold different layers: {sorted(layers)}")
        (self.first_layer, self.last_layer), = layers

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def _in_sync(self) -> list[_Peer]:
        return [p for p in self.peers if p.state == "sync"]

    def _ask(self, peer: _Peer, request) -> RangeReply:
        """One request to one peer alone (a hello, a rejoining peer's caches)."""
        peer.send(_ENCODER.encode(request))
        while True:
            got = peer.wait(self.timeout_ms)
            if isinstance(got, str):
                peer.reset()
                raise SpecSotError(f"the layer range {peer.label} {got}")
            if peer.owed:
                peer.owed -= 1
                continue
            if not peer.epoch or isinstance(request, RangeHello):
                peer.epoch = got.epoch
            if got.error:
                raise SpecSotError(f"the layer range {peer.label} failed: {got.error}")
            return got

    def call(self, request) -> RangeReply:
        """One request and its reply; SpecSotError naming the server if it fails or is silent."""
        self.send(request)
        return self.receive()

    def send(self, request) -> None:
        """A request whose reply `receive` gets later (replies come in the order sent), to each
        replica in sync."""
        self.prepare()
        raw = _ENCODER.encode(request)
        for peer in self._in_sync():
            peer.send(raw)

    def prepare(self, cache: "RemoteCache | None" = None) -> None:
        """Before a request (to `cache`, which it reads or writes): a replica that went away while
        idle stops being used (the last one is checked: did it restart?), one that is back
        rejoins once nothing is pending; SpecSotError if a restart lost entries in use."""
        for peer in self._in_sync():
            if not peer.pending:
                peer.events()
                if peer.gone:  # it went away while nothing was pending here
                    if len(self._in_sync()) > 1:
                        self._drop(peer)
                    else:
                        peer.gone, peer.lost = False, True
        only = self._in_sync()
        if len(only) == 1 and only[0].lost:
            peer = only[0]
            peer.events()
            if not peer.back and cache is not None and cache.used:  # its entries died with it: say so now,
                raise SpecSotError(f"the layer range {peer.label} went away (its process died?) while this "
                                   "request's entries were there")  # fmt: skip
            self._recover(peer)  # (a request holding nothing there waits for the restart)
        if len(only) < len(self.peers) and not any(p.pending for p in only):
            self._rejoin()
        if cache is not None and cache.lost:
            cache.lost = False
            raise _restart_lost(self.label)

    def _drop(self, peer: _Peer) -> None:
        log.warning("the layer range %s went away: its replica %s goes on", peer.label,
                    next(p for p in self._in_sync() if p is not peer).label)  # fmt: skip
        peer.state = "down"
        peer.reset()

    def _recover(self, peer: _Peer) -> None:
        """After the last replica went away: once it answers again, whether it is a new process
        (its caches are then made again, empty)."""
        peer.lost = False
        epoch = peer.epoch
        self._ask(peer, RangeHello())
        if peer.epoch != epoch:
            self._restarted(peer)

    def _restarted(self, peer: _Peer) -> None:
        """The server is a new process: this side's caches are made again there, and those whose
        entries were in use fail their next request (the slot manager's claims are on them)."""
        self._remake(peer)
        for cache in self._caches:
            cache.lost, cache.used = bool(cache.used), {}

    def _remake(self, peer: _Peer, stale: Sequence[int] = ()) -> None:
        """This side's live caches made again at `peer`, empty (`stale`: names to drop there first)."""
        for cache in list(self._caches):
            self._ask(peer, RangeNewCache(cache.name, cache.num_slots, cache.capacity, list(stale)))
            stale = ()

    def receive(self) -> RangeReply:
        """The reply to the oldest request not yet received, from the first replica in sync (the
        next one's when it goes away). SpecSotError naming the server if the last one fails the
        request, goes away while it is pending or stays silent for the timeout, or has restarted
        since (which loses the caches it held: they are made again, empty, and the requests that
        held entries in them fail)."""
        while True:
            peer = self._in_sync()[0]
            got = peer.wait(self.timeout_ms)
            if not isinstance(got, str) and peer.owed:  # a reply to a request another replica answered
                peer.owed -= 1
                continue
            restarted = not isinstance(got, str) and got.epoch != peer.epoch
            if isinstance(got, str) or restarted:
                if len(self._in_sync()) > 1:
                    self._drop(peer)
                    continue
                if restarted:
                    peer.epoch = got.epoch
                    self._restarted(peer)
                    raise _restart_lost(peer.label)
                peer.reset()
                peer.lost = True
                raise SpecSotError(f"the layer range {peer.label} {got}")
            for other in self._in_sync()[1:]:
                other.owed += 1
                other.drain()
                other.events()
                if other.gone:  # a replica that died behind the one answering stops being sent to
                    self._drop(other)
            if got.error:
                raise SpecSotError(f"the layer range {peer.label} failed: {got.error}")
            return got

    def ready(self) -> bool:
        """Whether a reply is waiting."""
        return bool(self._in_sync()[0].sock.poll(0))

    def _rejoin(self) -> None:
        """A replica that went away and is back (its monitor saw it connect) rejoins: its caches
        are made again, and the entries in use of each are copied to it from the replica that
        answers (KV shipped, not recomputed), so it holds what the others hold."""
        source = self._in_sync()[0]
        for peer in self.peers:
            if peer.state != "down":
                continue
            peer.events()
            if not peer.back:
                continue
            try:
                live = {cache.name for cache in self._caches}
                # this side's caches it still holds from before (it went away without dying), the
                # others' left alone: other processes use it too
                stale = [n for n in self._ask(peer, RangeHello()).caches if n >> 20 == self._prefix and n not in live]
                self._remake(peer, stale)
                for cache in list(self._caches):
                    for slot, length in cache.used.items():
                        kv = self._ask(source, RangeCacheOp(cache.name, "snapshot", slot, at=length)).kv
                        self._ask(peer, RangeCacheOp(cache.name, "restore", slot, kv=kv))
            except SpecSotError as e:
                log.warning("the layer range %s could not rejoin yet: %s", peer.label, e)
                peer.reset()
                continue
            peer.state, peer.gone, peer.back = "sync", False, False
            log.warning("the layer range %s is back in sync", peer.label)

    def new_cache(self, num_slots: int, capacity: int, dtype=None, graphs=None) -> "RemoteCache":
        """A cache on the server; the server drops it once this process no longer holds it (its
        name goes with the next new cache's request)."""
        freed, self._freed = self._freed, []
        cache = RemoteCache(self, next(self._names), num_slots, capacity)
        cache.in_place = self.call(RangeNewCache(cache.name, num_slots, capacity, freed)).in_place
        weakref.finalize(cache, self._free, cache.name)
        self._caches.add(cache)
        return cache

    def _free(self, name: int) -> None:
        """A cache of this process's went: the servers drop theirs with the next new cache's
        request (appended to the list of the moment, not to the one there was when it was made)."""
        self._freed.append(name)

    def attends_in_place(self, cache: "RemoteCache") -> bool:
        """As the server's model attends over the cache (it said so when it made it): then
        layout.py sends causal rows of different lengths as a token per batch row, unpadded."""
        return cache.in_place

    def forward(self, x: torch.Tensor, cache: "RemoteCache", step: Step) -> ForwardOutput:
        self.submit(x, cache, step)
        return self.result()

    def submit(self, x: torch.Tensor, cache: "RemoteCache", step: Step) -> None:
        """Send a forward; `result` gets its output."""
        self.prepare(cache)
        for slot, start in zip(step.slots, step.starts):
            cache.wrote(slot, start + step.positions.shape[1])
        self.send(RangeForward(cache.name, to_wire(x), list(step.slots), list(step.starts), to_wire(step.positions),
                               None if step.mask is None else to_wire(step.mask), step.logit_rows,
                               list(step.hidden_layers)))  # fmt: skip

    def result(self) -> ForwardOutput:
        """The output of the oldest forward submitted and not yet received."""
        reply = self.receive()
        hidden = [from_wire(h, self._device) for h in reply.hidden]
        logits = (from_wire(reply.logits, self._device) if reply.logits is not None
                  else torch.zeros(0, self.cfg.vocab_size, dtype=self._dtype, device=self._device))  # fmt: skip
        return ForwardOutput(logits, hidden)

    def stop(self) -> None:
        """End the servers (each answers first)."""
        for peer in self._in_sync():
            self._ask(peer, RangeStop())


class RemoteCache:
    """A remote range's cache as SplitCache sees a part's: the slot manager's operations, carried
    out by the server."""

    def __init__(self, part: RemoteRange, name: int, num_slots: int, capacity: int):
        self.part, self.name, self.num_slots, self.capacity = part, name, num_slots, capacity
        # how far each slot's entries may be in use (written since the slot manager last forgot its
        # claims): what a rejoining replica gets copied, what a restart loses
        self.used: dict[int, int] = {}
        self.lost = False  # a server restart lost entries in use: its next use fails
        self.in_place = False  # the server's model attends over it in place (RemoteRange.attends_in_place)

    def wrote(self, slot: int, end: int) -> None:
        self.used[slot] = max(self.used.get(slot, 0), end)

    def forget(self) -> None:
        self.used, self.lost = {}, False

    def _op(self, op: str, slot: int, **fields) -> RangeReply:
        self.part.prepare(self)  # (before its name goes in the request: a restart may make it again)
        return self.part.call(RangeCacheOp(self.name, op, slot, **fields))

    def copy(self, src_slot: int, dst_slots, length: int) -> None:
        self._op("copy", src_slot, slots=list(dst_slots), at=length)
        for slot in dst_slots:
            self.wrote(slot, length)

    def move(self, slot: int, src, dst: int) -> None:
        positions = src.tolist() if torch.is_tensor(src) else list(src)
        self._op("move", slot, positions=positions, at=dst)
        self.wrote(slot, dst + len(positions))

    def snapshot(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._op("snapshot", slot, at=length).kv
        return from_wire(k), from_wire(v)

    def restore(self, slot: int, kv: tuple[torch.Tensor, torch.Tensor]) -> int:
        held = self._op("restore", slot, kv=[to_wire(kv[0]), to_wire(kv[1])]).held
        self.wrote(slot, held)
        return held

    @property
    def num_layers(self) -> int:
        return self.part.last_layer - self.part.first_layer


def _restart_lost(label: str) -> SpecSotError:
    return SpecSotError(f"the layer range {label} restarted, losing the KV cache entries of the requests running "
                        "here: they fail, later ones run")  # fmt: skip


def main(argv=None) -> None:
    from specsot_mq.loader import DTYPES, load_model, resolve_device, resolve_dtype, runs_quantized
    from specsot_mq.pull import resolve_model

    p = argparse.ArgumentParser(description="Serve a range of a model's layers to another process.")
    p.add_argument("--model", default=None)
    p.add_argument("--layers", required=True, help="FIRST:LAST, e.g. 15:30")
    p.add_argument("--bind", required=True, help="a ZeroMQ address, e.g. tcp://127.0.0.1:5700")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    p.add_argument("--device", default="cpu")
    p.add_argument("--quantize", default="auto", help="the weights: as shipped (auto), int4, int8 or none")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's own, or with --board its share of the host's cores)")
    p.add_argument("--board", default=None, help="the host's board of range servers: PATH:INDEX:MEMBERS (a launch's)")
    args = p.parse_args(argv)
    share = None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif args.board is not None:
        path, index, members = args.board.rsplit(":", 2)
        share = CoreShare(Path(path), int(index), int(members), os.cpu_count() or 1)
    try:
        first, last = (int(x) for x in args.layers.split(":"))
    except ValueError:
        p.error(f"--layers {args.layers!r}: give FIRST:LAST, e.g. 15:30")
    try:
        dev = resolve_device(args.device)
        folder = resolve_model(args.model)
        dtype = resolve_dtype(args.dtype, dev, runs_quantized(folder, args.quantize, dev))
        model = load_model(folder, dtype=dtype, device=dev, quantize=args.quantize, layers=(first, last))
        RangeServer(model, share).serve(args.bind)
    except SpecSotError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
