"""Where the running sequences' keys and values live in the base model's cache: sequence k in
cache slot k (the batching layout).

The decoders (plain and EAGLE) talk to the cache only through the layout, with three calls:
`prefill` (prompts in; last logits and features out), `forward` (the new tokens of every running
sequence, with their positions and, for a draft tree, a mask over the sequence's own new tokens),
`commit` (which of those new entries each sequence keeps: all for a plain step, the root and the
accepted path after a verify). The layout keeps nothing of its own: what each slot holds
is the slot manager's (slots.py). A shared prompt prefix is computed once and read by every row
that shares it from one slot (the kernels' prefix sources); a step is one [B, T] forward, rows
right-padded, or, where causal rows differ in length and the native kernels run the model, one
token per batch row (no padding). A step's tensors are made on the host: the model moves them
where it runs (a captured GPU step copies them over in one go, cuda_graphs.py).

A branch-index-map layout (every branch of a question in one slot, under a mask) ran beside this
one until 2026-11-26; it gave no robust gain in any measurement (benchmarks/HISTORY.md) and went.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specsot_mq.model import LlamaModel, Step
from specsot_mq.prefix_store import Entry
from specsot_mq.sequence import Resume
from specsot_mq.slots import SlotManager


@dataclass(slots=True)
class Prefilled:
    """The base model's pass over a set of prompts."""

    last_logits: torch.Tensor  # [B, V] logits at each prompt's last token, in the prompts' order
    features: torch.Tensor | None  # [B, T, F*H] features of the suffix tokens (right-padded), if asked
    have: int  # tokens of the shared prefix that were computed before (in a slot, or in the store)
    prefix_features: torch.Tensor | None  # [shared - have, F*H] features of the rest of it, if computed now


