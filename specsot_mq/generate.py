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
from dataclasses import dataclass
from typing import Protocol

import torch

from specsot_mq.errors import SpecSotError
from specsot_mq.kv_cache import KVCache
from specsot_mq.model import LlamaModel
from specsot_mq.sampling import Sampler, SamplingParams
from specsot_mq.tokenizer import Detokenizer, chat_prompt_ids


@dataclass(slots=True)
class Delta:
    """One streamed piece of output."""

    text: str  # new text (may be empty while a character or a possible stop string is incomplete)
    token_ids: list[int]  # tokens accepted in this step
    finish_reason: str | None = None  # None while running; then "stop" (EOS or stop string) or "length"


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


class Decoder(Protocol):
    """What the loop drives: plain decoding here, speculative decoding elsewhere.

    Sequences are numbered by their place in the prefill list; step() returns new tokens for each
    sequence still running, and drop() tells the decoder a sequence is finished.
    """

    def prefill(self, prompts: list[list[int]]) -> dict[int, list[int]]: ...

    def step(self) -> dict[int, list[int]]: ...

    def drop(self, seq: int) -> None: ...


class PlainDecoder:
    """One token per sequence per forward; sequence i lives in cache slot i; all running sequences
    share each forward."""

    def __init__(self, model: LlamaModel, cache: KVCache, sampler: Sampler):
        self.model, self.cache, self.sampler = model, cache, sampler
        self.last: dict[int, int] = {}  # running sequence -> the token fed to its next step

    def prefill(self, prompts: list[list[int]]) -> dict[int, list[int]]:
        dev = self.model.device
        for seq, ids in enumerate(prompts):  # prompts differ in length: one forward each
            self.cache.truncate(seq, 0)
            out = self.model(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None],
                             self.cache, slots=[seq], last_only=True)  # fmt: skip
            self.last[seq] = int(self.sampler(out.logits[:, -1])[0])
        return {seq: [tok] for seq, tok in self.last.items()}

    def step(self) -> dict[int, list[int]]:
        seqs = list(self.last)
        dev = self.model.device
        ids = torch.tensor([[self.last[s]] for s in seqs], device=dev)
        positions = torch.tensor([[self.cache.lengths[s]] for s in seqs], device=dev)
        logits = self.model(ids, positions, self.cache, slots=seqs).logits[:, -1]
        self.last = dict(zip(seqs, self.sampler(logits).tolist()))
        return {seq: [tok] for seq, tok in self.last.items()}

    def drop(self, seq: int) -> None:
        self.last.pop(seq, None)


@dataclass
class _StopState:
    """Stop-string bookkeeping: text is released unless it could be the start of a stop string."""

    stops: tuple[str, ...]
    text: str = ""
    released: int = 0

    def feed(self, piece: str, final: bool) -> tuple[str, bool]:
        """Add decoded text; return (text safe to release now, whether a stop string was hit)."""
        self.text += piece
        hits = [i for s in self.stops if (i := self.text.find(s, self.released)) >= 0]
        if hits:
            end = min(hits)
            self.text = self.text[:end]
        else:
            end = len(self.text) if final else self._safe_end()
        out, self.released = self.text[self.released : end], end
        return out, bool(hits)

    def _safe_end(self) -> int:
        """Where the first possible beginning of a stop string lies in the unreleased tail."""
        n = len(self.text)
        longest = max((len(s) for s in self.stops), default=1)
        for i in range(max(self.released, n - longest + 1), n):
            tail = self.text[i:]
            if any(s.startswith(tail) for s in self.stops):
                return i
        return n


class _Output:
    """One sequence's side of the loop: counts, EOS, detokenisation and stop strings."""

    def __init__(self, tokenizer, params: SamplingParams, eos_ids: frozenset[int]):
        self.params, self.eos_ids = params, eos_ids
        self.detok = Detokenizer(tokenizer)
        self.stop = _StopState(params.stop)
        self.produced = 0

    def take(self, new: list[int]) -> Delta:
        """Accept proposed tokens up to the first stopping point; return the resulting delta."""
        accepted, finish = [], None
        for tok in new:
            accepted.append(tok)
            self.produced += 1
            if tok in self.eos_ids and not self.params.ignore_eos:
                finish = "stop"
                break
            if self.produced >= self.params.max_tokens:
                finish = "length"
                break
        piece = self.detok.add(accepted[:-1] if finish == "stop" else accepted)  # EOS has no text
        if finish:
            piece += self.detok.flush()
        text, hit = self.stop.feed(piece, final=finish is not None)
        return Delta(text, accepted, "stop" if hit else finish)


