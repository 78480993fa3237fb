"""EAGLE speculative decoding as a Decoder for the one generation loop.

One step for all running sequences: draft() grows an EAGLE-2 tree per sequence with the draft
head (tree.py), verify() runs ONE base forward over every tree ([B, N+1], each row its own slot and
length), accept (verify.py) walks each tree, and the caches are compacted in place: the base cache
keeps the root and the accepted entries (the layout's commit, see layout.py), the tree's draft entries are left to be overwritten, and
the draft reads the accepted tokens (draft_extend), whose last output seeds the next tree.

Conventions (shared with train_draft.py): base features F_i are the concatenated hidden states
`head.cfg.feature_layers` at position i. Draft position i reads (token x_{i+1}, feature F_i) at rope
position i and predicts F_{i+1} and the draft logits of x_{i+2}. A tree node at depth d (base
position n + d) thus has its draft entry at position n + d - 1, fed with its parent's predicted
feature. Between steps both caches hold x_0..x_{n-1} (length n) and the root x_n is not yet in
either.

Usage, with `gen` a Generator and `head` a DraftHead attached to gen.model:

    decoder = EagleDecoder(gen.model, head, gen.slots, Sampler(params), TreeParams())
    for seq, delta in gen.stream_many(prompts, params, decoder=decoder): ...
    decoder.stats.tau  # mean tokens per verify step
"""

from __future__ import annotations

import time

import torch
from torch.nn.utils.rnn import pad_sequence

from specsot_mq.decode_params import TreeParams
from specsot_mq.decoder import Decoder
from specsot_mq.draft import DraftHead
from specsot_mq.layout import Prefilled
from specsot_mq.lookup import History, ListTokens, NgramIndex
from specsot_mq.model import LlamaModel, Step
from specsot_mq.prefix_store import Entry, Kept
from specsot_mq.sampling import Sampler, greedy_tokens
from specsot_mq.sequence import Sequence
from specsot_mq.slots import SlotManager
from specsot_mq.tree import (DraftTree, TreeSearch, chain, graft, grow_search, make_tree, one_level, root_only,
                             select_nodes, start_search)
from specsot_mq.verify import Acceptance, SpecStats, accept_greedy, accept_sampled


