"""A planned answer: its points merged, and streamed in order while they decode together.

The merged answer (`merge_points`, which PromptFormat.merge is) takes the points in plan order,
each its prefilled beginning ("N. Title:") and its text, without a last line that repeats an
earlier one (where the point's loop stop ended it), trailing whitespace stripped, joined by
newlines, with what is not worth reading left out:
- a point cut off (its length cap or its loop stop ended it) keeps its complete sentences only;
- a point that says nothing (no content word beyond the question's and its title's:
  overlap.content_words; an empty point says nothing), or nothing beyond what one point shown
  before it says, is dropped, and
  the points after it are numbered on (1, 2, 3, ... as shown), so an answer never shows
  "3. Sunscreen:" with nothing after it, nor a point that only says an earlier one again;
- where the question names its number of points, the first that many that say something are
  shown: a counted skeleton may list parser.SPARE more, which stand in for points dropped; once
  no spare is left to stand in (the points left are as many as the answer still needs), a point
  says something beyond an earlier one where its title and text together do, unless its text is
  a copy of that one's: its title names an item of its own, and an answer short of its count
  serves the asker worse than a thin point ("3. Use a garden hose: A simple way to keep your
  garden tidy."), though not than one that repeats another's text;
- where the question names its number of points and, once every point of the plan ended, fewer
  are worth reading, the points left out are written again, each from a prompt of its own
  (the format's point.user_again: the question and the point's title, without the plan), and
  those that then say something are shown after the others, numbered on: the answer gets its
  count where the model can write it (`first`: the number of points in the plan, the points
  after them being those written again; a spare stands in within its own round only);
- where no point is worth reading by these rules, the answer shows every point as it wrote it
  rather than nothing;
- a point whose text opens with a line break goes on after its head with one space, or on the
  next line where it opens with a list item (after_head).

OrderedAnswer releases that answer's text as early as it is certain: the first point unfinished
streams live, the points after it are held until it ends, and within a point only what no later
token can take back is released: its complete sentences (a cap may yet cut the sentence it is
in), and of several lines all but the last (which may yet turn out to be a repeat); a point's
"N. Title:" comes out with the first of its text that says something. The pieces joined are
exactly the merged answer.

    ordered = OrderedAnswer(fmt, [(1, "Warm up"), (2, "Pick shoes")], "How do I start running?")
    out = ordered.add(2, " Buy light ones.")   # "": point 1 comes first
    out = ordered.add(1, " Walk first. ")      # "1. Warm up: Walk first."
    out = ordered.end(1) + ordered.end(2)      # "\\n2. Pick shoes: Buy light ones."
"""

from __future__ import annotations

import re

from specsot_mq.sot.overlap import content_words
from specsot_mq.sot.parser import asked_count
from specsot_mq.stopping import without_repeated_last_line

CUT_OFF = ("length", "repeat")  # finish reasons that may end a point mid-sentence
SENTENCE_END = re.compile(r"[.!?…][\"')\]”’]*(?=\s)|\n")
FINAL_SENTENCE_END = re.compile(r"[.!?…][\"')\]”’]*(?=\s|$)|\n")
LIST_ITEM = re.compile(r"([-*•+]|\d+[.)])(\s|$)")


def point_body(text: str, ended: bool, cut: bool) -> str:
    """The part of a point's text that the answer shows and no later token can change: all of it
    once ended (less a repeated last line, or for a cut-off point whatever follows its last
    complete sentence or line); while it decodes, its complete sentences, of one line or of all
    lines but the last."""
    if ended:
        body = without_repeated_last_line(text)
        # A repeated last line gone, every line left ended with a line break: none is unfinished.
        return _to_last(FINAL_SENTENCE_END, text) if cut and body == text else body
    lines = text.rstrip().split("\n")
    if len(lines) > 1:
        return "\n".join(lines[:-1])
    return _to_last(SENTENCE_END, text)


def after_head(head: str, body: str) -> str:
    """A point's "N. Title:" and its text, where the text opens with a line break (a small model
    often starts a point on a new line, or after a blank one): on the head's line after one space,
    or on the next line where it opens with a list item ("- ...", "2. ..."). The tokens are the
    same; only the whitespace between head and text is."""
    text = body.lstrip()
    if "\n" not in body[: len(body) - len(text)]:
        return head + body
    return head + ("\n" if LIST_ITEM.match(text) else " ") + text


