"""The one generation loop.

`Generator.stream_many()` is the loop: a decoder proposes tokens for every running sequence (one
per step for plain decoding, several for speculative decoding, all sequences in one batched
forward), the loop checks EOS, stop strings and max tokens token by token, detokenises
incrementally and yields text deltas per sequence. `stream()`, `generate()` (callback),
`generate_many()` and `astream()` (async generator) are thin wrappers over it, so every mode runs
the same code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specsot_mq.errors import SpecSotError
from specsot_mq.kv_cache import KVCache
from specsot_mq.layout import new_layout
from specsot_mq.lookup import History, ListTokens, NgramIndex
from specsot_mq.model import LlamaModel
from specsot_mq.openmp import release_pool
from specsot_mq.prefix_store import Kept, PrefixStore
from specsot_mq.sampling import Sampler, SamplingParams, greedy_tokens
from specsot_mq.stopping import LineWatch, LoopWatch, StopStrings
from specsot_mq.tokenizer import Detokenizer, chat_prompt_ids
from specsot_mq.tree import graft, root_only
from specsot_mq.verify import SpecStats, accept_greedy


@dataclass(slots=True)
class Delta:
    """One streamed piece of output."""

    text: str  # new text (may be empty while a character or a possible stop string is incomplete)
    token_ids: list[int]  # tokens accepted in this step
    finish_reason: str | None = None  # None while running; then "stop" (EOS or stop string), "length" or
    # "repeat" (the output began to loop, see SamplingParams.repeat_stop and stop_repeated_line)
    stop: str | None = None  # the stop string that ended it (not in `text`), as vLLM's stop_reason


@dataclass(slots=True)
class Completion:
    """A finished generation."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    seconds: float  # wall time from the call to the last token
    prefill_seconds: float
    steps: int  # decoder steps after prefill (= tokens - 1 for plain decoding)
    tau: float | None = None  # speculative decoding: mean tokens per verify step over the call

    @property
    def tokens_per_second(self) -> float:
        decode = self.seconds - self.prefill_seconds
        return (len(self.token_ids) - 1) / decode if decode > 0 and len(self.token_ids) > 1 else 0.0


@dataclass(slots=True)
class SeqState:
    """What a decoder knows of one running sequence between its steps; the loop keeps it in the
    sequence's record (_Sequence) and hands it back to every step."""

    last: int  # its newest token, fed to its next step (the root of its next draft tree)
    index: NgramIndex | None = None  # its tokens so far, for prompt lookup
    logits: torch.Tensor | None = None  # EAGLE: [Vd] draft logits at the position before `last` (its children)
    feature: torch.Tensor | None = None  # EAGLE: [H] the head's predicted feature at `last`'s position
    # EAGLE: (tokens, base features) decided by steps that drafted nothing; the draft reads them
    # before it next drafts, and until then logits and feature are stale
    unread: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)


class Decoder(Protocol):
    """What the loop drives: plain decoding here, speculative decoding elsewhere.

    Sequences are named 0..max_sequences-1 (a cache slot each in the batching layout, see
    layout.py). prefill() starts sequences (also while others run) and returns their states,
    step() advances the running ones given their states, drop() ends one.
    """

    max_sequences: int  # sequences that can run at once

    def prefill(self, prompts: dict[int, list[int]], shared: int = 0, prefix_from: int | None = None) -> dict[int, SeqState]:
        """Start sequence s on prompts[s]; return each one's state, its first token as `last`.
        The first `shared` tokens of every prompt are the same: they are computed once (or, with
        prefix_from, taken from that sequence's cache, which already holds them) and shared."""
        ...

    def step(self, running: dict[int, SeqState]) -> dict[int, list[int]]:
        """One step of every running sequence (their states updated in place); each one's new tokens."""
        ...

    def drop(self, slot: int) -> None: ...

    def room(self, seqs: list[int]) -> int:
        """Cache entries each of `seqs` can still append (a step needs at least one)."""
        ...

    def keep(self, slot: int, n: int) -> Kept | None:
        """What restore() needs to start later sequences from the first n tokens of `slot`, read
        right after its prefill (the shared prefix, or any length within the prompt); None where
        the layout cannot."""
        ...

    def restore(self, slot: int, kept: Kept) -> bool:
        """Put a keep() into `slot`, for prefill(..., shared=n, prefix_from=slot); False (and
        nothing done) where the layout cannot."""
        ...


