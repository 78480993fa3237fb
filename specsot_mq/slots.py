"""One owner for what the caches hold: the slot manager.

A generator has one base KV cache (and, with a draft head, one draft cache) with a slot per
sequence. The caches are data (kv_cache.py); everything known about a slot is its `Slot` record,
kept by the `SlotManager` of those caches (as nano-vllm's BlockManager keeps its blocks): how far
it is filled, which prefix its first entries hold (its claim, and the copy they belong to), the
draft head's state at that prefix's end. The manager also keeps the prefix store
(prefix_store.py), so a prompt's beginning is found in one place: in a slot that holds it, or in
the store. The layout and the decoders are functions of it and keep nothing per slot;
what a running sequence is between its steps is its own record (sequence.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specsot_mq.errors import SpecSotError
from specsot_mq.kv_cache import KVCache
from specsot_mq.prefix_store import Entry, PrefixStore


class KVCacheOverflow(SpecSotError):
    """A write would go past the cache capacity."""


@dataclass(slots=True)
class Slot:
    """What one slot holds."""

    length: int = 0  # base cache entries its sequence sees (the position of its next token)
    draft_length: int = 0  # entries in its draft cache slot
    prefix: tuple[int, ...] = ()  # its claim: the prompt beginning its first entries hold (base and draft)
    copy: int = -1  # slots of one copy hold that prefix bit for bit (a forward reads it from one of them)
    feature: torch.Tensor | None = None  # EAGLE: the base feature at the prefix's last position


class SlotManager:
    """The slots of one base cache (and its draft cache), and the prefix store."""

    def __init__(self, cache: KVCache, draft: KVCache | None = None, store: PrefixStore | None = None):
        self.cache, self.draft = cache, draft
        self.draft_head = None  # the head `draft` was made for (draft_cache_for)
        self.store = store if store is not None else PrefixStore()
        self.slots = [Slot() for _ in range(cache.num_slots)]
        self._ids = itertools.count()  # copy names, never reused

    def __getitem__(self, slot: int) -> Slot:
        return self.slots[slot]

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def new_id(self) -> int:
        return next(self._ids)

    def draft_cache_for(self, head, room: int) -> KVCache:
        """The draft cache, made for `head` (with `room` entries past the base capacity for the
        trees) unless the one there already is."""
        if self.draft is None or self.draft_head is not head or self.draft.capacity < self.capacity + room:
            # its steps captured where the base's are (cuda_graphs.py)
            graphs = getattr(self.cache, "graphs", None) is not None
            self.draft, self.draft_head = head.new_cache(self.num_slots, self.capacity + room, graphs), head
            self.forget_claims()  # their draft entries are gone
            for slot in self.slots:
                slot.draft_length = 0
        return self.draft

    def check(self, slot: int, held: int, more: int) -> None:
        """Raise KVCacheOverflow where `more` entries after the `held` ones do not fit in a slot."""
        if held + more > self.capacity:
            raise KVCacheOverflow(
                f"KV cache slot {slot} holds {held} of {self.capacity} positions and {more} more do not fit: "
                "shorten the prompt or max tokens, or raise the cache length (--max-len)"
            )

    def claim(self, slots: Sequence[int], prefix: tuple[int, ...], copy: int) -> None:
        """These slots' first entries now hold `prefix`, all of one copy."""
        for s in slots:
            self.slots[s].prefix, self.slots[s].copy = prefix, copy

    def forget_claims(self) -> None:
        """No slot holds a prefix worth finding (their draft entries are gone), and no entry is in
        use (no sequence runs: between two runs of the loop, or after a failed one)."""
        for slot in self.slots:
            slot.prefix, slot.copy, slot.feature = (), -1, None
        self.cache.forget()

    def prefix_sources(self, slots: Sequence[int]) -> tuple[list[int], list[int]] | None:
        """For a forward over `slots`: where each row may read its shared prefix from (the first
        row's slot of the same copy) and its length, 0 where a row reads only its own slot; None
        where no row shares one. Those slots all run in this forward, so none of their prefixes is
        being overwritten."""
        first: dict[int, int] = {}
        sources, lengths, any_shared = [], [], False
        for s in slots:
            copy = self.slots[s].copy
            src = s if copy < 0 else first.setdefault(copy, s)
            sources.append(src)
            lengths.append(0 if src == s else len(self.slots[s].prefix))
            any_shared |= src != s
        return (sources, lengths) if any_shared else None

    def find(self, ids: list[int], slots: Sequence[int], exact: bool, with_draft: bool) -> int | Entry | None:
        """Where the longest computed beginning of `ids` is: one of `slots` whose claim it is, else a
        prefix store entry (`with_draft`: a slot or entry with the draft head's state), else None.
        `exact`: the slot's claim must be all of `ids` (a store entry may still be shorter)."""
        best, key = None, tuple(ids)
        for s in slots:
            held = self.slots[s].prefix
            if with_draft and self.slots[s].feature is None:  # a plain decoder's: no draft state
                continue
            if held and (held == key if exact else held == key[: len(held)]):
                if best is None or len(held) > len(self.slots[best].prefix):
                    best = s
        if best is not None and (exact or len(self.slots[best].prefix) == len(ids)):
            return best
        entry = self.store.longest(ids, whole=True) if self.store else None
        if entry is None or (with_draft and entry.state.draft_kv is None):
            return best
        return entry if best is None or len(entry.ids) > len(self.slots[best].prefix) else best
