"""The rules that end an output besides EOS and max tokens, each fed the output as it grows: stop
strings (StopStrings), a run of tokens that repeats (LoopWatch, SamplingParams.repeat_stop) and a
line that repeats (LineWatch, SamplingParams.stop_repeated_line). The generation loop applies them
token by token (generate.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass
class StopStrings:
    """Stop-string bookkeeping: text is released unless it could be the start of a stop string."""

    stops: tuple[str, ...]
    after_text: bool = False  # SamplingParams.stop_after_text
    text: str = ""
    released: int = 0

    def feed(self, piece: str, final: bool) -> tuple[str, str | None]:
        """Add decoded text; return (text safe to release now, the stop string hit or None)."""
        self.text += piece
        # With after_text, a stop must end past the leading whitespace (so it cannot lie within it).
        lead = len(self.text) - len(self.text.lstrip()) if self.after_text else 0
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, max(self.released, lead - len(s) + 1))) >= 0]
        if hits:
            end, hit = min(hits)
            self.text = self.text[:end]
        else:
            end, hit = len(self.text) if final else self._safe_end(), None
        out, self.released = self.text[self.released : end], end
        return out, hit

    def _safe_end(self) -> int:
        """Where the first possible beginning of a stop string lies in the unreleased tail."""
        n = len(self.text)
        longest = max((len(s) for s in self.stops), default=1)
        for i in range(max(self.released, n - longest + 1), n):
            tail = self.text[i:]
            if any(s.startswith(tail) for s in self.stops):
                return i
        return n


class LoopWatch:
    """SamplingParams.repeat_stop's rule. Fed an output token by token, add() says whether the
    last n tokens, ending with this one, already ran earlier in it: the output has begun to loop."""

    def __init__(self, n: int):
        self.n = n
        self.tokens: list[int] = []
        self.runs: set[tuple[int, ...]] = set()  # every run of n tokens so far

    def add(self, tok: int) -> bool:
        self.tokens.append(tok)
        if len(self.tokens) < self.n:
            return False
        run = tuple(self.tokens[-self.n :])
        seen = run in self.runs
        self.runs.add(run)
        return seen


class LineWatch:
    """SamplingParams.stop_repeated_line's rule. Fed an output's text piece by piece, add() says
    whether a line just completed repeats an earlier one, ignoring case, a leading list number and
    punctuation (a plan that has begun to list its points again). With `items`
    (SamplingParams.stop_repeated_item), a list item that runs on inside a line ("1. a 2. b") also
    ends the line before it: a plan that lists its points again on one line."""

    MARK = re.compile(r"^[\W_]*(?:\d+[.)])?")
    INLINE_ITEM = re.compile(r"[ \t]+(?=[0-9]{1,3}[.)][ \t])")  # the space before "N. " inside a line

    def __init__(self, items: bool = False):
        self.items = items
        self.partial = ""
        self.seen: set[str] = set()

    @classmethod
    def key(cls, line: str) -> str:
        """What two lines must share to count as the same line."""
        return " ".join(re.findall(r"\w+", cls.MARK.sub("", line).lower()))

    def add(self, piece: str) -> bool:
        text = self.partial + piece
        if self.items:
            text = self.INLINE_ITEM.sub("\n", text)
        *done, self.partial = text.split("\n")
        for line in done:
            key = self.key(line)
            if key in self.seen:
                return True
            if key:
                self.seen.add(key)
        return False


def without_repeated_last_line(text: str) -> str:
    """The text without its last line where that line repeats an earlier one (LineWatch's rule):
    an output that stop_repeated_line ended has streamed the repeat before it was known to be
    one, and an answer assembled from it leaves it out."""
    *before, last = text.rstrip().split("\n")
    key = LineWatch.key(last)
    if key and key in {LineWatch.key(line) for line in before}:
        return "\n".join(before)
    return text
