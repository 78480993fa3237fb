"""The branch-index-map (BIM) layout: every branch of a question in ONE cache slot.

The shared prefix is stored once; after it, the branches' tokens are appended interleaved as they
are decoded. `owner[k]` records which branch wrote cache entry k (-1 for the prefix), and each
query's attention mask is built from it: a branch sees the prefix and its own earlier entries,
never another branch's. Positions restart after the prefix for every branch, so each branch is
computed exactly as if it were alone (the batching layout gives the same tokens; tests check it).
It saves the prefix copies of the batching layout; a finished branch's entries stay in the slot,
masked out, until the question is done.

This decoder decodes plainly (one token per branch per step); EAGLE drafting in this layout is
not built yet.
"""

from __future__ import annotations

import torch

from specsot_mq.kv_cache import KVCache
from specsot_mq.model import LlamaModel
from specsot_mq.sampling import Sampler


class BimDecoder:
    """A Decoder whose sequences (branches) share cache slot `slot`; see the module docstring."""

    def __init__(self, model: LlamaModel, cache: KVCache, sampler: Sampler, slot: int = 0, max_branches: int = 64):
        self.model, self.cache, self.sampler, self.slot = model, cache, sampler, slot
        self.max_sequences = max_branches  # the loop admits up to this many at once
        self.owner: list[int] = []  # branch of each cache entry in the slot; -1 = shared prefix
        self.pos: dict[int, int] = {}  # running branch -> position of its next token
        self.last: dict[int, int] = {}  # running branch -> the token fed to its next step
        self.shared = 0
        self.branch: dict[int, int] = {}  # the loop's key -> branch id in `owner` (keys get reused)
        self.next_branch = 0

    def prefill(self, prompts: dict[int, list[int]], shared: int = 0, prefix_from: int | None = None) -> dict[int, list[int]]:
        dev = self.model.device
        if prefix_from is None:  # a new question: the prefix goes in once
            self.cache.truncate(self.slot, 0)
            self.owner, self.shared, self.branch, self.next_branch = [], shared, {}, 0
            if shared:
                head = next(iter(prompts.values()))[:shared]
                self.model(torch.tensor([head], device=dev), torch.arange(shared, device=dev)[None], self.cache,
                           slots=[self.slot], last_only=True)  # fmt: skip
                self.owner = [-1] * shared
        branches = list(prompts)
        for b in branches:  # a fresh branch id, so a reused key never sees its predecessor's entries
            self.branch[b], self.next_branch = self.next_branch, self.next_branch + 1
        tokens = [t for b in branches for t in prompts[b][shared:]]
        owners = [self.branch[b] for b in branches for _ in prompts[b][shared:]]
        positions = [shared + j for b in branches for j in range(len(prompts[b]) - shared)]
        logits = self._forward(tokens, owners, positions)
        last = [len(prompts[b]) - 1 for b in branches for _ in prompts[b][shared:]]
        ends = torch.tensor(positions).eq(torch.tensor(last)).nonzero()[:, 0]
        first = self.sampler(logits[ends]).tolist()
        for b, tok in zip(branches, first):
            self.last[b], self.pos[b] = tok, len(prompts[b])
        return {b: [tok] for b, tok in zip(branches, first)}

    def step(self) -> dict[int, list[int]]:
        branches = list(self.last)
        logits = self._forward([self.last[b] for b in branches], [self.branch[b] for b in branches],
                               [self.pos[b] for b in branches])  # fmt: skip
        self.last = dict(zip(branches, self.sampler(logits).tolist()))
        for b in branches:
            self.pos[b] += 1
        return {b: [tok] for b, tok in self.last.items()}

    def drop(self, branch: int) -> None:
        self.last.pop(branch, None)
        self.pos.pop(branch, None)

    def _forward(self, tokens: list[int], owners: list[int], positions: list[int]) -> torch.Tensor:
        """Append tokens (each with its branch and position) to the slot; logits [T, V]."""
        dev = self.model.device
        start = len(self.owner)
        self.owner += owners
        owner = torch.tensor(self.owner, device=dev)
        query_owner = owner[start:, None]
        index = torch.arange(len(self.owner), device=dev)
        # Prefix, plus the query's own branch up to and including the query itself.
        mask = (owner[None, :] == -1) | ((owner[None, :] == query_owner) & (index[None, :] <= index[start:, None]))
        out = self.model(torch.tensor([tokens], device=dev), torch.tensor([positions], device=dev), self.cache,
                         slots=[self.slot], mask=mask[None])  # fmt: skip
        return out.logits[0]
