"""The decoders the generation loop drives, and the one way a sequence starts.

A decoder advances the sequences of one slot manager (slots.py) through its layout (layout.py):
`start()` prefills new sequences (also while others run), `step()` advances the running ones in
one batched forward (a sequence that ends leaves its slot to be overwritten). Plain decoding is here; EAGLE speculative decoding
(speculative.py) is a decoder too.

Every prompt starts from the longest beginning of it that is already computed, and this is the one
path that reuses prefixes (`start`): the jobs of a group share their prefix, taken from a slot that
holds it (a sibling admitted earlier), else from the prefix store (its longest stored beginning,
the rest computed once), else computed once; a prompt of no group starts from the longest beginning
of it that another slot or the store holds, the prompts of one source prefilled together. A job
with `keep` puts its prompt's first tokens in the store after its prefill.
"""

from __future__ import annotations

import time

import torch

from specsot_mq.layout import SlotLayout
from specsot_mq.lookup import History, ListTokens, NgramIndex
from specsot_mq.model import LlamaModel
from specsot_mq.prefix_store import Entry, Kept
from specsot_mq.sampling import Sampler, greedy_tokens
from specsot_mq.sequence import Sequence
from specsot_mq.slots import SlotManager
from specsot_mq.tree import graft, root_only
from specsot_mq.verify import SpecStats, accept_greedy


class Decoder:
    """What every decoder shares: sequences named by their cache slots 0..max_sequences-1, the
    layout, and `start`."""

    drafts = False  # whether a stored prefix it starts from needs the draft head's state
    stats: SpecStats | None = None

    def __init__(self, model: LlamaModel, slots: SlotManager, sampler: Sampler, lists: ListTokens | None,
                 history: History | None):  # fmt: skip
        self.model, self.slots, self.sampler, self.lists, self.history = model, slots, sampler, lists, history
        self.layout = SlotLayout(model, slots)
        self.max_sequences = slots.num_slots

    def start(self, seqs: list[Sequence], shared: int = 0) -> int:
        """Prefill new sequences (each gets its first token as `last`, and its state) from what is
        computed already (see the module docstring); `shared`: their prompts' first `shared` tokens
        are the same (a group). Returns the prompt tokens it computed."""
        mgr = self.slots
        if shared:
            batches = {(): (mgr.find(seqs[0].job.ids[:shared], range(mgr.num_slots), True, self.drafts), seqs)}
        else:  # a slot being started now may not hold what it held when the last one starts
            others = [s for s in range(mgr.num_slots) if s not in {seq.slot for seq in seqs}]
            batches = {}
            for seq in seqs:
                source = mgr.find(seq.job.ids[:-1], others, False, self.drafts)
                key = tuple(source.ids) if isinstance(source, Entry) else source
                batches.setdefault(key, (source, []))[1].append(seq)
        computed = 0
        for source, group in sorted(batches.values(), key=lambda b: b[0] is None):  # the prompts from nothing last
            held = 0 if source is None else len(source.ids) if isinstance(source, Entry) else len(mgr[source].prefix)
            self.prefill(group, shared or held, source)
            computed += sum(len(seq.job.ids) - (shared or held) for seq in group) + (shared or held) - held
        return computed

    def prefill(self, seqs: list[Sequence], shared: int, source: int | Entry | None) -> None:
        """Prefill prompts whose first `shared` tokens are the same, from `source` (layout.py)."""
        raise NotImplementedError

    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        """One step of every running sequence (their records updated); each one's new tokens."""
        raise NotImplementedError

    def room(self, slots: list[int]) -> int:
        """Cache entries each of these sequences can still append (a step needs at least one)."""
        return self.layout.room(slots)

    def kept(self, slot: int, n: int, feature: torch.Tensor | None = None) -> Kept | None:
        """What a later prompt needs to start from the first n tokens of `slot`, read right after
        its prefill (None where it cannot be had)."""
        return Kept(self.slots.cache.snapshot(slot, n))

    def _store(self, seq: Sequence, feature: torch.Tensor | None = None) -> None:
        """Put the first job.keep tokens of a just-prefilled prompt in the prefix store (`feature`:
        the base feature at the last of them, where the decoder needs it)."""
        ids = seq.job.ids[: seq.job.keep]
        if len(ids) >= 2 and ids not in self.slots.store and (state := self.kept(seq.slot, len(ids), feature)):
            self.slots.store.add(ids, state)


