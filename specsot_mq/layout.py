"""Where the running sequences' keys and values live in the base model's cache: the two layouts.

The decoders (plain and EAGLE) talk to the cache only through a layout, with four calls:
`prefill` (prompts in; last logits and features out), `forward` (the new tokens of every running
sequence, with their positions and, for a draft tree, a mask over the sequence's own new tokens),
`commit` (which of those new entries each sequence keeps: all for a plain step, the root and the
accepted path after a verify) and `drop`. So every decoder runs unchanged in either layout.

- SlotLayout ("batching"): sequence k owns cache slot k. A shared prompt prefix is computed once and
  copied into each slot; a step is one [B, T] forward, rows right-padded, or, where causal rows
  differ in length and the native kernels run the model, one token per batch row (no padding).
- BimLayout ("bim", the branch-index map): all sequences (the branches of one question) share ONE
  slot. The shared prefix is stored once; after it, every step appends the branches' new tokens
  side by side, and `owner[k]` records which branch wrote entry k (-1 for the prefix). Each query
  sees the prefix, its own branch's kept entries and, within the step, what its mask allows, never
  another branch's entries; positions restart after the prefix for every branch. A branch is thus
  computed as if it were alone, and both layouts give the same tokens (tests check it, plain and
  with EAGLE). A finished branch's entries stay in the slot, masked out, until the question ends.
  The draft head's one-layer cache keeps a slot per sequence in both layouts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specsot_mq.errors import SpecSotError
from specsot_mq.kv_cache import KVCache
from specsot_mq.model import LlamaModel

LAYOUTS = ("batching", "bim")


@dataclass(slots=True)
class Prefilled:
    """The base model's pass over a set of prompts."""

    slots: list[int]  # the sequences, in row order
    last_logits: torch.Tensor  # [B, V] logits at each prompt's last token
    features: torch.Tensor | None  # [B, T, F*H] features of the suffix tokens (right-padded), if asked
    prefix_features: torch.Tensor | None  # [shared, F*H] features of the shared prefix, if computed now


def check_layout(name: str) -> None:
    if name not in LAYOUTS:
        raise SpecSotError(f"--layout must be one of {', '.join(LAYOUTS)}, got '{name}'")


def new_layout(name: str, model: LlamaModel, cache: KVCache) -> SlotLayout | BimLayout:
    check_layout(name)
    return SlotLayout(model, cache) if name == "batching" else BimLayout(model, cache)


