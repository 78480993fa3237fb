"""The prefix store: token prefixes whose computed state (base KV, and the draft head's KV and
feature) is kept, so that a later prompt that begins with one starts from a copy and computes only
the rest.

Keys are exact token lists: a prompt reuses an entry only when its first tokens are exactly that
entry's, so two conversations share state only where their tokens are the same (a system prompt,
the SoT instructions), and never see each other's turns. Entries are found by the longest match,
and evicted least recently used first once their bytes pass the budget; pinned entries (the SoT
skeleton's instructions and worked examples, the same for every question) stay.

The decoding thread uses the store; a device stage's event loop also reads it and adds to it (KV
shipping, kv_ship.py): a lock keeps the entries whole between them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Kept:
    """A prompt beginning's computed state, as a decoder's kept() gives it and a prefill from it
    restores it: the base KV of its n tokens and, with a draft head, the head's KV of n - 1
    positions and the feature at position n - 1 (what its draft reads next)."""

    kv: tuple[torch.Tensor, torch.Tensor]
    draft_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    feature: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        tensors = [*self.kv, *(self.draft_kv or ()), *([self.feature] if self.feature is not None else [])]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(slots=True)
class Entry:
    ids: list[int]
    state: Kept  # a decoder's kept() of these tokens
    size: int  # bytes
    pinned: bool


class PrefixStore:
    def __init__(self, budget_bytes: int = 256 << 20):
        self.budget = budget_bytes
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # least recently used first
        self.size = 0
        self.lookups = self.hits = self.reused_tokens = 0
        self._lock = threading.Lock()

    def __contains__(self, ids) -> bool:
        return tuple(ids) in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, ids: list[int], state: Kept, pinned: bool = False) -> None:
        """Keep `state` for these tokens, then evict unpinned entries, oldest first, down to the
        budget (an entry larger than the budget alone is not kept)."""
        key = tuple(ids)
        size = state.nbytes
        with self._lock:
            if key in self.entries or (not pinned and size > self.budget):
                return
            self.entries[key] = Entry(list(ids), state, size, pinned)
            self.size += size
            self._fit()

    def fit(self) -> None:
        """Evict unpinned entries, least recently used first, until the store is within its budget."""
        with self._lock:
            self._fit()

    def _fit(self) -> None:
        for old in [k for k, e in self.entries.items() if not e.pinned]:
            if self.size <= self.budget:
                break
            self.size -= self.entries.pop(old).size

    def longest(self, ids: list[int], whole: bool = False, count: bool = True) -> Entry | None:
        """The entry with the longest token list that begins `ids` and is shorter than it (a
        prompt computes at least its last token; `whole`: or all of it), marked as just used
        (`count`: and counted as a prompt's lookup); None when none does."""
        with self._lock:
            best = None
            for key, entry in self.entries.items():
                n = len(key)
                if (n <= len(ids) if whole else n < len(ids)) and (best is None or n > len(best.ids)) and ids[:n] == entry.ids:
                    best = entry
            if best is not None:
                self.entries.move_to_end(tuple(best.ids))
            if count:
                self.lookups += 1
                if best is not None:
                    self.hits += 1
                    self.reused_tokens += len(best.ids)
            return best

    def stats(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.size, "lookups": self.lookups, "hits": self.hits,
                "reused_tokens": self.reused_tokens}  # fmt: skip