class SpeedChooser:
    """How each step speculates: with the draft head's tree ("eagle"), with prompt lookup alone
    ("lookup") or not at all ("plain"), whichever has decided tokens fastest lately at the step's
    batch size (how many sequences decode together).

    On a CPU whose one-token step is cheap, a draft forward and each extra verify row must pay
    for themselves, and whether they do depends on the CPU, the batch and the text. So each way is
    timed while decoding goes on (seconds per decided token of the step's slowest sequence, over
    its recent steps at that batch size, older ones weighing less), and the fastest runs. Each
    other way is tried again (`probe` steps) `probe_every` steps later, then twice as long after
    each try that leaves it behind (up to `max_gap` steps), so that a change (a longer context,
    text that repeats itself) is seen while a way that keeps losing costs less and less. A
    Generator keeps one chooser for all its decoders, so what one answer or phase measured serves
    the next. In greedy decoding every way emits the same tokens (each is lossless), so the choice
    changes speed only.

    One sequence alone never takes the plain way where prompt lookup is a way (`ways_at`): a
    lookup step that finds no guess is a plain step, and one that guesses adds a row or two to a
    step that reads every weight anyway, so it costs little more and often decides two or three
    tokens. Timed against each other, the two ways' few-step averages come from different stretches
    of text and of a shared machine's speed, and the chooser often kept the slower for hundreds of
    steps (benchmarks/HISTORY.md)."""

    probe = 4  # steps a way runs when it is tried
    probe_every = 64  # steps at a batch size before a way that is not the fastest is tried again...
    max_gap = 512  # ...doubling after each try, up to this
    # Weight of the past at each of a way's steps: about 40 steps count, because a step's yield
    # varies (a lookup step decides 1 to 3 tokens) and a short window lets a good way lose a probe
    # by chance, after which it waits hundreds of steps for another try.
    decay = 0.95
    # The head's tree is retired (drafting_pays) once it has run this many steps and decides tokens
    # no faster than the fastest other way, over the batch sizes where both are timed, each size
    # weighted by the steps decoded at it.
    retire_after = 16

    def __init__(self, ways: list[str]):
        self.ways = ways
        self.by_size: dict[int, dict] = {}  # batch size -> what it measured and when it tries each way
        self.counts = dict.fromkeys(ways, 0)  # steps each way ran (benchmarks/peer.py shows them)

    def ways_at(self, size: int) -> list[str]:
        """The ways a step of `size` sequences may take: all but plain at one sequence where
        lookup is one of them (see the class's note)."""
        return [w for w in self.ways if not (size == 1 and w == "plain" and "lookup" in self.ways)]

    def _at(self, size: int) -> dict:
        if size not in self.by_size:
            ways = self.ways_at(size)
            self.by_size[size] = {
                "seconds": dict.fromkeys(self.ways, 0.0), "tokens": dict.fromkeys(self.ways, 0.0), "steps": 0,
                "queue": [w for w in ways for _ in range(self.probe)],  # every way is tried first
                "due": dict.fromkeys(self.ways, self.probe_every), "gap": dict.fromkeys(self.ways, self.probe_every),
            }  # fmt: skip
        return self.by_size[size]

    def pick(self, size: int = 1) -> str:
        at = self._at(size)
        if at["queue"]:
            return at["queue"].pop(0)
        best = self.best(size)
        at["gap"][best] = self.probe_every  # once it falls behind, it is tried again soon
        for way in self.ways_at(size):
            if way != best and at["steps"] >= at["due"][way]:
                at["queue"] += [way] * self.probe
                at["due"][way] = at["steps"] + at["gap"][way]
                at["gap"][way] = min(2 * at["gap"][way], self.max_gap)
        return at["queue"].pop(0) if at["queue"] else best

    def best(self, size: int = 1) -> str:
        rates = self.seconds_per_token(size)
        return min(self.ways_at(size), key=lambda w: rates[w] if rates[w] is not None else 0.0)  # an untried way first

    def seconds_per_token(self, size: int = 1) -> dict[str, float | None]:
        """Each way's recent seconds per decided token at a batch size (None: not tried yet)."""
        at = self._at(size)
        return {w: at["seconds"][w] / at["tokens"][w] if at["tokens"][w] else None for w in self.ways}

    def drafting_pays(self) -> bool:
        """Whether the draft head still earns its upkeep (its pass over every prompt, reading each
        decided token, the tree's probes): False once its tree ran `retire_after` steps and decided
        tokens no faster than the fastest other way, over the batch sizes where
        both are timed, each weighted by the steps decoded at it. The other ways' steps carry the
        upkeep too (a decoder with the head runs them), so a tree no faster than they are cannot
        pay for it. A generator then decodes greedily without the head (Generator.new_decoder).

        Weighted, not size by size: a branch stage decodes points at every batch size, and at one
        or two of them the tree's few probes often ran as fast as lookup by chance, which kept a
        head that was slower at the sizes most steps ran at (benchmarks/HISTORY.md)."""
        if "eagle" not in self.ways or len(self.ways) == 1 or self.counts["eagle"] < self.retire_after:
            return True
        eagle = fastest = 0.0  # seconds per token, each size weighted by its steps
        for size, at in self.by_size.items():
            rates = self.seconds_per_token(size)
            others = [rates[w] for w in self.ways_at(size) if w != "eagle" and rates[w] is not None]
            if rates["eagle"] is not None and others:
                eagle += at["steps"] * rates["eagle"]
                fastest += at["steps"] * min(others)
        return fastest == 0 or eagle < fastest

    def record(self, way: str, seconds: float, tokens: int, size: int = 1) -> None:
        at = self._at(size)
        at["seconds"][way] = self.decay * at["seconds"][way] + seconds
        at["tokens"][way] = self.decay * at["tokens"][way] + tokens
        at["steps"] += 1
        self.counts[way] += 1

    @staticmethod
    def for_tree(tree: "TreeParams", greedy: bool) -> "SpeedChooser":
        """The ways a decoder with these trees can take: all three with prompt lookup, else the tree
        or nothing; only the tree where the tree is fixed (not adaptive) or decoding samples (a
        sampled answer depends on the way its random draws were used, and a seed must give one
        answer)."""
        if not (tree.adaptive and greedy):
            return SpeedChooser(["eagle"])
        return SpeedChooser(["eagle", "lookup", "plain"] if tree.lookup else ["eagle", "plain"])


