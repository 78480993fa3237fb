"""The record of one running sequence, and what it is made from: the job the generation loop was
given, and the output it builds (counts, EOS, detokenisation, stop strings and loops).

A `Sequence` is all there is of a sequence between two steps besides its slot (slots.py): the loop
keeps its job and output in it, the decoder its newest token, its prompt-lookup index and its
draft state. One record, handed to every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specsot_mq.lookup import NgramIndex
from specsot_mq.sampling_params import SamplingParams
from specsot_mq.stopping import LineWatch, LoopWatch, StopStrings
from specsot_mq.tokenizer import Detokenizer

if TYPE_CHECKING:  # a stage without a model reads jobs and deltas without torch
    import torch


@dataclass(slots=True)
class Delta:
    """One streamed piece of output."""

    text: str  # new text (may be empty while a character or a possible stop string is incomplete)
    token_ids: list[int]  # tokens accepted in this step
    finish_reason: str | None = None  # None while running; then "stop" (EOS or stop string), "length" or
    # "repeat" (the output began to loop, see SamplingParams.repeat_stop and stop_repeated_line)
    stop: str | None = None  # the stop string that ended it (not in `text`), as vLLM's stop_reason
    steps: int = 1  # the loop's deltas it holds: one from the loop, more where a stage joined them


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
    resume: Resume | None = None  # its prompt's forward, run part of the way already (the router's)


@dataclass(slots=True)
class Resume:
    """A prompt's forward run through its first `layer` layers already, over its tokens from
    `start` on (the router's, sot/learned_router.py): those layers' keys and values there
    ([layer, kv heads, len(ids) - start, head dim] each, as KVCache.snapshot lays them out) and
    the hidden state entering layer `layer` ([len(ids) - start, hidden]), and those of earlier
    layers a draft head reads (`earlier`, by layer, as transformers counts hidden states). A
    prefill that finds the prompt's first `start` tokens computed runs only the later layers from
    it (layout.py): the same cache entries, logits and features as running them all, for half a
    prefill's work where the router read layer num_layers / 2."""

    ids: list[int]  # the whole prompt
    layer: int
    start: int
    kv: tuple[torch.Tensor, torch.Tensor]
    hidden: torch.Tensor
    earlier: dict[int, torch.Tensor] = field(default_factory=dict)


class Output:
    """One sequence's side of the loop: counts, EOS, detokenisation, stop strings and loops."""

    def __init__(self, tokenizer, params: SamplingParams, eos_ids: frozenset[int]):
        self.params, self.eos_ids = params, eos_ids
        self.detok = Detokenizer(tokenizer)
        self.stop = StopStrings(params.stop, params.stop_after_text)
        self.tokens: list[int] = []  # what it accepted (the generator's History gets it at the end)
        self.loop = LoopWatch(params.repeat_stop) if params.repeat_stop else None
        self.lines = LineWatch(params.stop_repeated_item) if params.stop_repeated_line else None
        self.line = 0  # characters of its last line so far (SamplingParams.max_line_chars)

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
            if self.params.max_line_chars:
                self.line = len(piece) - piece.rfind("\n") - 1 if "\n" in piece else self.line + len(piece)
                if not finish and self.line > self.params.max_line_chars:
                    finish = "length"
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


@dataclass(slots=True, eq=False)
class Sequence:
    """One running sequence, from its prefill to its end."""

    slot: int  # the slot it runs in: its name for the decoder and the layout
    job: Job
    out: Output | None = None  # None for a prefill whose output nobody reads (Generator.keep_prefix)
    last: int = -1  # its newest token, fed to its next step (the root of its next draft tree)
    index: NgramIndex | None = None  # its tokens so far, for prompt lookup
    logits: torch.Tensor | None = None  # EAGLE: [Vd] draft logits at the position before `last` (its children)
    feature: torch.Tensor | None = None  # EAGLE: [H] the head's predicted feature at `last`'s position
    # EAGLE: (tokens, base features) decided by steps that drafted nothing; the draft reads them
    # before it next drafts, and until then logits and feature are stale
    unread: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
