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
from dataclasses import dataclass

import torch

from specsot_mq.decoder import Decoder, PlainDecoder
from specsot_mq.errors import PromptTooLong, SpecSotError
from specsot_mq.kv_cache import KVCache
from specsot_mq.lookup import History, ListTokens
from specsot_mq.model import LlamaModel
from specsot_mq.openmp import release_pool
from specsot_mq.prefix_store import PrefixStore
from specsot_mq.sampling import Sampler, SamplingParams
from specsot_mq.sequence import Delta, Job, Output, Sequence
from specsot_mq.slots import SlotManager
from specsot_mq.speculative import EagleDecoder, SpeedChooser, TreeParams
from specsot_mq.tokenizer import chat_prompt_ids


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


def _by_group(jobs: list[Job]) -> list[tuple[object, list[Job]]]:
    """Jobs grouped by prefix group (ungrouped ones together, sharing nothing), in order of first
    appearance."""
    groups: dict[object, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.group, []).append(job)
    return list(groups.items())


class PrefillMeter:
    """What computing a prompt token costs on this generator: seconds per token of its recent
    prefills of at least MIN tokens (shorter ones are mostly fixed cost), the newer weighing more.
    KV shipping weighs recomputing a prompt beginning by it (kv_ship.ShipRule)."""

    MIN = 32

    def __init__(self):
        self.seconds_per_token: float | None = None  # None until a prefill of MIN tokens is timed

    def add(self, tokens: int, seconds: float) -> None:
        if tokens >= self.MIN:
            rate, old = seconds / tokens, self.seconds_per_token
            self.seconds_per_token = rate if old is None else 0.7 * old + 0.3 * rate


