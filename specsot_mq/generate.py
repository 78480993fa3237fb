"""The one generation loop.

`Generator.stream()` is the loop: a decoder proposes tokens (one per step for plain decoding; several
for speculative decoding), the loop checks EOS, stop strings and max tokens token by token,
detokenises incrementally and yields text deltas. `generate()` (callback) and `astream()` (async
generator) are thin wrappers over it, so every mode runs the same code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

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

    @property
    def tokens_per_second(self) -> float:
        decode = self.seconds - self.prefill_seconds
        return (len(self.token_ids) - 1) / decode if decode > 0 and len(self.token_ids) > 1 else 0.0


class Decoder(Protocol):
    """What the loop drives: plain decoding here, speculative decoding elsewhere."""

    def prefill(self, prompt_ids: list[int]) -> list[int]: ...

    def step(self) -> list[int]: ...


class PlainDecoder:
    """One token per forward, from one cache slot."""

    def __init__(self, model: LlamaModel, cache: KVCache, sampler: Sampler, slot: int = 0):
        self.model, self.cache, self.sampler, self.slot = model, cache, sampler, slot
        self.last = 0  # the token fed to the next step
        self.pos = 0  # its position

    def _forward(self, ids: list[int]) -> int:
        dev = self.model.device
        input_ids = torch.tensor([ids], device=dev)
        positions = torch.arange(self.pos, self.pos + len(ids), device=dev)[None]
        logits = self.model(input_ids, positions, self.cache, slots=[self.slot], last_only=True).logits
        self.pos += len(ids)
        self.last = int(self.sampler(logits[:, -1])[0])
        return self.last

    def prefill(self, prompt_ids: list[int]) -> list[int]:
        self.cache.truncate(self.slot, 0)
        self.pos = 0
        return [self._forward(prompt_ids)]

    def step(self) -> list[int]:
        return [self._forward([self.last])]


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


class Generator:
    """A model, its tokenizer and one KV cache allocated up front; generates one request at a time."""

    def __init__(self, model: LlamaModel, tokenizer, max_len: int = 4096, num_slots: int = 1):
        self.model = model
        self.tokenizer = tokenizer
        self.cache = model.new_cache(num_slots, max_len)
        eos = set(model.cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)

    def prompt_ids(self, prompt: str | list[dict] | list[int]) -> list[int]:
        """A question or a chat (list of messages) through the chat template; token ids as they are."""
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            return list(prompt)
        return chat_prompt_ids(self.tokenizer, prompt)

    def stream(self, prompt, params: SamplingParams | None = None, decoder: Decoder | None = None) -> Iterator[Delta]:
        """The generation loop. Yields Deltas; the last one has finish_reason set."""
        params = params or SamplingParams()
        prompt_ids = self.prompt_ids(prompt)
        if decoder is None:
            decoder = PlainDecoder(self.model, self.cache, Sampler(params, self.model.device))
        detok = Detokenizer(self.tokenizer)
        stop = _StopState(params.stop)
        produced = 0
        # Grad mode is per thread and astream() may run each step in a different worker thread,
        # so inference mode is entered around each model call rather than around the loop.
        with torch.inference_mode():
            new = decoder.prefill(prompt_ids)
        while True:
            accepted, finish = [], None
            for tok in new:
                accepted.append(tok)
                produced += 1
                if tok in self.eos_ids and not params.ignore_eos:
                    finish = "stop"
                    break
                if produced >= params.max_tokens:
                    finish = "length"
                    break
            text_ids = accepted[:-1] if finish == "stop" else accepted  # EOS has no text
            piece = detok.add(text_ids)
            if finish:
                piece += detok.flush()
            text, hit = stop.feed(piece, final=finish is not None)
            if hit:
                finish = "stop"
            yield Delta(text, accepted, finish)
            if finish:
                return
            with torch.inference_mode():
                new = decoder.step()

    def generate(
        self,
        prompt,
        params: SamplingParams | None = None,
        on_delta: Callable[[Delta], None] | None = None,
        decoder: Decoder | None = None,
    ) -> Completion:
        """Run the loop to the end, calling on_delta for each piece; return the whole completion."""
        start = time.perf_counter()
        prompt_ids = self.prompt_ids(prompt)
        texts, ids, steps, first_at, finish = [], [], -1, None, "length"
        for delta in self.stream(prompt_ids, params, decoder):
            first_at = first_at or time.perf_counter()
            steps += 1
            texts.append(delta.text)
            ids.extend(delta.token_ids)
            finish = delta.finish_reason or finish
            if on_delta is not None:
                on_delta(delta)
        end = time.perf_counter()
        return Completion("".join(texts), ids, finish, len(prompt_ids), end - start, first_at - start, steps)

    async def astream(self, prompt, params: SamplingParams | None = None, decoder: Decoder | None = None) -> AsyncIterator[Delta]:
        """The same loop as an async generator; each model step runs in a worker thread, so the
        event loop stays responsive."""
        it = self.stream(prompt, params, decoder)
        loop = asyncio.get_running_loop()
        done = object()
        while (delta := await loop.run_in_executor(None, next, it, done)) is not done:
            yield delta