def merge_points(fmt, points, question: str = "", cut=(), first: int | None = None) -> str:
    """The merged answer from (index, title, text) in plan order, then the points written again;
    `cut`: the indices of points that a length cap or a loop stop ended; `first`: how many of
    the points are the plan's (the rest were written again; default: all)."""
    pieces = []
    for _, title, body in _kept(points, question, cut, first):
        pieces.append(after_head(fmt.point_prefix.format(index=len(pieces) + 1, title=title), body).rstrip())
    return "\n".join(pieces)


def dropped_points(points, question: str = "", cut=(), first: int | None = None) -> list[int]:
    """The indices of the points merge_points leaves out."""
    kept = {index for index, _, _ in _kept(points, question, cut, first)}
    return [index for index, _, _ in points if index not in kept]


def says_something(body: str, title: str, question: set[str], shown: list[tuple[set[str], set[str]]],
                   needed: bool = False, ended: bool = True) -> bool:
    """Whether a point's text has a content word beyond its title's and the question's
    (`question`: its content words) and beyond each point shown before it (`shown`: the content
    words of their texts, all and beyond their titles and the question). `needed`: no spare is
    left to stand in for it (a counted plan), so once it `ended`, beyond each earlier point's text
    its title and text together may say it, where its text is no copy of that point's (the same
    words beyond title and question, and its own item not named: "fish is a great choice" after
    "lean beef is a great choice" is none). While a point decodes, only the first test counts:
    more text only adds words, so once true it stays true, and what the answer streams of a point
    is never taken back."""
    words, item = content_words(body), content_words(title) - question
    own = words - item - question
    if not own:
        return False
    if all(own - text for text, _ in shown):
        return True
    if not (needed and ended):
        return False
    names_item = bool(words & item)
    return all((own | item) - text and (names_item or own != earlier) for text, earlier in shown)


def no_spare_left(counted: bool, left: int, wanted: int) -> bool:
    """Whether no spare can stand in for a point of a counted plan: the points left (it and those
    after it) are no more than the answer still needs (says_something's `needed`; the merge and
    the stream must agree on it)."""
    return counted and left <= wanted


def _shown(body: str, title: str, question: set[str]) -> tuple[set[str], set[str]]:
    """What says_something compares a later point with: the content words of a shown point's text,
    all and beyond its title's and the question's."""
    words = content_words(body)
    return words, words - content_words(title) - question


def _kept(points, question: str, cut, first: int | None = None) -> list:
    """(index, title, body) of the points merge_points shows, in order: those worth reading
    (_worth); where none is, rather than no answer at all, every point that wrote anything, as it
    wrote it (less a repeated last line; as many as the question names)."""
    kept = list(_worth(points, question, cut, len(points) if first is None else first))
    if kept or not points:
        return kept
    most = asked_count(question) or len(points)
    return [(i, title, body) for i, title, text in points if (body := without_repeated_last_line(text)).strip()][:most]


def _worth(points, question: str, cut, first: int):
    """(index, title, body) of the points worth reading, in order: those that say something, as
    many as the question names where it names a number (the plan's spares stand in for points
    that said nothing; the points after the `first`, written again, for those left out)."""
    asked, shown, count = content_words(question), [], asked_count(question)
    most = count or first
    for n, (index, title, text) in enumerate(points):
        body = point_body(text, True, index in cut)
        needed = no_spare_left(count is not None, (first if n < first else len(points)) - n, most - len(shown))
        if len(shown) < most and says_something(body, title, asked, shown, needed):
            shown.append(_shown(body, title, asked))
            yield index, title, body


def _to_last(pattern: re.Pattern, text: str) -> str:
    """The text up to the end of the last match of pattern ("" without one)."""
    end = 0
    for m in pattern.finditer(text):
        end = m.end()
    return text[:end]