class SlotLayout:
    """Sequence k in cache slot k (see the module docstring)."""

    def __init__(self, model: LlamaModel, slots: SlotManager):
        self.model, self.slots = model, slots

    def prefill(self, prompts: dict[int, list[int]], shared: int = 0, source: int | Entry | None = None,
                hidden_layers=(), resume: Resume | None = None) -> Prefilled:  # fmt: skip
        """Put prompts into their cache slots with as little work as possible: their shared prefix
        from `source` (a slot that holds it, or a prefix store entry that begins it, restored into
        the first slot, the rest computed there once), copied to the others in place; then every
        suffix in ONE forward: right-padded, or ragged where the lengths differ (_ragged). One
        prompt with its `resume` (sequence.Resume) from where its suffix begins runs only the
        layers the resume has not (where the features asked for come from those layers)."""
        mgr, cache = self.slots, self.slots.cache
        slots = list(prompts)
        first = slots[0]
        _check_shared(prompts, shared)
        home, have = (source, shared) if isinstance(source, int) else (first, 0)
        if isinstance(source, Entry):
            have = cache.restore(first, source.state.kv)
        prefix_features = None
        if have < shared:
            prefix_features = _prefix(self.model, mgr, first, prompts[first][have:shared], have, hidden_layers)
        if shared:
            cache.copy(home, slots, shared)
        # one copy of the prefix: a slot that held it lends its own, a fresh one is named anew
        copy = -1 if not shared else mgr[home].copy if isinstance(source, int) else mgr.new_id()
        mgr.claim(slots, tuple(prompts[first][:shared]), copy)
        suffixes = [prompts[s][shared:] for s in slots]
        lens = [len(x) for x in suffixes]
        for s, n in zip(slots, lens):
            mgr[s].length = shared
            mgr.check(s, shared, n)
        if resumes(resume, self.model, prompts, shared, hidden_layers):
            cache.restore(first, resume.kv, shared)  # the resume's layers' entries; it runs the rest
            positions = torch.arange(shared, shared + lens[0])[None]
            later = tuple(layer for layer in hidden_layers if layer >= resume.layer)
            step = Step([first], [shared], positions, logit_rows=[lens[0] - 1], hidden_layers=later,
                        sources=mgr.prefix_sources(slots), from_layer=resume.layer)  # fmt: skip
            out = self.model(resume.hidden[None], cache, step)
            dev = out.logits.device  # (the router hands its hidden states back on the host)
            ran = {n: h for n, h in zip(later, out.hidden)} | {n: h[None].to(dev) for n, h in resume.earlier.items()}
            logits = out.logits
            features = torch.cat([ran[n] for n in hidden_layers], -1) if hidden_layers else None
        elif self._ragged_pays(lens):
            positions = [list(range(shared, shared + n)) for n in lens]
            logits, features = self._ragged(slots, suffixes, positions, hidden_layers, last_only=True)
        else:
            t = max(lens)
            ids = torch.tensor([x + [0] * (t - len(x)) for x in suffixes])
            positions = torch.arange(shared, shared + t).expand(len(slots), t)
            step = Step(slots, [shared] * len(slots), positions, logit_rows=[i * t + n - 1 for i, n in enumerate(lens)],
                        hidden_layers=hidden_layers, sources=mgr.prefix_sources(slots))  # fmt: skip
            out = self.model(ids, cache, step)
            logits, features = out.logits, torch.cat(out.hidden, -1) if hidden_layers else None
        for s, n in zip(slots, lens):  # right padding sits after each row's tokens: causal rows never see it
            mgr[s].length = shared + n
        return Prefilled(logits, features, have, prefix_features)

    def length(self, seq: int) -> int:
        """The position of the sequence's next token (= its entries in the cache)."""
        return self.slots[seq].length

    def room(self, seqs: Sequence[int]) -> int:
        """Entries every one of `seqs` can still append."""
        return min(self.slots.capacity - self.slots[s].length for s in seqs)

    def forward(self, seqs: list[int], ids: list, positions: list, masks: list | None = None,
                hidden_layers=()) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """New tokens ids[i] at positions[i] for sequence seqs[i] (masks[i]: [T_i, T_i] over them;
        None: causal); returns logits [B, T, V] and features [B, T, F*H] (rows right-padded). The
        entries stay the sequences' own only as commit() keeps them."""
        mgr = self.slots
        lens = [len(x) for x in ids]
        for s, n in zip(seqs, lens):
            mgr.check(s, mgr[s].length, n)
        if masks is None and self._ragged_pays(lens):
            return self._ragged(seqs, ids, positions, hidden_layers)
        t = max(lens)
        # padding goes last: causal rows never see it; under a mask, padding sees only itself
        tokens = torch.tensor([list(x) + [0] * (t - n) for x, n in zip(ids, lens)])
        pos = torch.tensor([list(p) + [p[0]] * (t - n) for p, n in zip(positions, lens)])
        mask = None
        if masks is not None and t > 1:
            mask = torch.eye(t, dtype=torch.bool).repeat(len(seqs), 1, 1)
            for i, n in enumerate(lens):
                mask[i, :n, :n] = masks[i]
        step = Step(seqs, [mgr[s].length for s in seqs], pos, mask, hidden_layers=hidden_layers,
                    sources=mgr.prefix_sources(seqs))  # fmt: skip
        out = self.model(tokens, mgr.cache, step)
        return out.logits, torch.cat(out.hidden, -1) if hidden_layers else None

    def _ragged_pays(self, lens: list[int]) -> bool:
        """Whether causal rows of these lengths run ragged (_ragged) rather than padded: where they
        differ, and the model's attention reads the cache in place."""
        return len(set(lens)) > 1 and self.model.attends_in_place(self.slots.cache)

    def _ragged(self, seqs: list[int], ids: list, positions: list, hidden_layers=(), last_only: bool = False):
        """Causal rows of different lengths, run as one forward of a token per batch row: sequence
        i's tokens are rows of their own, in its slot one after another (every row's keys are
        written before any row attends), so the padding a [B, T] forward would compute is never
        computed, and each row gets the bits it would get there. Returns logits [B, T, V]
        right-padded (last_only: [B, V], each sequence's last) and features [B, T, F*H]."""
        mgr = self.slots
        lens = [len(x) for x in ids]
        slots = [s for s, n in zip(seqs, lens) for _ in range(n)]
        starts = [mgr[s].length + i for s, n in zip(seqs, lens) for i in range(n)]
        tokens = torch.tensor([tok for x in ids for tok in x])[:, None]
        pos = torch.tensor([p for row in positions for p in row])[:, None]
        ends = [n - 1 for n in itertools.accumulate(lens)]
        step = Step(slots, starts, pos, logit_rows=ends if last_only else None, hidden_layers=hidden_layers,
                    sources=mgr.prefix_sources(slots))  # fmt: skip
        out = self.model(tokens, mgr.cache, step)
        features = _rows(torch.cat(out.hidden, -1)[:, 0], lens) if hidden_layers else None
        return (out.logits if last_only else _rows(out.logits[:, 0], lens)), features

    def commit(self, seqs: list[int], sizes: list[int], keep: list[list[int]]) -> None:
        """Keep, for each sequence, its last forward's new entries (sizes[i] of them) at indices
        keep[i] (in order)."""
        for seq, k in zip(seqs, keep):
            start = self.slots[seq].length
            if k != list(range(len(k))):
                self.slots.cache.move(seq, [start + i for i in k], start)
            self.slots[seq].length = start + len(k)


def _check_shared(prompts: dict[int, list[int]], shared: int) -> None:
    if not 0 <= shared < min(len(p) for p in prompts.values()):
        raise ValueError(f"shared prefix {shared} must be shorter than every prompt")


def resumes(resume: Resume | None, model, prompts: dict[int, list[int]], shared: int, hidden_layers) -> bool:
    """Whether a prefill of `prompts` from their first `shared` tokens can start from `resume`: one
    prompt, the resume's, begun where it is, every feature asked for from its later layers, on a
    whole model in this process."""
    return (resume is not None and isinstance(model, LlamaModel) and model.first_layer == 0 and len(prompts) == 1
            and next(iter(prompts.values())) == resume.ids and resume.start == shared
            and all(layer >= resume.layer or layer in resume.earlier for layer in hidden_layers))  # fmt: skip


def _prefix(model: LlamaModel, slots: SlotManager, slot: int, ids: list[int], start: int, hidden_layers):
    """The shared prefix's tokens from `start` on into `slot` (which holds those before it); their
    features [len(ids), F*H] when asked."""
    step = Step([slot], [start], torch.arange(start, start + len(ids))[None], logit_rows=[len(ids) - 1],
                hidden_layers=hidden_layers)  # fmt: skip
    out = model(torch.tensor([ids]), slots.cache, step)
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