class EagleDecoder(Decoder):
    """Speculative decoding with an EAGLE head; sequence i uses slot i of the draft cache and of
    the base cache. `lists`: how the tokenizer opens a numbered list's
    items, for prompt lookup's guess where a list's line ends; `history`: the generator's recent
    outputs, for its guess where a sequence's own tokens hold no match (lookup.py)."""

    unread_limit = 64  # steps a decision may wait for the draft (bounds the features kept for it)
    drafts = True

    def __init__(
        self,
        model: LlamaModel,
        head: DraftHead,
        slots: SlotManager,
        sampler: Sampler,
        tree: TreeParams | None = None,
        chooser: SpeedChooser | None = None,
        lists: ListTokens | None = None,
        history: History | None = None,
    ):
        super().__init__(model, slots, sampler, lists, history)
        self.head = head
        self.tree = tree or TreeParams()
        # Tree entries and padded extends go past the base length: the draft cache has room for one full tree more.
        slots.draft_cache_for(head, (self.tree.depth + 1) * (self.tree.topk + 1))
        self.stats = SpecStats(accepted_at_depth=[0] * self.tree.depth)
        # how each step speculates (a Generator passes the one it keeps for all its decoders)
        self.chooser = chooser or SpeedChooser.for_tree(self.tree, sampler.params.greedy)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.head.cfg.feature_layers)

    # -- the decoder's calls -------------------------------------------------------------------

    def prefill(self, seqs: list[Sequence], shared: int, source: int | Entry | None) -> None:
        """Base pass over the prompts (shared prefix once, see layout.py), then the draft's:
        draft position i reads (x_{i+1}, F_i), so the shared part of the draft cache is positions
        0..shared-2 and each prompt's own part starts at shared-1, with the prefix's last feature."""
        dev, mgr, draft = self.model.device, self.slots, self.slots.draft
        slots = [seq.slot for seq in seqs]
        prompts = {seq.slot: seq.job.ids for seq in seqs}
        pre = self.layout.prefill(prompts, shared, source, self.layers, seqs[0].job.resume)
        roots = self.sampler(pre.last_logits).tolist()
        start = time.perf_counter()
        first = slots[0]
        home = source if isinstance(source, int) else first  # the slot whose draft entries hold the prefix
        d0 = max(shared - 1, 0)  # first draft position that differs between the prompts
        if isinstance(source, Entry):  # the draft's part of a stored prefix
            mgr[first].draft_length, mgr[first].feature = draft.restore(first, source.state.draft_kv), source.state.feature
        if pre.prefix_features is not None:  # the base computed the prefix from pre.have on: so does the draft
            lo = max(pre.have - 1, 0)
            if d0 > lo:
                feats = pre.prefix_features[: d0 - pre.have]
                if pre.have:
                    feats = torch.cat([mgr[first].feature[None], feats])
                step = Step([first], [lo], torch.arange(lo, d0, device=dev)[None], logit_rows=[d0 - lo - 1])
                self.head(torch.tensor([prompts[first][lo + 1 : shared]], device=dev), feats[None], draft, step)
            mgr[first].feature = pre.prefix_features[-1]
        feature = mgr[home].feature if shared else None
        if shared:
            draft.copy(home, slots, d0)
        # Each prompt's own draft entries: tokens x_{d0+1}..x_n (x_n = its root), features F_{d0}..F_{n-1}.
        tokens = [prompts[slot][d0 + 1 :] + [root] for slot, root in zip(slots, roots)]
        t = max(map(len, tokens))
        feats = torch.cat([feature.expand(len(tokens), 1, -1), pre.features], 1) if shared else pre.features
        feats = torch.nn.functional.pad(feats, (0, 0, 0, max(0, t - feats.shape[1])))[:, :t]
        ids = torch.tensor([x + [0] * (t - len(x)) for x in tokens], device=dev)
        positions = torch.arange(d0, d0 + t, device=dev).expand(len(tokens), t)
        last = [i * t + len(x) - 1 for i, x in enumerate(tokens)]  # only the newest position seeds a tree
        hidden, logits = self.head(ids, feats, draft, Step(slots, [d0] * len(slots), positions, logit_rows=last))
        lookup = self.tree.lookup and self.sampler.params.greedy
        for row, (seq, root, x) in enumerate(zip(seqs, roots, tokens)):
            mgr[seq.slot].draft_length, mgr[seq.slot].feature = d0 + len(x), feature
            seq.last, seq.logits, seq.feature = root, logits[row], hidden[row, len(x) - 1]
            if lookup:
                seq.index = NgramIndex(seq.job.ids + [root], lists=self.lists, history=self.history)
            if seq.job.keep:
                self._store(seq, _feature_at(seq.job.keep - 1, pre, row, shared, feature))
        self.stats.draft_seconds += time.perf_counter() - start

    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        slots = [seq.slot for seq in seqs]
        start = time.perf_counter()
        way = self.chooser.pick(len(seqs))
        budget = self.budget(slots) if way == "eagle" else 0
        timed_from = start
        if budget or any(len(seq.unread) >= self.unread_limit for seq in seqs):
            self.draft_extend(seqs)
            if not budget:  # the head catching up, whatever the way: not this step's cost
                timed_from = time.perf_counter()
        trees = self.draft(seqs, budget)
        drafted = [t.size for t in trees]  # nodes beyond these come from prompt lookup alone
        if seqs[0].index is not None and way != "plain":
            trees = self.graft_lookup(seqs, trees)
        mid = time.perf_counter()
        logits, features = self.verify(slots, trees)
        results = self.accept(trees, logits)
        # the root and the accepted path
        self.layout.commit(slots, [t.size for t in trees], [[0] + res.nodes for res in results])
        end = time.perf_counter()
        # What the step decided goes to the draft before its next tree (draft_extend), not now:
        # while the batch is too large to draft for, the head is never run.
        for i, (seq, res) in enumerate(zip(seqs, results)):
            kept = [0] + res.nodes  # a path down a chain is a slice (a view, no copy)
            seq.unread.append((res.tokens, features[i, : len(kept)] if kept[-1] == len(res.nodes) else features[i, kept]))
            seq.last = res.tokens[-1]
            if seq.index is not None:
                seq.index.extend(res.tokens)
        self.stats.draft_seconds += mid - start
        self.stats.verify_seconds += end - mid
        self.stats.count(trees, results, drafted)
        # Progress counts as the slowest sequence's: sequences decoded together (a request's points)
        # are done when the longest is, and tokens that speculation adds to the others only cost rows.
        self.chooser.record(way, end - timed_from, min(len(res.tokens) for res in results), len(seqs))
        return [res.tokens for res in results]

    def kept(self, slot: int, n: int, feature: torch.Tensor | None = None) -> Kept | None:
        """The base KV of n tokens, the draft's of n - 1 (see prefill) and the feature at n - 1
        (None when the feature is not known)."""
        if feature is None:
            return None
        return Kept(self.slots.cache.snapshot(slot, n), self.slots.draft.snapshot(slot, n - 1), feature.clone())

    # -- the three phases of a step ------------------------------------------------------------

    def budget(self, seqs: list[int]) -> int:
        """Nodes each sequence's tree gets this step. Many sequences at once: each tree gets its
        share of the verify budget (never less than one full tree), down to none (a plain step,
        where batching alone keeps the device busy). Every row's tree must fit in the base cache:
        near its end, trees get smaller."""
        tp = self.tree
        verify_budget = max(tp.max_batch_tokens, tp.num_draft_tokens + 1)
        return max(0, min(tp.num_draft_tokens, verify_budget // len(seqs) - 1, self.layout.room(seqs) - 1))

    def draft(self, seqs: list[Sequence], budget: int) -> list[DraftTree]:
        """Grow one EAGLE-2 tree of `budget` nodes per sequence (the draft must have read every
        decided token: draft_extend); the tree's draft entries go past each slot's, which stay."""
        tp, head, mgr = self.tree, self.head, self.slots
        dev = self.model.device
        slots = [seq.slot for seq in seqs]
        lengths = [self.layout.length(s) for s in slots]
        if not budget:
            return [root_only(seq.last, n) for seq, n in zip(seqs, lengths)]
        gen = None if self.sampler.params.greedy else self.sampler.generator
        logq, q = self._draft_dist(torch.stack([seq.logits for seq in seqs]))
        if gen is None and min(tp.depth, budget) == 1:  # greedy, one level: the root's best guesses
            best, ids = logq.topk(min(tp.topk, budget, logq.shape[-1]), dim=-1)
            ids, ok = head.d2t[ids].tolist(), torch.isfinite(best).tolist()
            return [one_level(seq.last, n, [t for t, fine in zip(ids[i], ok[i]) if fine], dev)
                    for i, (seq, n) in enumerate(zip(seqs, lengths))]  # fmt: skip
        if gen is None and tp.topk == 1:  # greedy chain: each level the head's best guess
            return self._draft_chain(seqs, min(tp.depth, budget), logq, lengths)
        search = start_search(logq, tp.topk, gen)
        qs = [None if q is None else q[:, None]]  # draft distributions of the expanded nodes...
        expanded = [torch.full((len(seqs), 1), -1, device=dev)]  # ...and their search nodes (-1 = root)
        parent_feature = torch.stack([seq.feature for seq in seqs])[:, None].expand(-1, search.beam.shape[1], -1)
        written = 0  # tree entries in the draft cache so far, after each slot's own
        for depth in range(1, min(tp.depth, budget)):
            beam = search.beam
            expanded.append(beam)
            tokens = head.d2t[search.ids.gather(1, beam)]
            positions = torch.tensor(lengths, device=dev)[:, None].expand_as(beam) + depth - 1
            mask = self._draft_mask(search, torch.cat(expanded[1:], 1), lengths)
            step = Step(slots, [mgr[s].draft_length + written for s in slots], positions, mask)
            hidden, logits = head(tokens, parent_feature, mgr.draft, step)
            written += beam.shape[1]
            logq, q = self._draft_dist(logits)
            qs.append(q)
            search = grow_search(search, logq, tp.topk, gen)
            # The new beam's parents sit in the old beam; their predicted features feed the next level.
            from_slot = (search.parents.gather(1, search.beam)[:, :, None] == beam[:, None, :]).int().argmax(-1)
            parent_feature = hidden.gather(1, from_slot[:, :, None].expand(-1, -1, hidden.shape[-1]))
        kept = select_nodes(search, budget)
        if gen is not None:
            qs = self._tree_q(search, torch.cat(expanded, 1), torch.cat(qs, 1), kept)
        return [
            make_tree(search, i, kept[i], seq.last, n, head.d2t, None if gen is None else qs[i])
            for i, (seq, n) in enumerate(zip(seqs, lengths))
        ]

    def _draft_chain(self, seqs: list[Sequence], depth: int, logq: torch.Tensor, lengths: list[int]) -> list[DraftTree]:
        """draft()'s greedy chain of `depth` levels: each level one token, seeing its sequence's
        entries and the levels before it, which is causal from each slot's draft entries (no mask:
        a captured step on a GPU, no bias on the CPU's native kernels)."""
        head, mgr, dev = self.head, self.slots, self.model.device
        slots = [seq.slot for seq in seqs]
        guess = logq.argmax(-1)  # [B] draft ids: the search's one child a level (topk 1)
        chosen = [guess]
        feature = torch.stack([seq.feature for seq in seqs])[:, None]
        roots = torch.tensor(lengths, device=dev)[:, None]
        for level in range(1, depth):
            step = Step(slots, [mgr[s].draft_length + level - 1 for s in slots], roots + level - 1)
            feature, logits = head(head.d2t[chosen[-1]][:, None], feature, mgr.draft, step)
            chosen.append(logits[:, 0].argmax(-1))
        ids = head.d2t[torch.stack(chosen, 1)].tolist()
        return [chain(seq.last, n, ids[i]) for i, (seq, n) in enumerate(zip(seqs, lengths))]

    def graft_lookup(self, seqs: list[Sequence], trees: list[DraftTree]) -> list[DraftTree]:
        """Each tree with its sequence's prompt-lookup guess grafted on (tree.graft): up to
        tree.lookup tokens alone, fewer as more sequences share the forward (max_batch_tokens
        split between them, as for the draft nodes; see benchmarks/HISTORY.md), and as long as
        the base cache has room."""
        room = self.layout.room([seq.slot for seq in seqs])
        cap = min(self.tree.lookup, max(self.tree.max_batch_tokens, self.tree.lookup) // len(seqs))
        return [graft(t, seq.index.propose(min(cap, room - t.size))) for seq, t in zip(seqs, trees)]

    def verify(self, seqs: list[int], trees: list[DraftTree]) -> tuple[torch.Tensor, torch.Tensor]:
        """One base forward over every tree; returns (logits [B, T, V], features [B, T, F*H]),
        rows right-padded to the largest tree."""
        masks = None if all(t.mask is None for t in trees) else [t.attention_mask() for t in trees]  # None: causal
        return self.layout.forward(seqs, [t.tokens for t in trees], [t.positions for t in trees], masks, self.layers)

    def accept(self, trees: list[DraftTree], logits: torch.Tensor) -> list[Acceptance]:
        """Walk each tree given the base logits [B, T, V] at its nodes (rows padded)."""
        if self.sampler.params.greedy:
            best = greedy_tokens(logits).tolist()  # every row's argmax in one call
            return [accept_greedy(tree, best[i][: tree.size]) for i, tree in enumerate(trees)]
        return [accept_sampled(tree, logits[i, : tree.size], self.sampler.probs, self.head.d2t, self.sampler.generator)
                for i, tree in enumerate(trees)]  # fmt: skip

    def draft_extend(self, seqs: list[Sequence]) -> None:
        """Feed the draft what the last steps decided (unread), each row in one forward: the
        accepted tokens and bonus tokens at the positions after its real length, with the base
        features of the root and accepted nodes they follow; the last output seeds the next tree.
        Rows are padded to the longest: a row that padding would take past the draft cache's end
        (its slot nearly full, another row with many more tokens) goes in a forward of its own."""
        rows = [seq for seq in seqs if seq.unread]
        mgr = self.slots
        while rows:
            unread = [sum(len(tokens) for tokens, _ in seq.unread) for seq in rows]
            t = max(unread)
            fit = [seq for seq, k in zip(rows, unread) if mgr[seq.slot].draft_length + t <= mgr.draft.capacity or k == t]
            self._extend(fit)
            rows = [seq for seq in rows if seq.unread]

    def _extend(self, rows: list[Sequence]) -> None:
        """draft_extend's one forward over `rows` (right-padded)."""
        dev, mgr = self.model.device, self.slots
        chunks = [seq.unread for seq in rows]
        for seq in rows:
            seq.unread = []
        ids = [torch.tensor([x for tokens, _ in chunk for x in tokens], device=dev) for chunk in chunks]
        lens = [len(x) for x in ids]
        slots = [seq.slot for seq in rows]
        starts = [mgr[s].draft_length for s in slots]
        t = max(lens)
        # Rows right-padded: padding goes last, where causal rows never see it (and repeats the
        # last position).
        tokens = pad_sequence(ids, batch_first=True)
        feats = pad_sequence([torch.cat([f for _, f in chunk]) for chunk in chunks], batch_first=True)
        positions = torch.stack([torch.arange(n, n + t, device=dev).clamp(max=n + k - 1)
                                 for n, k in zip(starts, lens)])  # fmt: skip
        last = [i * t + k - 1 for i, k in enumerate(lens)]  # only the newest position seeds a tree
        hidden, logits = self.head(tokens, feats, mgr.draft, Step(slots, starts, positions, logit_rows=last))
        for i, (seq, k, n) in enumerate(zip(rows, lens, starts)):
            mgr[seq.slot].draft_length = n + k
            seq.logits, seq.feature = logits[i], hidden[i, k - 1]

    # -- helpers -------------------------------------------------------------------------------

    def _draft_dist(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log q, q) of draft logits: raw softmax for greedy (EAGLE-2's scores), the request's
        processed distribution (temperature, top-k, top-p) when sampling, since the children are
        drawn from it and rejection sampling compares against it."""
        if self.sampler.params.greedy:
            return torch.log_softmax(logits.float(), dim=-1), None
        q = self.sampler.probs(logits)
        return torch.log(q), q

    def _draft_mask(self, search: TreeSearch, entries: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """[B, K, max(n) + E] mask for the beam's draft forward: each row sees its sequence's real
        draft entries and the tree entries (entries [B, E]: the search node of each, in cache order)
        of its ancestors and itself."""
        b, e = entries.shape
        beam = search.beam
        width = beam.shape[1]
        # ancestor-or-self of each beam node among the entries: walk up the parents depth times.
        node = beam.clone()
        hit = torch.zeros(b, width, e, dtype=torch.bool, device=beam.device)
        while bool((node >= 0).any()):
            hit |= (entries[:, None, :] == node[:, :, None]) & (node[:, :, None] >= 0)
            node = torch.where(node >= 0, search.parents.gather(1, node.clamp(min=0)), node)
        kv = max(lengths) + e
        mask = torch.zeros(b, width, kv, dtype=torch.bool, device=beam.device)
        for i, n in enumerate(lengths):
            mask[i, :, :n] = True
            mask[i, :, n : n + e] = hit[i]
        return mask

    @staticmethod
    def _tree_q(
        search: TreeSearch, expanded: torch.Tensor, qs: torch.Tensor, kept: list[list[int]]
    ) -> list[torch.Tensor]:
        """DraftTree.q of each sequence: qs [B, E, Vd] are the draft distributions of the expanded
        search nodes `expanded` [B, E] (-1 = the root); rows of leaves are the root's (unused)."""
        b, e = expanded.shape
        row_of = torch.zeros(b, search.ids.shape[1] + 1, dtype=torch.long, device=qs.device)  # by search node + 1
        row_of.scatter_(1, expanded + 1, torch.arange(e, device=qs.device).expand(b, e))
        return [qs[i, row_of[i, [0] + [k + 1 for k in kept[i]]]] for i in range(b)]


def _feature_at(position: int, pre: Prefilled, row: int, shared: int, prefix_feature: torch.Tensor | None):
    """The base feature at a position of row `row`'s prompt, where its prefill knows it: computed
    there (its own part, or the part of the shared prefix computed), or the prefix's last."""
    if position >= shared:
        return pre.features[row, position - shared]
    if pre.prefix_features is not None and position >= pre.have:
        return pre.prefix_features[position - pre.have]
    return prefix_feature if position == shared - 1 else None
