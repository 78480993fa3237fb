"""KV shipping: a prompt beginning's computed state, sent from the device stage that holds it to
the one about to decode a prompt that begins with it, where sending is faster than recomputing.

A conversation's next turn may go to another branch stage than the one that decoded its last turn
(the scheduler spreads requests over the devices). That stage's prefix store holds the state of the
earlier turns (prefix_store.py); the receiving stage either recomputes them or asks for it.
`ShipRule` decides by two measured figures: the link's bandwidth (timed by a probe the first time,
then by every transfer over it) and the receiver's own prefill time per token
(generate.PrefillMeter). The state travels as KvPart messages, a group of layers per part under
the links' message cap, and goes into the receiver's prefix store; the prompt then starts from it
as from any stored beginning, so its tokens are those recomputing gives (tests/test_kv_ship.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specsot_mq.errors import SpecSotError
from specsot_mq.messages import KvPart
from specsot_mq.prefix_store import Kept
from specsot_mq.remote_range import from_wire, to_wire

PART_BYTES = 24 << 20  # a part's keys and values at most (the links refuse messages over 64 MiB)
PROBE_BYTES = 4 << 20  # the padding that times a link the first time
MIN_TOKENS = 16  # fewer tokens to gain are recomputed without asking: a round trip costs more


def to_parts(rid: str, state: Kept, tokens: int, part_bytes: int = PART_BYTES) -> list[KvPart]:
    """A stored beginning's state as the messages that carry it: keys and values of a group of
    layers each (state.kv is [layers, kv heads, tokens, head dim] twice), the draft head's state
    in the last."""
    keys, values = state.kv
    layer_bytes = 2 * keys[0].numel() * keys.element_size()
    if layer_bytes > part_bytes:
        raise SpecSotError(f"one layer's KV of {tokens} tokens is {layer_bytes / 2**20:.1f} MiB, over a part's "
                           f"{part_bytes / 2**20:.1f} MiB")  # fmt: skip
    group = max(1, part_bytes // max(layer_bytes, 1))
    firsts = range(0, keys.shape[0], group)
    parts = [KvPart(rid, tokens, i, len(firsts), first, to_wire(keys[first : first + group]),
                    to_wire(values[first : first + group])) for i, first in enumerate(firsts)]  # fmt: skip
    if state.draft_kv is not None:
        parts[-1].draft = [to_wire(state.draft_kv[0]), to_wire(state.draft_kv[1]), to_wire(state.feature)]
    return parts


def nbytes(parts: list[KvPart]) -> int:
    return sum(len(t.data) for p in parts for t in (p.keys, p.values, *p.draft) if t is not None) + sum(
        len(p.pad) for p in parts)  # fmt: skip


@dataclass(slots=True)
class Shape:
    """What a receiver's state must look like: its base cache's layers, kv heads, head dim and
    dtype (and the draft cache's, and the draft feature's size, with a head)."""

    base: tuple[int, int, int, torch.dtype]
    draft: tuple[int, int, int, torch.dtype] | None = None
    feature: int = 0

    @classmethod
    def of(cls, generator) -> Shape:
        def geometry(cache) -> tuple[int, int, int, torch.dtype]:
            layers, _, heads, _, dim = cache.k.shape
            return layers, heads, dim, cache.k.dtype

        draft, head = generator.slots.draft, generator.draft
        if head is None or draft is None:
            return cls(geometry(generator.cache))
        return cls(geometry(generator.cache), geometry(draft), len(head.cfg.feature_layers) * head.hidden_size)

    def nbytes(self, tokens: int) -> int:
        """The bytes of a stored beginning of this many tokens (what shipping it sends)."""
        layers, heads, dim, dtype = self.base
        total = 2 * layers * heads * dim * tokens * dtype.itemsize
        if self.draft is not None:
            layers, heads, dim, dtype = self.draft
            total += 2 * layers * heads * dim * (tokens - 1) * dtype.itemsize + 4 * self.feature
        return total


def from_parts(parts: list[KvPart], shape: Shape) -> Kept:
    """The state the parts carry, checked against the receiver's caches (SpecSotError naming what
    does not match)."""
    parts = sorted(parts, key=lambda p: p.part)
    tokens = parts[0].tokens
    if [p.part for p in parts] != list(range(parts[0].parts)) or any(p.tokens != tokens for p in parts):
        raise SpecSotError("the KV parts do not make one whole")
    keys = torch.cat([from_wire(p.keys) for p in parts])
    values = torch.cat([from_wire(p.values) for p in parts])
    _check("keys", keys, shape.base, tokens)
    _check("values", values, shape.base, tokens)
    last = parts[-1].draft
    if shape.draft is None:
        return Kept((keys, values))
    if len(last) != 3:
        raise SpecSotError("the KV came without the draft head's state, which this stage's decoder needs")
    dk, dv, feature = (from_wire(t) for t in last)
    _check("draft keys", dk, shape.draft, tokens - 1)
    _check("draft values", dv, shape.draft, tokens - 1)
    if feature.numel() != shape.feature:
        raise SpecSotError(f"the draft feature has {feature.numel()} values, this head reads {shape.feature}")
    return Kept((keys, values), (dk, dv), feature)


def _check(what: str, t: torch.Tensor, geometry: tuple, tokens: int) -> None:
    layers, heads, dim, dtype = geometry
    if tuple(t.shape) != (layers, heads, tokens, dim) or t.dtype != dtype:
        raise SpecSotError(f"the shipped {what} are {tuple(t.shape)} {t.dtype}, this cache holds "
                           f"{(layers, heads, tokens, dim)} {dtype}: both stages must run the same model")  # fmt: skip


@dataclass(slots=True)
class ShipRule:
    """Ship or recompute: the state's bytes over the link's measured bandwidth (plus its measured
    round trip) against the tokens to gain times the receiver's measured prefill seconds per token."""

    bandwidth: dict[str, float] = field(default_factory=dict)  # peer -> bytes per second, measured
    latency: dict[str, float] = field(default_factory=dict)  # peer -> seconds of an empty round trip, measured

    def measured(self, peer: str) -> bool:
        return peer in self.bandwidth

    def record(self, peer: str, nbytes: int, seconds: float, empty_seconds: float | None = None) -> None:
        """A transfer of nbytes took `seconds` from ask to last part (empty_seconds: a round trip
        without payload, timed just before: the probe's)."""
        if empty_seconds is not None:
            self.latency[peer] = empty_seconds
        payload = max(seconds - self.latency.get(peer, 0.0), 1e-6)
        rate = nbytes / payload
        old = self.bandwidth.get(peer)
        self.bandwidth[peer] = rate if old is None else 0.5 * old + 0.5 * rate

    def decide(self, peer: str, nbytes: int, gain: int, seconds_per_token: float | None) -> tuple[bool, float, float]:
        """(ship?, estimated seconds to ship, estimated seconds to recompute the `gain` tokens)."""
        ship = self.latency.get(peer, 0.0) + nbytes / self.bandwidth[peer]
        recompute = gain * seconds_per_token if seconds_per_token is not None else float("inf")
        return ship < recompute, ship, recompute
