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
"""

from __future__ import annotations


class NgramIndex:
    """The latest continuation of every n-gram of one token sequence."""

    def __init__(self, tokens: list[int] = (), max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.max_n, self.min_n = max_n, min_n
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
        """Up to k tokens that followed the latest earlier occurrence of the sequence's longest
        matching suffix (max_n tokens first); [] when none occurred before."""
        seq = self.tokens
        if k < 1:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(seq) > n and (start := self.after[n].get(tuple(seq[-n:]))) is not None:
                return seq[start : start + k]
        return []