class OrderedAnswer:
    def __init__(self, fmt, points: list[tuple[int, str]], question: str = ""):
        self.fmt, self.question = fmt, question
        self.order = [index for index, _ in points]
        self.first = len(self.order)  # the plan's points; those after them are written again (extend)
        self.dropped: list[int] = []  # the plan's points passed over, saying nothing
        # whether the points left out are to be written again, once the plan's have all ended
        self.writes_again = bool(fmt.point_again)
        self.titles = dict(points)
        self.texts = {index: "" for index in self.order}
        self.ended: dict[int, bool] = {}  # index -> whether it was cut off
        self.cursor = 0  # position in self.order of the point streaming now
        self.shown = 0  # points released so far (kept), so the number the next one shows is shown + 1
        count = asked_count(question)
        self.counted = count is not None
        self.most = count or len(points)  # points shown at most (_kept)
        self.fell_back = False  # whether the merge's fallback (no point worth reading) was released
        self.asked = content_words(question)
        self.seen: list[tuple[set[str], set[str]]] = []  # each shown point's text's content words (_shown)
        self.sent = 0  # characters of that point's piece already released

    def add(self, index: int, text: str) -> str:
        """A point's new text; returns the answer text it releases (maybe none)."""
        self.texts[index] += text
        return self._release()

    def end(self, index: int, finish: str = "stop") -> str:
        """A point ended (finish: its PointEnd's); returns the answer text that releases."""
        self.ended[index] = finish in CUT_OFF
        return self._release()

    def unneeded(self) -> list[int]:
        """The points the answer will never show, however they end (as many points as the question
        names are shown already): their decoding may stop."""
        return self.order[self.cursor :] if self.shown >= self.most else []

    def again(self) -> list[int]:
        """Once, where the question names its count and every point of the plan ended with fewer
        worth reading: the points it left out, in plan order, to be written again (then
        `extend`); else []."""
        if not self._short():
            return []
        self.writes_again = False
        return list(self.dropped)

    def extend(self, points: list[tuple[int, str]]) -> str:
        """The points written again ((index, title): new indices), shown after the plan's as they
        say something; returns the answer text that releases (none before they write)."""
        self.order += [index for index, _ in points]
        self.titles |= dict(points)
        self.texts |= {index: "" for index, _ in points}
        return self._release()

    def _short(self) -> bool:
        """Whether the points left out are to be written again now (again)."""
        return (self.writes_again and self.counted and self.cursor == len(self.order) == self.first
                and self.shown < self.most and bool(self.dropped))  # fmt: skip

    def restart(self, index: int) -> None:
        """A point starts again from nothing (its stage died). What was released of it stays
        released: decoded again, greedily, it writes the same, and only what goes beyond is new."""
        self.texts[index] = ""
        self.ended.pop(index, None)

    def _piece(self, index: int) -> str | None:
        """The point's part of the answer, as far as it is certain now ("\\n" first but for the
        first point shown); "" while it has said nothing yet, None once it ended saying nothing."""
        ended = index in self.ended
        body = point_body(self.texts[index], ended, self.ended.get(index, False))
        end = self.first if self.cursor < self.first else len(self.order)  # a spare stands in within its round
        needed = no_spare_left(self.counted, end - self.cursor, self.most - self.shown)
        if not says_something(body, self.titles[index], self.asked, self.seen, needed, ended):
            return None if ended else ""
        head = self.fmt.point_prefix.format(index=self.shown + 1, title=self.titles[index])
        return ("\n" if self.shown else "") + after_head(head, body).rstrip()

    def _release(self) -> str:
        out = []
        while self.cursor < len(self.order) and self.shown < self.most:
            index = self.order[self.cursor]
            piece = self._piece(index)
            if piece:
                out.append(piece[self.sent :])
                self.sent = max(self.sent, len(piece))
            if index not in self.ended:
                break
            if piece is not None:
                self.shown += 1
                body = point_body(self.texts[index], True, self.ended[index])
                self.seen.append(_shown(body, self.titles[index], self.asked))
            elif self.cursor < self.first:
                self.dropped.append(index)
            self.cursor += 1
            self.sent = 0
        if self.cursor == len(self.order) and not self.shown and not self.fell_back and not self._short():
            # Every point ended and none was worth reading (nothing released yet): the merge's
            # fallback, every point as it wrote it, comes out whole.
            self.fell_back = True
            cut = {index for index, was_cut in self.ended.items() if was_cut}
            out.append(merge_points(self.fmt, [(i, self.titles[i], self.texts[i]) for i in self.order], self.question,
                                    cut, self.first))  # fmt: skip
        return "".join(out)