class PlainDecoder:
    """One token per sequence per forward; all running sequences share each forward.

    With `lookup` (greedy only; a model without a draft head), each sequence also feeds the
    tokens prompt lookup copies from earlier in it (lookup.py; `lists`: how the tokenizer opens a
    numbered list's items, guessed where a list's line ends; `history`: the generator's recent
    outputs, copied from where the sequence's own tokens hold no match), up to `lookup` tokens per
    forward split between the sequences, and keeps those the base model's argmax agrees with,
    plus the next one: the same tokens, in fewer forwards."""

    def __init__(self, model: LlamaModel, cache: KVCache, sampler: Sampler, layout: str = "batching", lookup: int = 0,
                 lists: ListTokens | None = None, history: History | None = None):  # fmt: skip
        self.model, self.sampler, self.lists, self.history = model, sampler, lists, history
        self.layout = new_layout(layout, model, cache)
        self.max_sequences = self.layout.max_sequences
        self.lookup = lookup if sampler.params.greedy else 0
        self.stats = SpecStats() if self.lookup else None  # what lookup drafted and got accepted (tau)

    def prefill(self, prompts: dict[int, list[int]], shared: int = 0, prefix_from: int | None = None) -> dict[int, SeqState]:
        pre = self.layout.prefill(prompts, shared, prefix_from)
        first = zip(pre.slots, self.sampler(pre.last_logits).tolist())
        return {slot: SeqState(tok, NgramIndex(prompts[slot] + [tok], lists=self.lists, history=self.history)
                               if self.lookup else None) for slot, tok in first}  # fmt: skip

    def step(self, running: dict[int, SeqState]) -> dict[int, list[int]]:
        seqs = sorted(running)  # in slot order: a run of consecutive slots is read in place (KVCache.view)
        if self.lookup:
            return self._lookup_step(seqs, running)
        ids = [[running[s].last] for s in seqs]
        logits, _ = self.layout.forward(seqs, ids, [[self.layout.length(s)] for s in seqs])
        self.layout.commit(seqs, [[0]] * len(seqs))
        for seq, tok in zip(seqs, self.sampler(logits[:, -1]).tolist()):
            running[seq].last = tok
        return {seq: [running[seq].last] for seq in seqs}

    def _lookup_step(self, seqs: list[int], running: dict[int, SeqState]) -> dict[int, list[int]]:
        """A step whose rows are chains: the step's token, then the copied ones (a draft tree of
        one path, verified and accepted as the EAGLE decoder's are)."""
        start = time.perf_counter()
        cap = min(self.lookup // len(seqs), self.layout.room(seqs) - 1)
        states = [running[s] for s in seqs]
        chains = [graft(root_only(st.last, self.layout.length(s)), st.index.propose(cap)) for s, st in zip(seqs, states)]
        logits, _ = self.layout.forward(seqs, [c.tokens for c in chains], [c.positions for c in chains])  # causal
        best = greedy_tokens(logits).tolist()  # every row's argmax in one call
        results = [accept_greedy(c, best[i][: c.size]) for i, c in enumerate(chains)]
        self.layout.commit(seqs, [[0] + res.nodes for res in results])
        for st, res in zip(states, results):
            st.index.extend(res.tokens)
            st.last = res.tokens[-1]
        self.stats.count(chains, results, [1] * len(chains))  # every node past the root is lookup's
        self.stats.verify_seconds += time.perf_counter() - start
        return {seq: res.tokens for seq, res in zip(seqs, results)}

    def drop(self, seq: int) -> None:
        self.layout.drop(seq)

    def room(self, seqs: list[int]) -> int:
        return self.layout.room(seqs)

    def keep(self, slot: int, n: int) -> Kept | None:
        kv = self.layout.snapshot(slot, n)
        return None if kv is None else Kept(kv)

    def restore(self, slot: int, kept: Kept) -> bool:
        return self.layout.restore(slot, kept.kv)  # a draft head's part, if any, is not needed here


@dataclass(slots=True)
class Job:
    """One prompt for the generation loop to decode."""

    key: object  # the caller's name for it, yielded with each of its deltas
    ids: list[int]  # the whole prompt
    params: SamplingParams  # its stop conditions (max tokens, stop strings, EOS); the decoder samples
    shared: int = 0  # its first `shared` tokens are the same in every job of its group
    group: object = None  # jobs of one group share that prefix (computed once); None: no sharing
    keep: int = 0  # its first `keep` tokens go to the prefix store after its prefill (a conversation's
    # earlier turns: the next turn's prompt begins with them)


def _by_group(jobs: list[Job]) -> list[tuple[object, list[Job]]]:
    """Jobs grouped by prefix group (ungrouped ones together, sharing nothing), in order of first
    appearance."""
    groups: dict[object, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.group, []).append(job)
    return list(groups.items())


class _Output:
    """One sequence's side of the loop: counts, EOS, detokenisation, stop strings and loops."""

    def __init__(self, tokenizer, params: SamplingParams, eos_ids: frozenset[int]):
        self.params, self.eos_ids = params, eos_ids
        self.detok = Detokenizer(tokenizer)
        self.stop = StopStrings(params.stop, params.stop_after_text)
        self.tokens: list[int] = []  # what it accepted (the generator's History gets it at the end)
        self.loop = LoopWatch(params.repeat_stop) if params.repeat_stop else None
        self.lines = LineWatch(params.stop_repeated_item) if params.stop_repeated_line else None

    def take(self, new: list[int]) -> Delta:
        """Accept proposed tokens up to the first stopping point; return the resulting delta.
        Tokens are checked one at a time, so a step that proposes several (speculative decoding)
        stops exactly where one-token-at-a-time decoding would."""
        accepted, texts, finish, hit = [], [], None, None
        for tok in new:
            accepted.append(tok)
            self.tokens.append(tok)
            eos = tok in self.eos_ids and not self.params.ignore_eos
            if eos:
                finish = "stop"
            elif self.loop is not None and self.loop.add(tok):
                finish = "repeat"
            elif len(self.tokens) >= self.params.max_tokens:
                finish = "length"
            piece = "" if eos else self.detok.add([tok])  # EOS has no text
            if not finish and self.lines is not None and self.lines.add(piece):
                finish = "repeat"
            if finish:
                piece += self.detok.flush()
            text, hit = self.stop.feed(piece, final=finish is not None)
            texts.append(text)
            if hit:
                finish = "stop"
            if finish:
                break
        return Delta("".join(texts), accepted, finish, hit)

    def end(self, reason: str) -> Delta:
        """End without another token: the text held back (an incomplete character, a possible
        stop string's beginning) is released."""
        text, hit = self.stop.feed(self.detok.flush(), final=True)
        return Delta(text, [], "stop" if hit else reason, hit)


@dataclass(slots=True)
class _Sequence:
    """One running sequence: its job, its output's state and its decoder's (the cache it lives
    in is named by its slot, the key it runs under)."""

    job: Job
    out: _Output
    state: SeqState | None = None  # from its prefill on


class _Batch:
    """The generation loop's state over one decoder: free slots, running sequences by slot, and
    which slot holds each job group's shared prefix."""

    def __init__(self, gen: Generator, decoder: Decoder, width: int):
        self.gen, self.decoder = gen, decoder
        self.free = list(range(width - 1, -1, -1))  # a stack: slot 0 first
        self.running: dict[int, _Sequence] = {}
        self.holder: dict[object, int] = {}  # group -> a slot whose cache holds that group's prefix

    def emit(self, new: dict[int, list[int]]) -> Iterator[tuple[object, Delta]]:
        """Each sequence's new tokens as its delta; a finished one gives its slot back."""
        for slot, tokens in new.items():
            seq = self.running[slot]
            delta = seq.out.take(tokens)
            if delta.finish_reason:
                self.end(slot)
            yield seq.job.key, delta

    def reap(self, cancelled: Callable[[object], bool] | None) -> Iterator[tuple[object, Delta]]:
        """End the cancelled sequences ("abort"), and those whose cache has no room for their
        next token ("length", as at their max tokens)."""
        if cancelled is not None:
            for slot in [s for s, seq in self.running.items() if cancelled(seq.job.key)]:
                yield self.running[slot].job.key, Delta("", [], "abort")
                self.end(slot)
        full = [s for s in self.running if self.decoder.room([s]) < 1]
        if self.running and not full and self.decoder.room(list(self.running)) < 1:
            full = list(self.running)  # one cache slot shared by all of them (bim) is full
        for slot in full:
            yield self.running[slot].job.key, self.running[slot].out.end("length")
            self.end(slot)

    def start(self, jobs: list[Job]) -> dict[int, list[int]]:
        """Give admitted jobs slots and prefill them, a group's prefix once (in the slot that
        still holds it if free); returns their first tokens. Keeps what their `keep` asks."""
        new = {}
        for group, members in _by_group(jobs):
            src = self.holder.get(group)
            slots = [self.free.pop(self.free.index(src))] if src in self.free else []  # its prefix is in place
            slots += [self.free.pop() for _ in members[len(slots) :]]
            # Reused slots are overwritten: they no longer hold another group's prefix.
            self.holder = {g: s for g, s in self.holder.items() if g == group or s not in slots}
            for slot, job in zip(slots, members):
                self.running[slot] = _Sequence(job, _Output(self.gen.tokenizer, job.params, self.gen.eos_ids))
            shared = members[0].shared if group is not None else 0
            for slot, state in self.gen._start(self.decoder, {slot: job.ids for slot, job in zip(slots, members)},
                                               shared, src).items():  # fmt: skip
                self.running[slot].state = state
                new[slot] = [state.last]
            for slot, job in zip(slots, members):
                if job.keep:
                    self.gen._store(self.decoder, slot, job.ids[: job.keep])
            if group is not None:
                self.holder[group] = slots[0]
        return new

    def states(self) -> dict[int, SeqState]:
        return {slot: seq.state for slot, seq in self.running.items()}

    def end(self, slot: int) -> None:
        self.gen.history.add(self.running[slot].out.tokens)  # prompt lookup's guesses for later outputs
        del self.running[slot]
        self.decoder.drop(slot)
        self.free.append(slot)


class Generator:
    """A model, its tokenizer and one KV cache allocated up front; generates one request at a time."""

    def __init__(self, model: LlamaModel, tokenizer, max_len: int = 4096, num_slots: int = 1, draft=None, tree=None,
                 prefix_cache_mb: int = 256):  # fmt: skip
        """draft: an EAGLE DraftHead attached to `model` (None: plain decoding); tree: its
        TreeParams (without a head, only tree.lookup counts: prompt lookup in the plain decoder;
        no tree, no lookup). Both caches are allocated here, once. prefix_cache_mb: the prefix
        store's budget (prefix_store.py; 0 keeps only pinned prefixes)."""
        self.model = model
        self.tokenizer = tokenizer
        self.cache = model.new_cache(num_slots, max_len)
        self.draft, self.tree, self.draft_cache, self.chooser = draft, tree, None, None
        if draft is not None:
            from specsot_mq.speculative import SpeedChooser, TreeParams

            self.tree = tree or TreeParams()
            # how greedy EAGLE steps speculate, learned across all this generator's decoders
            self.chooser = SpeedChooser.for_tree(self.tree, greedy=True)
            # Tree entries go past the sequence while drafting: room for one full tree more.
            room = (self.tree.depth + 1) * (self.tree.topk + 1)
            self.draft_cache = draft.new_cache(num_slots, max_len + room)
        self.prefixes = PrefixStore(prefix_cache_mb << 20)  # prompt beginnings computed once, see keep_prefix
        self.lists = ListTokens.of(tokenizer) if tokenizer is not None else None  # prompt lookup's list guesses
        self.history = History()  # what it wrote lately: prompt lookup's guesses where a sequence holds none
        self._model_thread: ThreadPoolExecutor | None = None  # the async APIs' steps run here (on_model_thread)
        eos = set(model.cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)

    def prompt_ids(self, prompt: str | list[dict] | list[int]) -> list[int]:
        """A question or a chat (list of messages) through the chat template; token ids as they are."""
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            return list(prompt)
        return chat_prompt_ids(self.tokenizer, prompt)

    def check_prompt(self, ids: list[int]) -> None:
        """Raise a SpecSotError naming the fix when a prompt cannot fit in a cache slot, or holds
        a token id the model does not have (a hostile message must fail its request alone)."""
        vocab = self.model.cfg.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise SpecSotError(f"the prompt holds token ids outside the model's vocabulary (0 to {vocab - 1})")
        if len(ids) > self.cache.capacity:
            raise SpecSotError(
                f"the prompt is {len(ids)} tokens and the KV cache holds {self.cache.capacity} per sequence: "
                "shorten the prompt or raise the cache length (--max-len)"
            )

    def new_decoder(self, params: SamplingParams, layout: str = "batching") -> Decoder:
        """The decoder for one call: EAGLE when the generator has a draft head, else plain; layout
        "batching" (a cache slot per sequence) or "bim" (all in one slot, see layout.py)."""
        sampler = Sampler(params, self.model.device)
        if self.draft is None:
            lookup = self.tree.lookup if self.tree else 0
            return PlainDecoder(self.model, self.cache, sampler, layout, lookup, self.lists, self.history)
        from specsot_mq.speculative import EagleDecoder

        chooser = self.chooser if params.greedy else None  # sampling: the decoder's own (the tree every step)
        return EagleDecoder(self.model, self.draft, self.cache, sampler, self.tree, self.draft_cache, layout, chooser,
                            self.lists, self.history)  # fmt: skip

    def keep_prefix(self, ids: list[int]) -> None:
        """Compute a prompt beginning once and keep it (base KV, and the draft head's KV and
        feature): a later prompt that begins with it (and shares no prefix with the prompts
        admitted with it) then starts from a copy and computes only the rest. The SoT skeleton
        prompt's instructions and worked examples are the same for every question. Call it while
        the generator is idle (it uses slot 0)."""
        ids = list(ids)
        if len(ids) < 2 or ids in self.prefixes:  # nothing worth keeping, or kept already
            return
        with torch.inference_mode():
            self.prefixes.add(ids, self._compute(ids, 0), pinned=True)

    def _by_stored(self, prompts: dict[int, list[int]]) -> list[tuple[object, list[int]]]:
        """The slots of `prompts` that begin with a stored prefix, grouped by the longest such
        prefix: [(its store entry, slots)]."""
        groups: dict[tuple, tuple[object, list[int]]] = {}
        for slot, ids in prompts.items():
            entry = self.prefixes.longest(ids)
            if entry is not None:
                groups.setdefault(tuple(entry.ids), (entry, []))[1].append(slot)
        return list(groups.values())

    def _store(self, decoder: Decoder, slot: int, ids: list[int]) -> None:
        """Keep the first tokens of a just-prefilled prompt in the prefix store."""
        if len(ids) >= 2 and ids not in self.prefixes:
            state = decoder.keep(slot, len(ids))
            if state is not None:
                self.prefixes.add(ids, state)

    def stream_many(
        self,
        prompts: list,
        params: SamplingParams | None = None,
        decoder: Decoder | None = None,
        shared: int = 0,
        max_parallel: int | None = None,
    ) -> Iterator[tuple[int, Delta]]:
        """Prompts decoded together, at most `max_parallel` (default: every cache slot) at once; a
        waiting prompt takes the slot of the first to finish. Yields (prompt index, Delta); each
        prompt's last delta has finish_reason set. `shared`: the prompts' common prefix length
        (computed once, see layout.py)."""
        params = params or SamplingParams()
        jobs = [Job(n, self.prompt_ids(p), params, shared, 0) for n, p in enumerate(prompts)]
        yield from self.run_jobs(jobs, decoder or self.new_decoder(params), max_parallel)

    def run_jobs(self, jobs: list[Job], decoder: Decoder, max_parallel: int | None = None) -> Iterator[tuple[object, Delta]]:
        """Jobs decoded together, at most `max_parallel` (default: every cache slot) at once, in
        order; a waiting job takes the slot of the first to finish. Yields (job key, Delta)."""
        if max_parallel is not None and max_parallel < 1:
            raise SpecSotError(f"max_parallel must be at least 1, got {max_parallel}")
        waiting = list(jobs)

        def admit(room: int) -> list[Job]:
            taken = waiting[:room]
            del waiting[:room]
            return taken

        yield from self.run(admit, decoder, max_parallel)

    def run(
        self,
        admit: Callable[[int], list[Job]],
        decoder: Decoder,
        max_parallel: int | None = None,
        cancelled: Callable[[object], bool] | None = None,
        before_step: Callable[[], None] | None = None,
    ) -> Iterator[tuple[object, Delta]]:
        """The generation loop. Before every step it asks `admit(room)` for at most `room` new
        jobs (room: free sequences); it ends when nothing runs and admit gives nothing. Jobs may
        come from different callers (a serving stage admits points of several requests into one
        running batch). Yields (job key, Delta); a job's last delta has finish_reason set
        ("abort" when `cancelled(key)` turned true while it ran; "length" also when its cache slot
        is full). `before_step()` runs before each model step (prefills included), on the loop's
        thread: a serving stage sets its thread count there."""
        width = min(max_parallel or decoder.max_sequences, decoder.max_sequences)
        batch = _Batch(self, decoder, width)
        new: dict[int, list[int]] = {}
        while True:
            yield from batch.emit(new)
            yield from batch.reap(cancelled)
            jobs = admit(len(batch.free)) if batch.free else []
            if not batch.running and not jobs:
                return
            for job in jobs:  # before any state changes (a serving caller checks them as it admits)
                self.check_prompt(job.ids)
            if before_step is not None:
                before_step()
            # Grad mode is per thread and a caller may run the loop's steps on another thread than
            # the one that started it, so inference mode is entered around each model call.
            with torch.inference_mode():
                new = decoder.step(batch.states()) if batch.running else {}  # the running sequences' next tokens
                new.update(batch.start(jobs))  # the admitted ones' first

    def _start(self, decoder: Decoder, prompts: dict[int, list[int]], shared: int, src: int | None) -> dict[int, SeqState]:
        """Prefill admitted prompts (their states, see Decoder.prefill): a group's shared prefix is taken
        from the slot that holds it (src), else from the prefix store (the longest stored
        beginning of it, the rest computed once), else computed once; prompts of no group that
        begin with a stored prefix start from it (one prefill per prefix runs all their own
        parts in one forward)."""
        first = next(iter(prompts))
        if shared and src is None and (entry := self.prefixes.longest(prompts[first][:shared], whole=True)):
            state = entry.state if len(entry.ids) == shared else self._compute(prompts[first][:shared], first, entry)
            if decoder.restore(first, state):
                src = first
        if shared:
            return decoder.prefill(prompts, shared, prefix_from=src)
        new = {}
        for entry, starting in self._by_stored(prompts) if self.prefixes else ():
            if decoder.restore(starting[0], entry.state):
                batch = {slot: prompts.pop(slot) for slot in starting}
                new.update(decoder.prefill(batch, len(entry.ids), prefix_from=starting[0]))
        if prompts:
            new.update(decoder.prefill(prompts))
        return new

    def _compute(self, ids: list[int], slot: int, start=None) -> Kept:
        """The keep() state of these tokens, computed in a free slot from a store entry that
        begins them (or from nothing), by a decoder of its own (the caller's sampler draws nothing)."""
        decoder = self.new_decoder(SamplingParams(max_tokens=1))
        if start is not None and not decoder.restore(slot, start.state):
            start = None
        # One token past them, as a prompt needs.
        decoder.prefill({slot: ids + ids[-1:]}, len(start.ids) if start else len(ids), prefix_from=slot if start else None)
        state = decoder.keep(slot, len(ids))
        decoder.drop(slot)
        return state

    def stream(self, prompt, params: SamplingParams | None = None, decoder: Decoder | None = None) -> Iterator[Delta]:
        """One prompt through the loop. Yields Deltas; the last one has finish_reason set."""
        for _, delta in self.stream_many([prompt], params, decoder):
            yield delta

    def generate(
        self,
        prompt,
        params: SamplingParams | None = None,
        on_delta: Callable[[Delta], None] | None = None,
        decoder: Decoder | None = None,
    ) -> Completion:
        """Run the loop to the end, calling on_delta for each piece; return the whole completion."""
        callback = None if on_delta is None else (lambda _seq, delta: on_delta(delta))
        return self.generate_many([prompt], params, callback, decoder)[0]

    def generate_many(
        self,
        prompts: list,
        params: SamplingParams | None = None,
        on_delta: Callable[[int, Delta], None] | None = None,
        decoder: Decoder | None = None,
        shared: int = 0,
        max_parallel: int | None = None,
    ) -> list[Completion]:
        """Several prompts decoded together (one batched forward per step); completions in order."""
        start = time.perf_counter()
        prompt_ids = [self.prompt_ids(p) for p in prompts]
        decoder = decoder or self.new_decoder(params or SamplingParams())
        n = len(prompts)
        texts, ids = [[] for _ in range(n)], [[] for _ in range(n)]
        steps, first, last, finish = [-1] * n, [0.0] * n, [0.0] * n, ["length"] * n
        for seq, delta in self.stream_many(prompt_ids, params, decoder, shared, max_parallel):
            last[seq] = time.perf_counter()
            first[seq] = first[seq] or last[seq]
            steps[seq] += 1
            texts[seq].append(delta.text)
            ids[seq].extend(delta.token_ids)
            finish[seq] = delta.finish_reason or finish[seq]
            if on_delta is not None:
                on_delta(seq, delta)
        stats = getattr(decoder, "stats", None)
        tau = stats.tau if stats is not None else None
        return [
            Completion("".join(texts[i]), ids[i], finish[i], len(prompt_ids[i]), last[i] - start, first[i] - start, steps[i], tau)
            for i in range(n)
        ]

    async def astream(self, prompt, params: SamplingParams | None = None, decoder: Decoder | None = None) -> AsyncIterator[Delta]:
        """The same loop as an async generator; the model steps run on the model thread
        (on_model_thread), so the event loop stays responsive."""
        async for delta in self.on_model_thread(self.stream(prompt, params, decoder)):
            yield delta

    async def on_model_thread(self, it: Iterator) -> AsyncIterator:
        """Yield the items of `it` (an iterator that runs this Generator's model), each computed on
        the Generator's one model thread. The calling thread's OpenMP pool is freed first: with
        two pools in a process every forward runs much slower (openmp.py)."""
        if self._model_thread is None:
            self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="specsot-model")
        release_pool()
        loop = asyncio.get_running_loop()
        done = object()
        while (item := await loop.run_in_executor(self._model_thread, next, it, done)) is not done:
            yield item
