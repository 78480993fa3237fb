"""A planned answer streamed in order while its points decode together.

The merged answer is PromptFormat.merge of every point: each point's prefilled beginning and its
text, without a last line that repeats an earlier one, trailing whitespace stripped, joined by
newlines. OrderedAnswer releases that answer's text as early as it is certain: the first point
unfinished streams live, the points after it are held until it ends, and within a point only
what no later token can take back is released (its trailing whitespace, and a last line that may
yet turn out to be a repeat, wait). The pieces joined are exactly the merged answer.

    ordered = OrderedAnswer(fmt, [(1, "Warm up"), (2, "Pick shoes")])
    out = ordered.add(2, " Buy light ones.")   # "": point 1 comes first
    out = ordered.add(1, " Walk first.")       # "1. Warm up: Walk first."
    out = ordered.end(1) + ordered.end(2)      # "\\n2. Pick shoes: Buy light ones."
"""

from __future__ import annotations

from specsot_mq.stopping import without_repeated_last_line


class OrderedAnswer:
    def __init__(self, fmt, points: list[tuple[int, str]]):
        self.fmt = fmt
        self.order = [index for index, _ in points]
        self.titles = dict(points)
        self.texts = {index: "" for index in self.order}
        self.ended: set[int] = set()
        self.cursor = 0  # position in self.order of the point streaming now
        self.sent = 0  # characters of that point's piece already released

    def add(self, index: int, text: str) -> str:
        """A point's new text; returns the answer text it releases (maybe none)."""
        self.texts[index] += text
        return self._release()

    def end(self, index: int) -> str:
        """A point ended; returns the answer text that releases."""
        self.ended.add(index)
        return self._release()

    def restart(self, index: int) -> None:
        """A point starts again from nothing (its stage died). What was released of it stays
        released: decoded again, greedily, it writes the same, and only what goes beyond is new."""
        self.texts[index] = ""
        self.ended.discard(index)

    def _piece(self, index: int) -> str:
        """The point's part of the answer, as far as it is certain now ("\\n" first but for the first point)."""
        head = self.fmt.point_prefix.format(index=index, title=self.titles[index])
        text = self.texts[index]
        if index in self.ended:
            body = (head + without_repeated_last_line(text)).rstrip()
        else:
            lines = text.rstrip().split("\n")
            # A single line can never repeat an earlier one; a later last line might yet.
            body = (head + (lines[0] if len(lines) == 1 else "\n".join(lines[:-1]))).rstrip()
        return ("\n" if index != self.order[0] else "") + body

    def _release(self) -> str:
        out = []
        while self.cursor < len(self.order):
            index = self.order[self.cursor]
            piece = self._piece(index)
            out.append(piece[self.sent :])
            self.sent = max(self.sent, len(piece))
            if index not in self.ended:
                break
            self.cursor += 1
            self.sent = 0
        return "".join(out)
