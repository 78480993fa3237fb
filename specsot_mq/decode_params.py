"""How a device stage decodes, as its flags choose it, checked before any model loads: the shape
of the draft trees (TreeParams) and the form of the weights (--quantize). Plain data, no torch:
the processes that start stages (specsot launch, serve) check their flags without loading it."""

from __future__ import annotations

from dataclasses import dataclass

from specsot_mq.errors import SpecSotError

QUANTIZE = ("auto", "int4", "int8", "none")  # --quantize


def check_quantize(quantize: str) -> None:
    if quantize not in QUANTIZE:
        raise SpecSotError(f"unknown --quantize '{quantize}': use {', '.join(QUANTIZE)}")


@dataclass(slots=True)
class TreeParams:
    """The shape of the draft trees.

    The defaults suit the shipped head on the default model's quantized weights: its first guess
    is right about half the time and a second guess in a row far less often, while a one-token
    step of the quantized base is so cheap that every draft forward and every extra verify row
    must pay for itself: one draft level with two candidates, and a short prompt-lookup path. A
    stronger head (or a model whose one-token step costs about as much as a few rows, as a
    widened float model's does) wants more: `--num-draft-tokens 4 --draft-depth 2 --lookup 8`, or
    `12 / 5 / 4` with a strong head. The sweeps behind every default here: benchmarks/HISTORY.md.
    """

    num_draft_tokens: int = 2  # tree nodes verified besides the root (--num-draft-tokens)
    depth: int = 1  # deepest level of the tree (--draft-depth)
    topk: int = 2  # children per expanded node and nodes expanded per level (--draft-topk)
    # Tokens of one batched verify, all sequences together (the root is one per sequence; at
    # least one full tree, so a sequence decoding alone always gets its whole tree): with
    # many sequences (SoT branches, several requests) a CPU is compute-bound, so each tree shrinks
    # to fit, down to no draft at all, where speculation would cost more than it gains.
    max_batch_tokens: int = 8
    # Prompt lookup (lookup.py): up to this many tokens copied from earlier in the sequence join
    # each tree as one more path (--lookup; greedy decoding only; 0 = off). They cost no draft
    # forward; in a batch each row gets its share of max_batch_tokens of them (graft_lookup).
    lookup: int = 2
    # Each step picks how to speculate, by what each way has measured lately (SpeedChooser): the
    # draft tree, prompt lookup alone, or no speculation (--adaptive / --no-adaptive).
    adaptive: bool = True

    def __post_init__(self):
        flags = {"--num-draft-tokens": self.num_draft_tokens, "--draft-depth": self.depth, "--draft-topk": self.topk}
        for flag, value in flags.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecSotError(f"{flag} must be a whole number of at least 1, got {value!r}")
        if not isinstance(self.adaptive, bool):
            raise SpecSotError(f"adaptive must be true or false (--adaptive / --no-adaptive), got {self.adaptive!r}")
        if isinstance(self.lookup, bool) or not isinstance(self.lookup, int) or self.lookup < 0:
            raise SpecSotError(f"--lookup must be a whole number of at least 0 (0 = off), got {self.lookup!r}")
        if self.num_draft_tokens > self.max_nodes:
            raise SpecSotError(
                f"--num-draft-tokens {self.num_draft_tokens} is more than a tree of --draft-depth {self.depth} and "
                f"--draft-topk {self.topk} holds ({self.max_nodes} nodes): lower it or raise the depth or topk"
            )
        if self.depth > self.num_draft_tokens:
            raise SpecSotError(
                f"--draft-depth {self.depth} is deeper than --num-draft-tokens {self.num_draft_tokens} nodes can "
                f"reach: lower --draft-depth to at most {self.num_draft_tokens}"
            )

    @property
    def max_nodes(self) -> int:
        """Nodes the search draws: topk at depth 1, then topk x topk per level."""
        return self.topk + (self.depth - 1) * self.topk * self.topk