class SlotLayout:
    """The batching layout: sequence k in cache slot k (see the module docstring)."""

    def __init__(self, model: LlamaModel, cache: KVCache):
        self.model, self.cache = model, cache
        self.max_sequences = cache.num_slots
        self.starts: list[int] = []  # where the last forward's entries start, per row

    def prefill(self, prompts: dict[int, list[int]], shared: int = 0, prefix_from: int | None = None,
                hidden_layers=()) -> Prefilled:  # fmt: skip
        """Put prompts into their cache slots with as little work as possible: the shared prefix
        once (in the first slot, or already in `prefix_from`), copied to the others in place; then
        every suffix in ONE forward: right-padded, or ragged where the lengths differ (_ragged)."""
        dev, cache = self.model.device, self.cache
        slots = list(prompts)
        _check_shared(prompts, shared)
        prefix_features = None
        if shared:
            if prefix_from is None:
                prefix_from = slots[0]
                cache.truncate(prefix_from, 0)
                prefix_features = _prefix(self.model, cache, prefix_from, prompts[prefix_from][:shared], hidden_layers)
            for s in slots:
                if s == prefix_from:
                    cache.truncate(s, shared)
                else:
                    cache.copy_prefix(prefix_from, [s], shared)
        else:
            for s in slots:
                cache.truncate(s, 0)
        suffixes = [prompts[s][shared:] for s in slots]
        lens = [len(x) for x in suffixes]
        if self._ragged_pays(lens):
            positions = [list(range(shared, shared + n)) for n in lens]
            logits, features = self._ragged(slots, suffixes, positions, hidden_layers, last_only=True)
            return Prefilled(slots, logits, features, prefix_features)
        t = max(lens)
        ids = torch.tensor([x + [0] * (t - len(x)) for x in suffixes], device=dev)
        positions = torch.arange(shared, shared + t, device=dev).expand(len(slots), t)
        last = torch.tensor([n - 1 for n in lens], device=dev)
        out = self.model(ids, positions, cache, slots=slots, hidden_layers=hidden_layers, logits_at=last)
        for s, n in zip(slots, lens):  # right padding sits after each row's tokens: causal rows never see it
            cache.truncate(s, shared + n)
        features = torch.cat(out.hidden, -1) if hidden_layers else None
        return Prefilled(slots, out.logits[:, 0], features, prefix_features)

    def length(self, seq: int) -> int:
        """The position of the sequence's next token (= its entries in the cache)."""
        return self.cache.lengths[seq]

    def room(self, seqs: Sequence[int]) -> int:
        """Entries every one of `seqs` can still append."""
        return min(self.cache.capacity - self.cache.lengths[s] for s in seqs)

    def forward(self, seqs: list[int], ids: list, positions: list, masks: list | None = None,
                hidden_layers=()) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """New tokens ids[i] at positions[i] for sequence seqs[i] (masks[i]: [T_i, T_i] over them;
        None: causal); returns logits [B, T, V] and features [B, T, F*H] (rows right-padded)."""
        dev = self.model.device
        self.starts = [self.cache.lengths[s] for s in seqs]
        lens = [len(x) for x in ids]
        if masks is None and self._ragged_pays(lens):
            return self._ragged(seqs, ids, positions, hidden_layers)
        t = max(lens)
        # padding goes last: causal rows never see it; under a mask, padding sees only itself
        tokens = torch.tensor([list(x) + [0] * (t - n) for x, n in zip(ids, lens)], device=dev)
        pos = torch.tensor([list(p) + [p[0]] * (t - n) for p, n in zip(positions, lens)], device=dev)
        mask = None
        if masks is not None and t > 1:
            mask = torch.eye(t, dtype=torch.bool, device=dev).repeat(len(seqs), 1, 1)
            for i, n in enumerate(lens):
                mask[i, :n, :n] = masks[i]
        out = self.model(tokens, pos, self.cache, slots=seqs, mask=mask, hidden_layers=hidden_layers)
        return out.logits, torch.cat(out.hidden, -1) if hidden_layers else None

    def _ragged_pays(self, lens: list[int]) -> bool:
        """Whether causal rows of these lengths run ragged (_ragged) rather than padded: where they
        differ, and the model's attention reads the cache in place."""
        return len(set(lens)) > 1 and self.model.attends_in_place(self.cache)

    def _ragged(self, seqs: list[int], ids: list, positions: list, hidden_layers=(), last_only: bool = False):
        """Causal rows of different lengths, run as one forward of a token per batch row: sequence
        i's tokens are rows of their own, in its slot one after another (KVCache.reserve claims a
        slot named again after its previous claim, and every row's keys are written before any row
        attends), so the padding a [B, T] forward would compute is never computed, and each row gets
        the bits it would get there. Returns logits [B, T, V] right-padded (last_only: [B, V], each
        sequence's last) and features [B, T, F*H]."""
        dev = self.model.device
        lens = [len(x) for x in ids]
        slots = [s for s, n in zip(seqs, lens) for _ in range(n)]
        tokens = torch.tensor([tok for x in ids for tok in x], device=dev)[:, None]
        pos = torch.tensor([p for row in positions for p in row], device=dev)[:, None]
        ends = [n - 1 for n in itertools.accumulate(lens)]
        out = self.model(tokens, pos, self.cache, slots=slots, hidden_layers=hidden_layers,
                         logit_rows=ends if last_only else None)  # fmt: skip
        features = _rows(torch.cat(out.hidden, -1)[:, 0], lens) if hidden_layers else None
        return (out.logits[0] if last_only else _rows(out.logits[:, 0], lens)), features

    def commit(self, seqs: list[int], keep: list[list[int]]) -> None:
        """Keep, for each sequence, its last forward's new entries at indices keep[i] (in order)."""
        for seq, start, k in zip(seqs, self.starts, keep):
            if k == list(range(len(k))):
                self.cache.truncate(seq, start + len(k))
            else:
                self.cache.move(seq, [start + i for i in k], start)

    def drop(self, seq: int) -> None:
        pass

    def snapshot(self, seq: int, n: int):
        """A copy of the sequence's first n cache entries, for restore (the prefix store)."""
        return self.cache.snapshot(seq, n)

    def restore(self, seq: int, kv) -> bool:
        """Make a snapshot the sequence's cache content; True (this layout always can)."""
        self.cache.restore(seq, kv)
        return True


