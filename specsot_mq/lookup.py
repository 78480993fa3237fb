"""Prompt lookup: draft tokens copied from earlier in the sequence itself.

Answers repeat their own context: names and phrases of the question, a point's title in its
expansion, a list's format from line to line, a small model's own earlier sentences. When the
sequence's last n tokens (n = `max_n` down to `min_n`) occurred before, the tokens that followed
their latest earlier occurrence are a guess at what comes next (prompt lookup decoding, Saxena
2023; vLLM's and SGLang's n-gram speculators). The guess costs no model forward: the EAGLE decoder
grafts it onto its draft tree as one more path (tree.graft), and the base model verifies it with
the rest of the tree, so the output is unchanged.

The index is built incrementally: each token appended registers the n-grams that end just before
it, so a lookup is n dictionary probes however long the sequence is.

A numbered list is the one place where copying guesses wrong on purpose: after "2. ...\n" the
latest earlier newline was followed by "2", where "3" comes next. So where the sequence has just
ended a line that opened with a number and a dot, the guess is the next number and the dot
(ListTokens; a SoT skeleton is such a list, and so are many answers).

Where the sequence's own tokens hold no match, the guess may come from what the same generator
wrote before (History: its recent outputs, each sequence's own n-grams first): a small model
words its answers alike ("It is important to", "In conclusion,").
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ListTokens:
    """How one tokenizer writes a numbered list's item openings: each number 1..`top` as tokens,
    the dot after it, and the line ends."""

    numbers: dict[int, tuple[int, ...]]  # n -> its tokens
    dot: int
    newlines: frozenset[int]
    by_tokens: dict[tuple[int, ...], int] = field(init=False)  # tokens -> n

    top = 99  # numbers beyond it are not guessed
    scan = 256  # tokens looked back for the line's start

    def __post_init__(self):
        object.__setattr__(self, "by_tokens", {t: n for n, t in self.numbers.items()})

    @classmethod
    def of(cls, tokenizer) -> "ListTokens | None":
        """The tokenizer's list tokens; None where the dot or a newline is not one token of its own."""

        def encode(text: str) -> list[int]:
            try:
                return list(tokenizer.encode(text, add_special_tokens=False))
            except TypeError:  # a tokenizer without special tokens
                return list(tokenizer.encode(text))

        dot, newline, blank = encode("."), encode("\n"), encode("\n\n")
        if len(dot) != 1 or len(newline) != 1:
            return None
        numbers = {n: tuple(encode(str(n))) for n in range(1, cls.top + 2)}
        return cls(numbers, dot[0], frozenset(newline + (blank if len(blank) == 1 else [])))

    def next_item(self, tokens: list[int]) -> list[int]:
        """When `tokens` just ended a line that opened with "N." (at its very start: an indented
        item is not guessed), the tokens that open item N + 1: its number, the dot, then the token
        that followed "N." on that line (a list's items tend to open alike: " **"); else []."""
        if not tokens or tokens[-1] not in self.newlines:
            return []
        start = len(tokens) - 2
        while start >= 0 and tokens[start] not in self.newlines and len(tokens) - start < self.scan:
            start -= 1
        start += 1
        for width in (1, 2, 3):
            dot = start + width
            if dot >= len(tokens) - 1:
                return []
            n = self.by_tokens.get(tuple(tokens[start:dot])) if tokens[dot] == self.dot else None
            if n is not None and n + 1 in self.numbers:
                return [*self.numbers[n + 1], self.dot, *tokens[dot + 1 : dot + 2]]
        return []


class NgramIndex:
    """The latest continuation of every n-gram of one token sequence."""

    def __init__(self, tokens: list[int] = (), max_n: int = 3, min_n: int = 1, lists: ListTokens | None = None,
                 history: History | None = None):  # fmt: skip
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.max_n, self.min_n, self.lists, self.history = max_n, min_n, lists, history
        self.tokens: list[int] = []
        # n -> {n-gram: index of the token that followed its latest occurrence}
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append tokens to the sequence."""
        seq = self.tokens
        for token in tokens:
            end = len(seq)  # the new token's index: n-grams ending just before it now have a follower
            for n, table in self.after.items():
                if end >= n:
                    table[tuple(seq[end - n : end])] = end
            seq.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens: the next item's opening where a numbered list's line just ended
        (`lists`), else those that followed the latest earlier occurrence of the sequence's
        longest matching suffix (max_n tokens first), else those that followed it in the
        `history`; [] when none occurred before."""
        seq = self.tokens
        if k < 1:
            return []
        if self.lists is not None and (item := self.lists.next_item(seq)):
            return item[:k]
        found = self.follow(seq, k)
        return found if found or self.history is None else self.history.index.follow(seq, k)

    def follow(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens that followed, in this index, the latest occurrence of seq's longest
        suffix of min_n to max_n tokens (not seq's own last occurrence, when seq is this index's
        sequence); never past a History separator."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(seq) >= n and (start := self.after[n].get(tuple(seq[-n:]))) is not None:
                found = self.tokens[start : start + k]
                return found[: found.index(SEPARATOR)] if SEPARATOR in found else found
        return []


SEPARATOR = -1  # between the outputs a History holds: no token id, so no n-gram runs across it


class History:
    """The recent outputs of one generator (up to `max_tokens`, the older half dropped when full:
    about 10 MB of index at the default), indexed as one sequence with a separator between
    outputs: prompt lookup's guess where a sequence's own tokens hold no match. The base model
    verifies every guess, so what one output wrote changes only how fast another is decoded."""

    def __init__(self, max_tokens: int = 1 << 15, max_n: int = 3):
        self.max_tokens, self.max_n = max_tokens, max_n
        self.index = NgramIndex(max_n=max_n)

    def add(self, tokens: list[int]) -> None:
        """One finished output."""
        half = self.max_tokens // 2
        tokens = list(tokens)[-half:]
        if len(self.index.tokens) + len(tokens) + 1 > self.max_tokens:
            self.index = NgramIndex(self.index.tokens[-half:], max_n=self.max_n)
        self.index.extend(tokens + [SEPARATOR])
