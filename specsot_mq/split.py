"""A model split by layers: contiguous ranges of its layers, each a LlamaModel of its own with the
KV cache of its own layers (`--split layers`, issue 44).

This is the split inside one process: `SplitModel` chains the ranges behind LlamaModel's forward
(each range's output hidden state is the next one's input), so the generation loop, both decoders
(an EAGLE head reads its features from whichever ranges hold those layers) and the SoT engine run
over it unchanged, and its greedy output is the whole model's, token for token. Ranges on
separate processes (remote_range.py: a RemoteRange part, its hidden state sent as a frame over
ZeroMQ to the RangeServer that holds those layers) build on this.

`layer_ranges` sizes the ranges by each device's memory budget (devices.json): the embedding
goes with the first range, the final norm and output layer with the last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from specsot_mq.errors import SpecSotError
from specsot_mq.kv_cache import KVCache
from specsot_mq.model import ForwardOutput, LlamaModel, Step


def layer_ranges(num_layers: int, layer_bytes: int, budgets: Sequence[float], embed_bytes: int = 0,
                 head_bytes: int = 0, names: Sequence[str] | None = None) -> list[tuple[int, int]]:  # fmt: skip
    """[first, last) of each device's layers, in device order: as many as its budget's share
    (bytes, after the embedding on the first and the output layer on the last) allows, each at
    least one; a device whose range does not fit its budget raises SpecSotError naming it."""
    names = list(names or (f"device {i}" for i in range(len(budgets))))
    if not 1 <= len(budgets) <= num_layers:
        raise SpecSotError(f"a split needs 1 to {num_layers} devices (one layer each at least), got {len(budgets)}")
    room = [b - (embed_bytes if i == 0 else 0) - (head_bytes if i == len(budgets) - 1 else 0)
            for i, b in enumerate(budgets)]  # fmt: skip
    total = sum(max(r, 0.0) for r in room) or 1.0
    counts = [max(1, round(num_layers * max(r, 0.0) / total)) for r in room]
    while sum(counts) != num_layers:  # rounding: take from (or give to) the range with most (least) room per layer
        over = sum(counts) > num_layers
        pick = (min if over else max)(
            (i for i in range(len(counts)) if not over or counts[i] > 1), key=lambda i: room[i] / counts[i]
        )
        counts[pick] += -1 if over else 1
    bounds, first = [], 0
    for i, n in enumerate(counts):
        if n * layer_bytes > room[i]:
            need = n * layer_bytes + budgets[i] - room[i]
            raise SpecSotError(f"{names[i]}'s {n} layers need {need / 2**20:.0f} MB, more than its memory budget "
                               f"({budgets[i] / 2**20:.0f} MB): add a device or raise its memory in devices.json")
        bounds.append((first, first + n))
        first += n
    return bounds


def split_layers(model: LlamaModel, bounds: Sequence[tuple[int, int]]) -> list[LlamaModel]:
    """The model's layers in these contiguous ranges, each a LlamaModel sharing the model's modules
    (the embedding only in the first, the output layer only in the last; every range keeps the
    final norm's weight, which names its dtype and device)."""
    joined = all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
    if not (bounds and bounds[0][0] == 0 and bounds[-1][1] == len(model.layers) and joined
            and all(a < b for a, b in bounds)):  # fmt: skip
        raise SpecSotError(f"layer ranges {list(bounds)} must cover layers 0 to {len(model.layers)} in order")
    parts = []
    for first, last in bounds:
        part = LlamaModel.__new__(LlamaModel)
        nn.Module.__init__(part)
        part.cfg, part.first_layer = model.cfg, first
        part.register_buffer("rope_cos", model.rope_cos, persistent=False)
        part.register_buffer("rope_sin", model.rope_sin, persistent=False)
        part.layers = nn.ModuleList(model.layers[first:last])
        part.norm = model.norm
        if first == 0:
            part.embed = model.embed
        if last == len(model.layers):
            part.lm_head = model.lm_head
        parts.append(part)
    return parts


class SplitCache:
    """The ranges' caches, as one cache to the slot manager: the same slots and capacity in each;
    a snapshot holds every layer in model order, as a whole model's cache would."""

    def __init__(self, parts: list[KVCache]):
        self.parts = parts
        self.capacity = parts[0].capacity

    @property
    def num_slots(self) -> int:
        return self.parts[0].num_slots

    def copy(self, src_slot: int, dst_slots: Sequence[int], length: int) -> None:
        for c in self.parts:
            c.copy(src_slot, dst_slots, length)

    def move(self, slot: int, src, dst: int) -> None:
        for c in self.parts:
            c.move(slot, src, dst)

    def snapshot(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = [c.snapshot(slot, length) for c in self.parts]
        return torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv])

    def restore(self, slot: int, kv: tuple[torch.Tensor, torch.Tensor]) -> int:
        first = 0
        for c in self.parts:
            n = c.num_layers
            held = c.restore(slot, (kv[0][first : first + n], kv[1][first : first + n]))
            first += n
        return held


class SplitModel(nn.Module):
    """The ranges chained behind LlamaModel's interface (see the module docstring)."""

    def __init__(self, parts: list[LlamaModel]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.cfg = parts[0].cfg

    @property
    def embed(self) -> nn.Module:
        return self.parts[0].embed

    @property
    def lm_head(self) -> nn.Module:
        if not hasattr(self.parts[-1], "lm_head"):  # a remote last range (remote_range.py)
            raise SpecSotError("an EAGLE head needs the output layer where it drafts, and the last layer range is "
                               "in another process: pass --draft none over this split (for now)")  # fmt: skip
        return self.parts[-1].lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def new_cache(self, num_slots: int, capacity: int, dtype: torch.dtype | None = None,
                  graphs: bool | None = None) -> SplitCache:  # fmt: skip
        return SplitCache([p.new_cache(num_slots, capacity, dtype, graphs) for p in self.parts])

    def attends_in_place(self, cache: SplitCache) -> bool:
        return all(p.attends_in_place(c) for p, c in zip(self.parts, cache.parts))

    def forward(self, input_ids: torch.Tensor, cache: SplitCache, step: Step) -> ForwardOutput:
        """Each range in turn over the previous one's output hidden state; the hidden states asked
        for from the ranges that hold them, the logits from the last (none asked: the forward ends
        with the range that holds the last hidden state asked for, as LlamaModel's does)."""
        want, x, hidden = tuple(step.hidden_layers), input_ids, {}
        stop = max(want) if step.logit_rows == [] and want else None
        for part, c in zip(self.parts, cache.parts):
            last = part is self.parts[-1]
            mine = tuple(i for i in want if part.first_layer <= i < part.last_layer or (last and i == part.last_layer))
            sub = replace(step, hidden_layers=mine) if last else replace(step, logit_rows=[],
                                                                         hidden_layers=(*mine, part.last_layer))  # fmt: skip
            out = part(x, c, sub)
            hidden.update(zip(sub.hidden_layers, out.hidden))
            if last or (stop is not None and stop <= part.last_layer):
                return ForwardOutput(out.logits, [hidden[i] for i in want])
            x = out.hidden[-1]
        raise AssertionError("unreachable: the last range returns")