class BimLayout:
    """The branch-index-map layout: every sequence in cache slot `slot` (see the module docstring).
    It holds one question's branches at a time: prefill without prefix_from starts a new one."""

    def __init__(self, model: LlamaModel, cache: KVCache, slot: int = 0):
        self.model, self.cache, self.slot = model, cache, slot
        self.max_sequences = cache.num_slots  # the draft head's cache has a slot per sequence
        self.owner: list[int] = []  # branch of each cache entry in the slot; -1 = shared prefix
        self.branch: dict[int, int] = {}  # sequence -> its branch id in `owner` (sequence names get reused)
        self.next_branch = 0
        self.pos: dict[int, int] = {}  # running sequence -> position of its next token
        self.last: tuple[int, list[int]] = (0, [])  # the last forward: first entry, tokens per row

    def prefill(self, prompts: dict[int, list[int]], shared: int = 0, prefix_from: int | None = None,
                hidden_layers=()) -> Prefilled:  # fmt: skip
        seqs = list(prompts)
        _check_shared(prompts, shared)
        prefix_features = None
        if prefix_from is None:  # a new question: the prefix goes in once
            if self.pos:
                raise SpecSotError("the bim layout holds one question's branches at a time; finish them first")
            self.cache.truncate(self.slot, 0)
            self.owner = [-1] * shared
            if shared:
                head = prompts[seqs[0]][:shared]
                prefix_features = _prefix(self.model, self.cache, self.slot, head, hidden_layers)
        for s in seqs:  # a fresh branch id, so a reused name never sees its predecessor's entries
            self.branch[s], self.next_branch = self.next_branch, self.next_branch + 1
            self.pos[s] = shared
        suffixes = [prompts[s][shared:] for s in seqs]
        lens = [len(x) for x in suffixes]
        positions = [list(range(shared, shared + n)) for n in lens]
        ends = torch.tensor(lens).cumsum(0) - 1  # each row's last token, in the side-by-side layout
        logits, features = self._append(seqs, suffixes, positions, None, hidden_layers, logits_at=ends)
        self.commit(seqs, [list(range(n)) for n in lens])
        features = None if features is None else _rows(features[0], lens)
        return Prefilled(seqs, logits[0], features, prefix_features)

    def length(self, seq: int) -> int:
        return self.pos[seq]

    def room(self, seqs: Sequence[int]) -> int:
        """Entries each of `seqs` can append this step (the slot's free room, shared evenly)."""
        return (self.cache.capacity - len(self.owner)) // max(1, len(seqs))

    def forward(self, seqs: list[int], ids: list, positions: list, masks: list | None = None,
                hidden_layers=()) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """As SlotLayout.forward: all rows go into the one slot side by side, in one forward."""
        logits, features = self._append(seqs, ids, positions, masks, hidden_layers)
        lens = self.last[1]
        return _rows(logits[0], lens), None if features is None else _rows(features[0], lens)

    def commit(self, seqs: list[int], keep: list[list[int]]) -> None:
        """Keep, of the last forward's entries, keep[i] of row i; the kept ones close up in place."""
        start, lens = self.last
        src, owners, first = [], [], start
        for seq, n, k in zip(seqs, lens, keep):
            src += [first + i for i in k]
            owners += [self.branch[seq]] * len(k)
            self.pos[seq] += len(k)
            first += n
        if src == list(range(start, start + len(src))):
            self.cache.truncate(self.slot, start + len(src))
        else:
            self.cache.move(self.slot, src, start)
        self.owner[start:] = owners

    def drop(self, seq: int) -> None:
        self.pos.pop(seq, None)

    def snapshot(self, seq: int, n: int) -> None:
        """None: a sequence's entries here interleave with its siblings' (no prefix to copy)."""
        return None

    def restore(self, seq: int, kv) -> bool:
        """A snapshot as the next question's shared prefix (prefill with prefix_from=seq then starts
        its branches after it); False (nothing done) while branches run, whose slot it would overwrite."""
        if self.pos:
            return False
        self.cache.restore(self.slot, kv)
        self.owner = [-1] * self.cache.lengths[self.slot]
        return True

    def _append(self, seqs, ids, positions, masks, hidden_layers, logits_at=None):
        """One forward of every row's new tokens, appended to the slot; output rows are [1, Q, ...]."""
        dev = self.model.device
        lens = [len(x) for x in ids]
        start = len(self.owner)
        self.owner += [self.branch[s] for s, n in zip(seqs, lens) for _ in range(n)]
        self.last = (start, lens)
        owner = torch.tensor(self.owner, device=dev)
        mine = owner[start:, None]
        # Kept entries: the prefix and the query's own branch; new ones: its row's mask.
        seen = (owner[None, :start] == -1) | (owner[None, :start] == mine)
        blocks = [torch.ones(n, n, dtype=torch.bool, device=dev).tril() if masks is None else masks[i].to(dev)
                  for i, n in enumerate(lens)]  # fmt: skip
        mask = torch.cat([seen, torch.block_diag(*blocks)], 1)[None]
        tokens = torch.cat([torch.as_tensor(x, device=dev).view(-1) for x in ids])[None]
        pos = torch.cat([torch.as_tensor(p, device=dev).view(-1) for p in positions])[None]
        at = None if logits_at is None else logits_at.to(dev)[None]
        out = self.model(tokens, pos, self.cache, slots=[self.slot], mask=mask, hidden_layers=hidden_layers,
                         logits_at=at)  # fmt: skip
        return out.logits, torch.cat(out.hidden, -1) if hidden_layers else None


def _check_shared(prompts: dict[int, list[int]], shared: int) -> None:
    if not 0 <= shared < min(len(p) for p in prompts.values()):
        raise ValueError(f"shared prefix {shared} must be shorter than every prompt")


def _prefix(model: LlamaModel, cache: KVCache, slot: int, ids: list[int], hidden_layers) -> torch.Tensor | None:
    """The shared prefix into `slot` (which is empty); its features [shared, F*H] when asked."""
    dev = model.device
    out = model(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None], cache, slots=[slot],
                hidden_layers=hidden_layers, last_only=True)  # fmt: skip
    return torch.cat(out.hidden, -1)[0] if hidden_layers else None


def _rows(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """[Q, ...] of rows laid side by side -> [B, T, ...], right-padded with zeros."""
    t = max(lens)
    if all(n == t for n in lens):
        return x.view(len(lens), t, *x.shape[1:])
    out = x.new_zeros(len(lens), t, *x.shape[1:])
    first = 0
    for i, n in enumerate(lens):
        out[i, :n] = x[first : first + n]
        first += n
    return out
