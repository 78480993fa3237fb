"""The KV cache: one buffer allocated once per process and updated in place.

Layout is [layers, slots, kv_heads, capacity, head_dim] so that one slot's keys for one head are
contiguous for the attention matmul. A slot is one sequence (a question, or one branch of it).
Lengths are plain Python ints: reading them never synchronises with the device.

Everything a decode loop needs happens in place: append at the slot's length, move an accepted draft
path to its final positions (one gather + one copy for all layers), truncate by length (nothing is
freed; later writes overwrite), copy a prefix into other slots (branches sharing a question).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

from specsot_mq.errors import SpecSotError


class KVCacheOverflow(SpecSotError):
    """A write would go past the cache capacity."""


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, num_slots, num_kv_heads, capacity, head_dim)
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        self.capacity = capacity
        self.lengths = [0] * num_slots
        # slot -> (prefix id, n): its first n entries are those of every slot with the same id
        # (copy_prefix made them so, and none has been cut below n since); None: its own
        self.shared: list[tuple[int, int] | None] = [None] * num_slots
        self._next_prefix = 0
        self._where: tuple = ((), None, None)  # (slots, starts, T) of the last scattered write, its indices
        self._gather: tuple = ((), None)  # the slots of the last scattered read, their index tensor

    @classmethod
    def for_model(cls, config, num_slots: int, capacity: int, dtype, device) -> "KVCache":
        return cls(config.num_layers, num_slots, config.num_kv_heads, capacity, config.head_dim, dtype, device)

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    # -- bookkeeping -------------------------------------------------------------------------

    def reserve(self, slots: Sequence[int], n: int) -> list[int]:
        """Claim `n` positions at the end of each slot; return where each slot's new entries start.
        A slot named several times gets its claims one after another, in order (rows of one
        sequence, a token each: layout.py's ragged forwards)."""
        ends = {s: self.lengths[s] for s in slots}
        starts = []
        for s in slots:
            starts.append(ends[s])
            ends[s] += n
        for s, end in ends.items():
            if end > self.capacity:
                raise KVCacheOverflow(
                    f"KV cache slot {s} holds {self.lengths[s]} of {self.capacity} positions and {end - self.lengths[s]} "
                    "more do not fit: shorten the prompt or max tokens, or raise the cache length (--max-len)"
                )
        for s, end in ends.items():
            self.lengths[s] = end
        return starts

    def truncate(self, slot: int, length: int) -> None:
        """Forget everything from `length` on (nothing is freed; later writes overwrite it)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length
        self._forget_below(slot, length)

    def reset(self, slot: int | None = None) -> None:
        for s in range(self.num_slots) if slot is None else [slot]:
            self.lengths[s] = 0
            self.shared[s] = None

    def _forget_below(self, slot: int, position: int) -> None:
        """Entries from `position` on may change: the slot no longer shares a prefix longer than that."""
        if self.shared[slot] is not None and position < self.shared[slot][1]:
            self.shared[slot] = None

    def prefix_sources(self, slots: Sequence[int]) -> tuple[list[int], list[int]] | None:
        """For a forward over `slots`: where each row may read its shared prefix from (the first row's
        slot among those sharing it) and its length, 0 where a row reads only its own slot; None where
        no row shares one. Those slots all run in this forward, so none of their prefixes is being
        overwritten."""
        first: dict[tuple[int, int], int] = {}
        sources, lengths, any_shared = [], [], False
        for s in slots:
            key = self.shared[s]
            src = s if key is None else first.setdefault(key, s)
            sources.append(src)
            lengths.append(0 if src == s else key[1])
            any_shared |= src != s
        return (sources, lengths) if any_shared else None

    # -- data --------------------------------------------------------------------------------

    def write(self, layer: int, slots: Sequence[int], starts: Sequence[int], k: torch.Tensor, v: torch.Tensor):
        """Store new entries k, v [B, kv_heads, T, head_dim] of batch row b at slots[b], from starts[b]
        (converted to the cache's dtype)."""
        t = k.shape[2]
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if len(set(starts)) == 1 and _is_range(slots):
            s0, st = slots[0], starts[0]
            self.k[layer, s0 : s0 + len(slots), :, st : st + t] = k
            self.v[layer, s0 : s0 + len(slots), :, st : st + t] = v
            return
        # Built once per forward: every layer writes to the same places.
        key = (tuple(slots), tuple(starts), t)
        if self._where[0] != key:
            slot_idx = torch.tensor(slots, device=k.device)[:, None]
            pos_idx = torch.tensor(starts, device=k.device)[:, None] + torch.arange(t, device=k.device)
            self._where = (key, slot_idx, pos_idx)
        _, slot_idx, pos_idx = self._where
        # Index a [slots, capacity, heads, dim] view so each (slot, position) pair picks one row.
        self.k[layer].transpose(1, 2)[slot_idx, pos_idx] = k.transpose(1, 2)
        self.v[layer].transpose(1, 2)[slot_idx, pos_idx] = v.transpose(1, 2)

    def view(self, layer: int, slots: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, kv_heads, length, head_dim] for the given slots (a view when they are
        consecutive, a gathered copy otherwise)."""
        if _is_range(slots):
            s0 = slots[0]
            return self.k[layer, s0 : s0 + len(slots), :, :length], self.v[layer, s0 : s0 + len(slots), :, :length]
        # index_select over the slot dimension: several times faster than advanced indexing here.
        # The index is built once per forward: every layer reads the same slots.
        if self._gather[0] != tuple(slots):
            self._gather = (tuple(slots), torch.tensor(slots, device=self.k.device))
        idx = self._gather[1]
        return self.k[layer, :, :, :length].index_select(0, idx), self.v[layer, :, :, :length].index_select(0, idx)

    def move(self, slot: int, src: Sequence[int] | torch.Tensor, dst: int) -> None:
        """Copy the entries at cache positions `src` to positions dst, dst+1, ... (all layers), then
        set the slot's length to dst + len(src). This compacts an accepted draft-tree path."""
        src = torch.as_tensor(src, dtype=torch.long, device=self.k.device)
        n = src.numel()
        if dst + n > self.capacity:
            raise KVCacheOverflow(f"moving {n} entries to position {dst} overflows capacity {self.capacity}")
        self._forget_below(slot, dst)
        if n:
            # index_select gathers into a new tensor first, so overlapping src/dst ranges are safe.
            self.k[:, slot, :, dst : dst + n].copy_(self.k[:, slot].index_select(2, src))
            self.v[:, slot, :, dst : dst + n].copy_(self.v[:, slot].index_select(2, src))
        self.lengths[slot] = dst + n

    def snapshot(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the slot's first `length` entries (all layers), for restore()."""
        if length > self.lengths[slot]:
            raise ValueError(f"slot {slot} holds {self.lengths[slot]} entries, not {length}")
        return self.k[:, slot, :, :length].clone(), self.v[:, slot, :, :length].clone()

    def restore(self, slot: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Make a snapshot() the slot's whole content."""
        n = kv[0].shape[2]
        self.k[:, slot, :, :n].copy_(kv[0])
        self.v[:, slot, :, :n].copy_(kv[1])
        self.lengths[slot] = n
        self.shared[slot] = None

    def copy_prefix(self, src_slot: int, dst_slots: Sequence[int], length: int | None = None) -> None:
        """Give every slot in dst_slots the first `length` entries of src_slot (a shared prompt)."""
        length = self.lengths[src_slot] if length is None else length
        if length > self.lengths[src_slot]:
            raise ValueError(f"slot {src_slot} holds {self.lengths[src_slot]} entries, not {length}")
        if length and (self.shared[src_slot] is None or self.shared[src_slot][1] != length):
            self.shared[src_slot] = (self._next_prefix, length)  # the source's first `length`, named
            self._next_prefix += 1
        for d in dst_slots:
            if d == src_slot:
                continue
            self.k[:, d, :, :length].copy_(self.k[:, src_slot, :, :length])
            self.v[:, d, :, :length].copy_(self.v[:, src_slot, :, :length])
            self.lengths[d] = length
            self.shared[d] = self.shared[src_slot] if length else None


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed tensor; on a CPU, over an anonymous memory map, whose pages the OS hands out (zeroed)
    when first written: a cache of thousands of positions per slot takes the memory of the positions
    used, not of its capacity."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    memory = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)


def _is_range(slots: Sequence[int]) -> bool:
    return all(b - a == 1 for a, b in zip(slots, slots[1:]))
