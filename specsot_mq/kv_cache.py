"""The KV cache: one buffer allocated once per process and updated in place.

Layout is [layers, slots, kv_heads, capacity, head_dim] so that one slot's keys for one head are
contiguous for the attention matmul. A slot is one sequence (a question, or one branch of it).
The cache holds data only: how far each slot is filled, and what it holds, is the slot manager's
(slots.py), which names the positions every operation here reads or writes.

Everything a decode loop needs happens in place: write at given positions, move an accepted draft
path to its final positions (one gather + one copy for all layers), copy a prefix into other slots
(branches sharing a question); nothing is freed (later writes overwrite).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

from specsot_mq.errors import SpecSotError


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
        spare: tuple[int, int] = (0, 0),
    ):
        """spare: (slots, positions) allocated beyond `num_slots` and `capacity`, which no sequence
        owns: a captured step's padding rows write there (cuda_graphs.py)."""
        shape = (num_layers, num_slots + spare[0], num_kv_heads, capacity + spare[1], head_dim)
        try:
            self.kv = _zeros((2, *shape), dtype, device)  # keys and values in one buffer: one gather reads both
        except OSError as exc:  # more than the OS maps (on a CPU only the positions used take memory)
            size = 2 * math.prod(shape) * dtype.itemsize / 2**30
            raise SpecSotError(f"a KV cache for {num_slots} sequences of {capacity} positions takes {size:,.1f} GiB, more than "
                               f"this machine maps ({exc.strerror}): lower --max-len (or the slots)") from None  # fmt: skip
        self.k, self.v = self.kv[0], self.kv[1]
        self.capacity = capacity
        self.spare = spare
        self.graphs: dict | None = None  # the CUDA graphs captured over it, by shape (cuda_graphs.py); None: none
        self.graph_pool = None  # the memory pool they share
        self._where: tuple = ((), None, None)  # (slots, starts, T) of the last scattered write, its indices
        self._gather: tuple = ((), None)  # the slots of the last scattered read, their index tensor

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1] - self.spare[0]

    def write(self, layer: int, slots: Sequence[int], starts: Sequence[int], k: torch.Tensor, v: torch.Tensor):
        """Store new entries k, v [B, kv_heads, T, head_dim] of batch row b at slots[b], from starts[b]
        (converted to the cache's dtype). A captured step (cuda_graphs.py) gives tensors: slots
        [B], and starts as each new entry's position [B, T]."""
        t = k.shape[2]
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if torch.is_tensor(slots):  # a captured step's: slots [B] and each entry's position [B, T] on the device
            slot_idx, pos_idx = slots[:, None], starts
        elif len(set(starts)) == 1 and _is_range(slots):
            s0, st = slots[0], starts[0]
            self.k[layer, s0 : s0 + len(slots), :, st : st + t] = k
            self.v[layer, s0 : s0 + len(slots), :, st : st + t] = v
            return
        else:  # built once per forward: every layer writes to the same places
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
        consecutive, a gathered copy otherwise: always where `slots` is a tensor)."""
        if torch.is_tensor(slots):
            both = self.kv[:, layer, :, :, :length].index_select(1, slots)
            return both[0], both[1]
        if _is_range(slots):
            s0 = slots[0]
            return self.k[layer, s0 : s0 + len(slots), :, :length], self.v[layer, s0 : s0 + len(slots), :, :length]
        # index_select over the slot dimension: several times faster than advanced indexing here.
        # The index is built once per forward: every layer reads the same slots.
        if self._gather[0] != tuple(slots):
            self._gather = (tuple(slots), torch.tensor(slots, device=self.k.device))
        idx = self._gather[1]
        return self.k[layer, :, :, :length].index_select(0, idx), self.v[layer, :, :, :length].index_select(0, idx)

    def forget(self) -> None:
        """No entry is in use (SlotManager.forget_claims): nothing to do for entries held here."""

    def move(self, slot: int, src: Sequence[int] | torch.Tensor, dst: int) -> None:
        """Copy the entries at positions `src` of a slot to positions dst, dst+1, ... (all layers):
        an accepted draft-tree path, compacted."""
        src = torch.as_tensor(src, dtype=torch.long, device=self.k.device)
        n = src.numel()
        if n:
            # index_select gathers into a new tensor first, so overlapping src/dst ranges are safe.
            self.k[:, slot, :, dst : dst + n].copy_(self.k[:, slot].index_select(2, src))
            self.v[:, slot, :, dst : dst + n].copy_(self.v[:, slot].index_select(2, src))

    def copy(self, src_slot: int, dst_slots: Sequence[int], length: int) -> None:
        """Give every slot in dst_slots the first `length` entries of src_slot (a shared prompt)."""
        for d in dst_slots:
            if d != src_slot:
                self.k[:, d, :, :length].copy_(self.k[:, src_slot, :, :length])
                self.v[:, d, :, :length].copy_(self.v[:, src_slot, :, :length])

    def snapshot(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the slot's first `length` entries (all layers), for restore()."""
        return self.k[:, slot, :, :length].clone(), self.v[:, slot, :, :length].clone()

    def restore(self, slot: int, kv: tuple[torch.Tensor, torch.Tensor], start: int = 0) -> int:
        """Make a snapshot() the slot's entries from `start` on (one of fewer layers: the first
        ones'); returns where they end."""
        layers, end = kv[0].shape[0], start + kv[0].shape[2]
        self.k[:layers, slot, :, start:end].copy_(kv[0])
        self.v[:layers, slot, :, start:end].copy_(kv[1])
        return end


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