class Generator:
    """A model, its tokenizer and one KV cache allocated up front; generates one request at a time."""

    def __init__(self, model: LlamaModel, tokenizer, max_len: int = 4096, num_slots: int = 1, draft=None, tree=None):
        """draft: an EAGLE DraftHead attached to `model` (None: plain decoding); tree: its
        TreeParams. Both caches are allocated here, once."""
        self.model = model
        self.tokenizer = tokenizer
        self.cache = model.new_cache(num_slots, max_len)
        self.draft, self.tree, self.draft_cache = draft, tree, None
        if draft is not None:
            from specsot_mq.speculative import TreeParams

            self.tree = tree or TreeParams()
            # Tree entries go past the sequence while drafting: room for one full tree more.
            room = (self.tree.depth + 1) * (self.tree.topk + 1)
            self.draft_cache = draft.new_cache(num_slots, max_len + room)
        eos = set(model.cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)

    def prompt_ids(self, prompt: str | list[dict] | list[int]) -> list[int]:
        """A question or a chat (list of messages) through the chat template; token ids as they are."""
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            return list(prompt)
        return chat_prompt_ids(self.tokenizer, prompt)

    def new_decoder(self, params: SamplingParams) -> Decoder:
        """The decoder for one call: EAGLE when the generator has a draft head, else plain."""
        sampler = Sampler(params, self.model.device)
        if self.draft is None:
            return PlainDecoder(self.model, self.cache, sampler)
        from specsot_mq.speculative import EagleDecoder

        return EagleDecoder(self.model, self.draft, self.cache, sampler, self.tree, draft_cache=self.draft_cache)

    def stream_many(
        self, prompts: list, params: SamplingParams | None = None, decoder: Decoder | None = None
    ) -> Iterator[tuple[int, Delta]]:
        """The generation loop: all prompts decoded together. Yields (sequence index, Delta); each
        sequence's last delta has finish_reason set."""
        params = params or SamplingParams()
        prompt_ids = [self.prompt_ids(p) for p in prompts]
        if len(prompt_ids) > self.cache.num_slots:
            raise SpecSotError(
                f"{len(prompt_ids)} sequences at once need as many cache slots; this generator has "
                f"{self.cache.num_slots}: create it with num_slots={len(prompt_ids)}"
            )
        decoder = decoder or self.new_decoder(params)
        outputs = {seq: _Output(self.tokenizer, params, self.eos_ids) for seq in range(len(prompt_ids))}
        # Grad mode is per thread and astream() may run each step in a different worker thread,
        # so inference mode is entered around each model call rather than around the loop.
        with torch.inference_mode():
            new = decoder.prefill(prompt_ids)
        while True:
            for seq, tokens in new.items():
                delta = outputs[seq].take(tokens)
                if delta.finish_reason:
                    del outputs[seq]
                    decoder.drop(seq)
                yield seq, delta
            if not outputs:
                return
            with torch.inference_mode():
                new = decoder.step()

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
    ) -> list[Completion]:
        """Several prompts decoded together (one batched forward per step); completions in order."""
        start = time.perf_counter()
        prompt_ids = [self.prompt_ids(p) for p in prompts]
        decoder = decoder or self.new_decoder(params or SamplingParams())
        n = len(prompts)
        texts, ids = [[] for _ in range(n)], [[] for _ in range(n)]
        steps, first, last, finish = [-1] * n, [0.0] * n, [0.0] * n, ["length"] * n
        for seq, delta in self.stream_many(prompt_ids, params, decoder):
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
        """The same loop as an async generator; each model step runs in a worker thread, so the
        event loop stays responsive."""
        it = self.stream(prompt, params, decoder)
        loop = asyncio.get_running_loop()
        done = object()
        while (delta := await loop.run_in_executor(None, next, it, done)) is not done:
            yield delta