class PlainDecoder(Decoder):
    """One token per sequence per forward; all running sequences share each forward.

    With `lookup` (greedy only; a model without a draft head), each sequence also feeds the
    tokens prompt lookup copies from earlier in it (lookup.py; `lists`: how the tokenizer opens a
    numbered list's items, guessed where a list's line ends; `history`: the generator's recent
    outputs, copied from where the sequence's own tokens hold no match), up to `lookup` tokens per
    forward split between the sequences, and keeps those the base model's argmax agrees with,
    plus the next one: the same tokens, in fewer forwards."""

    def __init__(self, model: LlamaModel, slots: SlotManager, sampler: Sampler, lookup: int = 0,
                 lists: ListTokens | None = None, history: History | None = None):  # fmt: skip
        super().__init__(model, slots, sampler, lists, history)
        self.lookup = lookup if sampler.params.greedy else 0
        self.stats = SpecStats() if self.lookup else None  # what lookup drafted and got accepted (tau)

    def prefill(self, seqs: list[Sequence], shared: int, source: int | Entry | None) -> None:
        pre = self.layout.prefill({seq.slot: seq.job.ids for seq in seqs}, shared, source, resume=seqs[0].job.resume)
        for seq in seqs:  # (a generator with a head whose greedy decoding went plain) no draft state here
            self.slots[seq.slot].draft_length, self.slots[seq.slot].feature = 0, None
        for seq, tok in zip(seqs, self.sampler(pre.last_logits).tolist()):
            seq.last = tok
            if self.lookup:
                seq.index = NgramIndex(seq.job.ids + [tok], lists=self.lists, history=self.history)
            if seq.job.keep:
                self._store(seq)

    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        slots = [seq.slot for seq in seqs]
        if self.lookup:
            return self._lookup_step(seqs, slots)
        logits, _ = self.layout.forward(slots, [[seq.last] for seq in seqs], [[self.layout.length(s)] for s in slots])
        self.layout.commit(slots, [1] * len(slots), [[0]] * len(slots))
        for seq, tok in zip(seqs, self.sampler(logits[:, -1]).tolist()):
            seq.last = tok
        return [[seq.last] for seq in seqs]

    def _lookup_step(self, seqs: list[Sequence], slots: list[int]) -> list[list[int]]:
        """A step whose rows are chains: the step's token, then the copied ones (a draft tree of
        one path, verified and accepted as the EAGLE decoder's are)."""
        start = time.perf_counter()
        cap = min(self.lookup // len(seqs), self.layout.room(slots) - 1)
        chains = [graft(root_only(seq.last, self.layout.length(seq.slot)), seq.index.propose(cap)) for seq in seqs]
        logits, _ = self.layout.forward(slots, [c.tokens for c in chains], [c.positions for c in chains])  # causal
        best = greedy_tokens(logits).tolist()  # every row's argmax in one call
        results = [accept_greedy(c, best[i][: c.size]) for i, c in enumerate(chains)]
        self.layout.commit(slots, [c.size for c in chains], [[0] + res.nodes for res in results])
        for seq, res in zip(seqs, results):
            seq.index.extend(res.tokens)
            seq.last = res.tokens[-1]
        self.stats.count(chains, results, [1] * len(chains))  # every node past the root is lookup's
        self.stats.verify_seconds += time.perf_counter() - start
        return [res.tokens for res in results]