class _Batch:
    """The generation loop's state over one decoder: the free slots and the running sequences."""

    def __init__(self, decoder: Decoder, width: int, tokenizer, eos_ids: frozenset[int], history: History,
                 meter: PrefillMeter):  # fmt: skip
        self.decoder, self.tokenizer, self.eos_ids, self.history, self.meter = decoder, tokenizer, eos_ids, history, meter
        self.free = list(range(width - 1, -1, -1))  # a stack: slot 0 first
        self.running: dict[int, Sequence] = {}  # by slot

    def emit(self, new: list[tuple[Sequence, list[int]]]) -> Iterator[tuple[object, Delta]]:
        """Each sequence's new tokens as its delta; a finished one gives its slot back."""
        for seq, tokens in new:
            delta = seq.out.take(tokens)
            if delta.finish_reason:
                self.end(seq)
            yield seq.job.key, delta

    def reap(self, cancelled: Callable[[object], bool] | None) -> Iterator[tuple[object, Delta]]:
        """End the cancelled sequences ("abort"), and those whose cache has no room for their
        next token ("length", as at their max tokens)."""
        if cancelled is not None:
            for seq in [seq for seq in self.running.values() if cancelled(seq.job.key)]:
                yield seq.job.key, Delta("", [], "abort")
                self.end(seq)
        full = [seq for s, seq in self.running.items() if self.decoder.room([s]) < 1]
        for seq in full:
            yield seq.job.key, seq.out.end("length")
            self.end(seq)

    def start(self, jobs: list[Job]) -> list[tuple[Sequence, list[int]]]:
        """Give admitted jobs slots (a group's first the free one that holds its prefix, if any)
        and start them (Decoder.start); returns their first tokens."""
        new = []
        for group, members in _by_group(jobs):
            shared = members[0].shared if group is not None else 0
            prefix = tuple(members[0].ids[:shared])
            holding = [s for s in self.free if shared and self.decoder.slots[s].prefix == prefix]
            slots = [self.free.pop(self.free.index(holding[-1]))] if holding else []
            slots += [self.free.pop() for _ in members[len(slots) :]]
            seqs = [Sequence(s, job, Output(self.tokenizer, job.params, self.eos_ids)) for s, job in zip(slots, members)]
            began = time.perf_counter()
            self.meter.add(self.decoder.start(seqs, shared), time.perf_counter() - began)
            for seq in seqs:
                self.running[seq.slot] = seq
                new.append((seq, [seq.last]))
        return new

    def step(self) -> list[tuple[Sequence, list[int]]]:
        """One decoder step of the running sequences, in slot order (a run of consecutive slots is
        read in place, KVCache.view); their new tokens."""
        seqs = sorted(self.running.values(), key=lambda seq: seq.slot)
        return list(zip(seqs, self.decoder.step(seqs))) if seqs else []

    def end(self, seq: Sequence) -> None:
        self.history.add(seq.out.tokens)  # prompt lookup's guesses for later outputs
        del self.running[seq.slot]
        self.free.append(seq.slot)


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
        # its cache slots, and the prompt beginnings computed once (keep_prefix, Job.keep)
        self.slots = SlotManager(model.new_cache(num_slots, max_len), store=PrefixStore(prefix_cache_mb << 20))
        self.draft, self.tree, self.chooser = draft, tree, None
        # greedy decoding goes on without the head once its tree does not pay here (new_decoder);
        # False keeps it (benchmarks/eagle.py measures the head itself)
        self.retire_head, self.head_retired = True, False
        if draft is not None:
            self.tree = tree or TreeParams()
            # how greedy EAGLE steps speculate, learned across all this generator's decoders
            self.chooser = SpeedChooser.for_tree(self.tree, greedy=True)
        self.lists = ListTokens.of(tokenizer) if tokenizer is not None else None  # prompt lookup's list guesses
        self.history = History()  # what it wrote lately: prompt lookup's guesses where a sequence holds none
        self.prefill = PrefillMeter()  # what a prompt token costs to compute here, measured
        self._model_thread: ThreadPoolExecutor | None = None  # the async APIs' steps run here (on_model_thread)
        self.eos_ids = frozenset(model.cfg.eos_token_ids).union(tokenizer.end_ids if tokenizer is not None else ())
        if draft is not None:
            self.new_decoder(SamplingParams())  # the draft cache, allocated here

    @property
    def cache(self) -> KVCache:
        return self.slots.cache

    @property
    def prefixes(self) -> PrefixStore:
        return self.slots.store

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
            raise PromptTooLong.of(len(ids), self.cache.capacity)

    def new_decoder(self, params: SamplingParams) -> Decoder:
        """The decoder for one call: EAGLE when the generator has a draft head, else plain (with
        prompt lookup where greedy). Greedy decoding also goes plain, for the rest of the
        generator's life, once the speed chooser finds the head's tree slower than the other ways
        by a margin everywhere it timed them (SpeedChooser.drafting_pays): the head's pass over
        each prompt and over each decided token then costs nothing. The tokens are the same either
        way; sampling keeps the head (a seed gives one answer)."""
        sampler = Sampler(params, self.model.device)
        if self.draft is not None and params.greedy and self.retire_head and not self.head_retired:
            self.head_retired = self.chooser is not None and not self.chooser.drafting_pays()
        if self.draft is None or (params.greedy and self.head_retired):
            lookup = self.tree.lookup if self.tree else 0
            return PlainDecoder(self.model, self.slots, sampler, lookup, self.lists, self.history)
        chooser = self.chooser if params.greedy else None  # sampling: the decoder's own (the tree every step)
        return EagleDecoder(self.model, self.draft, self.slots, sampler, self.tree, chooser, self.lists, self.history)

    def keep_prefix(self, ids: list[int]) -> None:
        """Compute a prompt beginning once and keep it (base KV, and the draft head's KV and
        feature): a later prompt that begins with it then starts from a copy and computes only the
        rest. The SoT skeleton prompt's instructions and worked examples are the same for every
        question. Call it while the generator is idle (it uses slot 0)."""
        ids = list(ids)
        # nothing worth keeping, longer than a slot (no prompt that begins with it fits), or kept already
        if len(ids) < 2 or len(ids) >= self.cache.capacity or ids in self.prefixes:
            return
        decoder = self.new_decoder(SamplingParams(max_tokens=1))  # greedy: draws nothing
        seq = Sequence(0, Job(None, ids + ids[-1:], decoder.sampler.params))  # one token past them, as a prompt needs
        with torch.inference_mode():
            began = time.perf_counter()
            self.prefill.add(decoder.start([seq], len(ids)), time.perf_counter() - began)
            self.prefixes.add(ids, decoder.kept(0, len(ids), self.slots[0].feature), pinned=True)

    def time_prefill(self, tokens: int = 64) -> None:
        """Time one prefill of a made-up prompt of this many tokens (into the PrefillMeter), where
        none is timed yet. Call it while the generator is idle (it uses slot 0)."""
        if self.prefill.seconds_per_token is not None:
            return
        tokens = min(max(tokens, PrefillMeter.MIN), self.cache.capacity)
        ids = [(7 + 31 * i) % self.model.cfg.vocab_size for i in range(tokens)]
        decoder = self.new_decoder(SamplingParams(max_tokens=1))
        with torch.inference_mode():
            began = time.perf_counter()
            self.prefill.add(decoder.start([Sequence(0, Job(None, ids, decoder.sampler.params))]), time.perf_counter() - began)

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

    def run_jobs(self, jobs: list[Job], decoder: Decoder, max_parallel: int | None = None,
                 cancelled: Callable[[object], bool] | None = None) -> Iterator[tuple[object, Delta]]:  # fmt: skip
        """Jobs decoded together, at most `max_parallel` (default: every cache slot) at once, in
        order; a waiting job takes the slot of the first to finish. Yields (job key, Delta);
        `cancelled` as run() takes it."""
        if max_parallel is not None and max_parallel < 1:
            raise SpecSotError(f"max_parallel must be at least 1, got {max_parallel}")
        waiting = list(jobs)

        def admit(room: int) -> list[Job]:
            taken = waiting[:room]
            del waiting[:room]
            return taken

        yield from self.run(admit, decoder, max_parallel, cancelled)

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
        self.slots.forget_claims()
        batch = _Batch(decoder, width, self.tokenizer, self.eos_ids, self.history, self.prefill)
        new: list[tuple[Sequence, list[int]]] = []
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
                new = batch.step() + batch.start(jobs)  # the running sequences' next tokens, the admitted ones' first

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
