"""A model split by layers: contiguous ranges of its layers, each a LlamaModel of its own with the
KV cache of its own layers (`--split layers`, issue 44).

This is the split inside one process: `SplitModel` chains the ranges behind LlamaModel's forward
(each range's output hidden state is the next one's input), so the generation loop, both decoders
(an EAGLE head reads its features from whichever ranges hold those layers) and the SoT engine run
over it unchanged, and its greedy output is the whole model's, token for token. Ranges on
separate processes (remote_range.py: a RemoteRange part, its hidden state sent as a frame over
ZeroMQ to the RangeServer that holds those layers) build on this. Over those, a long prompt's
prefill is pipelined: cut into chunks of `prefill_chunk` tokens, so that the ranges here work on
chunk i + 1 while the other processes work on chunk i.

`layer_ranges` sizes the ranges: each within its device's memory budget (devices.json), the
slowest as fast as can be; the embedding goes with the first range, the final norm and output
layer with the last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from specsot_mq.errors import SpecSotError
from specsot_mq.kv_cache import KVCache
from specsot_mq.model import ForwardOutput, LlamaModel, Step

PREFILL_CHUNK = 128  # --prefill-chunk: tokens per piece of a pipelined prefill


def layer_ranges(num_layers: int, layer_bytes: int, budgets: Sequence[float], embed_bytes: int = 0,
                 head_bytes: int = 0, names: Sequence[str] | None = None,
                 compute: Sequence[float] | None = None) -> list[tuple[int, int]]:  # fmt: skip
    """[first, last) of each device's layers, in device order, each at least one: of the splits
    whose every range fits its device's memory budget (bytes; the embedding counts against the
    first, the output layer against the last), the one whose slowest range is fastest. A range's
    time is its weights' bytes (its layers, and the output layer on the last: a decode step reads
    each weight once and a batch of rows computes in proportion to them; the embedding is a
    lookup) over its device's `compute` (devices.json; equal where not given): with ranges
    working on different steps at once, the slowest one sets the pace. Raises SpecSotError naming
    what does not fit."""
    n = len(budgets)
    names = list(names or (f"device {i}" for i in range(n)))
    if not 1 <= n <= num_layers:
        raise SpecSotError(f"a split needs 1 to {num_layers} devices (one layer each at least), got {n}")
    compute = list(compute or [1.0] * n)
    room = [b - (embed_bytes if i == 0 else 0) - (head_bytes if i == n - 1 else 0) for i, b in enumerate(budgets)]
    fits = [max(0, min(num_layers, int(r // layer_bytes))) if layer_bytes else num_layers for r in room]
    for i in range(n):
        if fits[i] < 1:
            raise SpecSotError(f"{names[i]}'s memory budget ({budgets[i] / 2**20:.0f} MB) holds none of the model's "
                               f"layers ({layer_bytes / 2**20:.0f} MB each"
                               f"{', beside the embedding' if i == 0 and embed_bytes else ''}"
                               f"{', beside the output layer' if i == n - 1 and head_bytes else ''}): raise it in "
                               "devices.json or leave the device out")  # fmt: skip
    if sum(fits) < num_layers:
        raise SpecSotError(f"the devices' memory budgets hold {sum(fits)} of the model's {num_layers} layers "
                           f"({num_layers * layer_bytes / 2**20:.0f} MB): add a device or raise their memory in "
                           "devices.json")  # fmt: skip

    def pace(i: int, layers: int) -> float:
        return (layers * layer_bytes + (head_bytes if i == n - 1 else 0)) / compute[i]

    # best[i][j]: the slowest range's time with the first j layers on the first i + 1 devices, and
    # the first layer of device i's range then (a split over every contiguous cut, n * L^2 steps)
    inf = float("inf")
    best = [[(inf, 0)] * (num_layers + 1) for _ in range(n)]
    for j in range(1, fits[0] + 1):
        best[0][j] = (pace(0, j), 0)
    for i in range(1, n):
        for j in range(i + 1, num_layers + 1):
            best[i][j] = min(((max(best[i - 1][k][0], pace(i, j - k)), k) for k in range(max(i, j - fits[i]), j)),
                             default=(inf, 0))  # fmt: skip
    bounds, last = [], num_layers
    for i in range(n - 1, -1, -1):
        first = best[i][last][1]
        bounds.append((first, last))
        last = first
    return bounds[::-1]


def weight_bytes(folder) -> tuple[float, int, int]:
    """A model folder's stored weight bytes (read off its safetensors headers): per layer (the
    mean), of the embedding, and of the output layer (the embedding's again where they are tied:
    each end holds it)."""
    import json

    from specsot_mq.config import ModelConfig
    from specsot_mq.loader import weight_files

    cfg = ModelConfig.from_folder(folder)
    layers = embed = head = 0
    for f in weight_files(folder):
        with open(f, "rb") as st:
            header = json.loads(st.read(int.from_bytes(st.read(8), "little")))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            n = entry["data_offsets"][1] - entry["data_offsets"][0]
            if name.startswith("model.layers."):
                layers += n
            elif name == "model.embed_tokens.weight":
                embed += n
            elif name == "lm_head.weight":
                head += n
    return layers / cfg.num_layers, embed, head or (embed if cfg.tie_embeddings else 0)


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

    def forget(self) -> None:
        for c in self.parts:
            c.forget()

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

    def __init__(self, parts: list[LlamaModel], prefill_chunk: int = PREFILL_CHUNK, edges: LlamaModel | None = None):
        """prefill_chunk: a longer prompt's prefill goes through ranges in other processes in
        chunks of this many tokens, pipelined (0: in one piece); edges: the embedding and the
        output layer here (load_model(layers=(0, 0))), for an EAGLE head, where the first or the
        last range is in another process."""
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.cfg = parts[0].cfg
        self.prefill_chunk = prefill_chunk
        self.edges = edges

    @property
    def embed(self) -> nn.Module:
        return self._edge("embed", self.parts[0])

    @property
    def lm_head(self) -> nn.Module:
        return self._edge("lm_head", self.parts[-1])

    def _edge(self, name: str, part: nn.Module) -> nn.Module:
        """The embedding or the output layer: the range's that holds it where that range is here,
        else the edges' (a range in another process, remote_range.py, keeps its own)."""
        for holder in (part, self.edges):
            if holder is not None and hasattr(holder, name):
                return getattr(holder, name)
        raise SpecSotError(f"an EAGLE head reads the model's {'embedding' if name == 'embed' else 'output layer'}, "
                           "which is in another process here: give SplitModel its edges "
                           "(load_model(..., layers=(0, 0))), or pass --draft none")  # fmt: skip

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
        if self._pipelines(input_ids, step):
            return self._pipelined(input_ids, cache, step)
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

    def _pipelines(self, input_ids: torch.Tensor, step: Step) -> bool:
        """Whether this forward is a prefill to pipeline: one causal row longer than a chunk, over
        ranges of which the later ones are in other processes, that asks for no hidden state."""
        remote = [hasattr(p, "submit") for p in self.parts]
        return (0 < self.prefill_chunk < input_ids.shape[1] and input_ids.shape[0] == 1 and step.mask is None
                and not step.hidden_layers and step.logit_rows != [] and any(remote)
                and remote == sorted(remote))  # fmt: skip

    def _pipelined(self, input_ids: torch.Tensor, cache: SplitCache, step: Step) -> ForwardOutput:
        """The prefill in chunks of prefill_chunk tokens: the ranges here compute chunk i + 1 while
        the other processes' ranges compute chunk i (each range's cache gets the chunks in order,
        each attending to the entries before it, so the output is the one-piece prefill's); a
        range's output goes on to the next as it comes back."""
        n, t = self.prefill_chunk, input_ids.shape[1]
        spans = [(a, min(a + n, t)) for a in range(0, t, n)]
        rows = set(range(t)) if step.logit_rows is None else set(step.logit_rows)
        first_remote = next(i for i, p in enumerate(self.parts) if hasattr(p, "submit"))
        last = len(self.parts) - 1

        def sub(i: int, a: int, b: int) -> Step:
            chunk = replace(step, starts=[s + a for s in step.starts], positions=step.positions[:, a:b])
            mine = [r - a for r in range(a, b) if r in rows]
            if i < last or not mine:  # (a forward asked for nothing would stop before writing its cache)
                return replace(chunk, logit_rows=[], hidden_layers=(self.parts[i].last_layer,))
            return replace(chunk, logit_rows=None if step.logit_rows is None else mine)

        sent = [0] * len(self.parts)  # chunks sent to each remote range
        done = [0] * len(self.parts)  # and received back from it
        logits = []

        def take(i: int) -> None:  # remote range i's next output goes on to range i + 1, or is the result
            out, (a, b) = self.parts[i].result(), spans[done[i]]
            done[i] += 1
            if i == last:
                if any(a <= r < b for r in rows):
                    logits.append(out.logits)
            else:
                self.parts[i + 1].submit(out.hidden[-1], cache.parts[i + 1], sub(i + 1, a, b))
                sent[i + 1] += 1

        for a, b in spans:
            x = input_ids[:, a:b]
            for i in range(first_remote):
                x = self.parts[i](x, cache.parts[i], sub(i, a, b)).hidden[-1]
            self.parts[first_remote].submit(x, cache.parts[first_remote], sub(first_remote, a, b))
            sent[first_remote] += 1
            for i in range(first_remote, last + 1):  # what has come back meanwhile
                while done[i] < sent[i] and self.parts[i].ready():
                    take(i)
        for i in range(first_remote, last + 1):
            while done[i] < sent[i]:
                take(i)
        return ForwardOutput(torch.cat(logits, dim=0 if step.logit_rows is not None else 1), [])
