"""Skeleton parsing: the model's numbered plan becomes a Plan of short, numbered points.

The skeleton comes from a small model, so the parser forgives what such a model writes:
- items start with "N." or "N)" at a line start, also after a bullet, a quote mark or a heading
  mark, and in bold ("**2.** Body");
- items run together on one line ("1. a 2. b 3. c"): a number inside a line starts an item only
  when it is the next number expected, so "1. Pick 3. options" stays one item;
- titles lose a doubled marker ("1. 1. Title"), markdown (** __ `), control characters, junk
  around them and trailing colons or periods; a head and its explanation ("Comfort: Soft and
  supportive") is the head; a title longer than 12 words is cut to its first sentence or clause,
  then to 12 words;
- a predicted length at the end of a title, "(~40 tokens)", "(40 tokens)" or "[40]", is read off;
- a repeated number keeps its first item, and so does a title that says what an earlier one
  says (overlap.same_point: "Living room upgrades" after "Upgrade your living room");
- a title that only restates the question is dropped (overlap.restates: "Staying healthy" for
  "Give me three tips for staying healthy.");
- the kept items are renumbered 1, 2, 3, ... in order and capped at max_points.

`asked_count` reads the number of points a question names ("three tips", "List 5 artworks", "a
five-step workflow"): the skeleton prompt asks for exactly that many, its stop and the parser's
cap are set to it (sot/flow.py).

It never raises on a string. A list of fewer than two usable points, or text with no list, is
"direct" (answer without a plan); empty text or text without a single letter is "error".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from specsot_mq.errors import SpecSotError
from specsot_mq.sot.overlap import NUMBER_WORDS, restates, same_point

MAX_TITLE_WORDS = 12
MAX_HEAD_WORDS = 4  # a title's head before ": ", where what follows explains it (_head)
MOST_ASKED = 12  # the most points a question may name and get
SPARE = 2  # items a counted skeleton may list past its count: a repeat or an empty point's stand-ins

# A line start (after quote, heading or bullet marks) or a space inside a line, then "N." or "N)".
# A digit right after the marker means a decimal ("3.14"), not an item.
MARKER = re.compile(
    r"(?:(?P<line>^)[ \t>#]*(?:[-*+•][ \t]*)?|(?<=\s))(?:\*\*|__)?(?P<number>[0-9]{1,3})[.)](?:\*\*|__)?(?![0-9])",
    re.M,
)
# "(~40 tokens)", "(~40)", "(40 tokens)", "[40]", "[~40 tokens]" at the very end of a title.
LENGTH = re.compile(
    r"(?:\(\s*~\s*(?P<a>[0-9]{1,5})\s*(?:tokens?)?\s*\)|\(\s*(?P<b>[0-9]{1,5})\s*tokens?\s*\)"
    r"|\[\s*~?\s*(?P<c>[0-9]{1,5})\s*(?:tokens?)?\s*\])\s*$",
    re.I,
)
LEADING_JUNK = " \t-–—*•#>:.)]|~=_"
TRAILING_JUNK = " \t.:;,-–—*#|~=_"
SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")
CLAUSE_BREAK = re.compile(r",\s+|\s+[-–—]\s+|\s+\(")
# A title that starts with an item marker again ("1. 1. Start the job"): the model numbered it twice.
DOUBLED = re.compile(r"^[ \t]*(?:\*\*|__)?[0-9]{1,3}[.)](?:\*\*|__)?[ \t]+")
TAG = re.compile(r"^[\s*_#>`]*\[(?P<tag>PLAN|DIRECT)\][*_`]*", re.I)


@dataclass(slots=True)
class Point:
    """One point of a skeleton."""

    index: int  # 1-based position in the plan, renumbered consecutively
    title: str  # short title, markdown and junk removed, at most 12 words
    predicted_tokens: int | None = None  # length the skeleton predicted for this point, if any


@dataclass(slots=True)
class Plan:
    """What the skeleton says to do next."""

    kind: str  # "plan": expand the points; "direct": answer without a plan; "error": no usable text
    points: list[Point] = field(default_factory=list)  # the points, only for kind "plan"
    reason: str = ""  # why direct or error, or what was dropped from a plan; for the logs


def parse_skeleton(text: str, max_points: int = 10, question: str = "") -> Plan:
    """Parse a skeleton (the whole assistant text, including the prefilled "1.") into a Plan;
    `question`: the question it plans, whose restatements are dropped.

    Never raises on a string; max_points below 2 raises SpecSotError (a plan needs two points).
    """
    if max_points < 2:
        raise SpecSotError(f"max_points must be at least 2 (got {max_points}): a plan needs two points")
    if not text or not text.strip():
        return Plan("error", reason="the skeleton is empty")
    if not any(c.isalpha() for c in text):
        return Plan("error", reason="the skeleton has no words")
    items = _items(text)
    if not items:
        return Plan("direct", reason="the skeleton has no numbered list")
    points, notes = [], []
    numbers = set()
    for number, body in items:
        title, predicted = _clean_title(body)
        if not any(c.isalpha() for c in title):
            notes.append(f"dropped item {number} (no title)")
        elif number in numbers:
            notes.append(f"dropped repeated number {number}")
        elif same := next((p.title for p in points if same_point(p.title, title)), None):
            notes.append(f"dropped {title!r}, which says what {same!r} says")
        elif question and restates(title, question):
            notes.append(f"dropped {title!r}, which restates the question")
        else:
            numbers.add(number)
            points.append(Point(len(points) + 1, title, predicted))
    if len(points) > max_points:
        notes.append(f"kept the first {max_points} of {len(points)} points")
        points = points[:max_points]
    if len(points) < 2:
        notes.insert(0, f"only {len(points)} usable point{'' if len(points) == 1 else 's'}, not worth splitting")
        return Plan("direct", reason="; ".join(notes))
    return Plan("plan", points, "; ".join(notes))


def parse_plan_direct(text: str, max_points: int = 10, question: str = "") -> Plan:
    """Parse the SpecSoT format: "[DIRECT]" (answer without a plan) or "[PLAN]" and numbered points.

    The points after "[PLAN]" follow parse_skeleton's rules. Text with neither tag goes direct, the
    safe way (a plain answer), unless it is empty or has no words (error). Never raises on a string.
    """
    if max_points < 2:
        raise SpecSotError(f"max_points must be at least 2 (got {max_points}): a plan needs two points")
    if not text or not text.strip():
        return Plan("error", reason="the reply is empty")
    tag = TAG.match(text)
    if tag is None:
        if not any(c.isalpha() for c in text):
            return Plan("error", reason="the reply has no words")
        return Plan("direct", reason="the reply starts with neither [PLAN] nor [DIRECT]")
    if tag.group("tag").upper() == "DIRECT":
        return Plan("direct", reason="the model chose [DIRECT]")
    plan = parse_skeleton(text[tag.end():], max_points, question)
    if plan.reason:
        plan.reason = "after [PLAN]: " + plan.reason
    return plan


# Words before a number that ask for that many points ("give me three", "list 5", "what are the
# four"), and nouns after it that name points ("three tips"); a unit after it is not a count.
_ASKING = frozenset("give list name suggest describe share provide propose offer recommend identify outline design "
                    "create explain what top develop discuss include choose pick mention state".split())  # fmt: skip
_POINT_NOUNS = frozenset("tips ways reasons ideas examples steps things benefits strategies points options principles "
                         "habits mistakes differences factors impacts advantages disadvantages methods questions "
                         "rules lessons facts causes effects signs skills tools types kinds stages features".split())  # fmt: skip
_UNITS = frozenset("minutes minute hours hour days day weeks week months month years year words word sentences "
                   "sentence paragraphs paragraph lines line pages page times percent people persons dollars "
                   "degrees meters metres miles kilometres kilometers km seconds second".split())  # fmt: skip


def asked_count(question: str) -> int | None:
    """The number of points the question asks for, where it names one (2 to MOST_ASKED): "Give
    me three tips", "List 5 specific artworks", "a five-step workflow" (a word that asks up to
    three words before the number, or a noun that names points right after it or one word on);
    None otherwise ("two popular smartphone models", "in 200 words", "where do the two novels
    part ways")."""
    words = re.findall(r"[a-z0-9]+", question.lower())
    for i, word in enumerate(words):
        n = int(word) if word.isdigit() else NUMBER_WORDS.get(word)
        if n is None or not 2 <= n <= MOST_ASKED or i + 1 == len(words) or words[i + 1] in _UNITS:
            continue
        if any(w in _ASKING for w in words[max(0, i - 3) : i]) or any(w in _POINT_NOUNS for w in words[i + 1 : i + 3]):
            return n
    return None


def item_starts(text: str) -> list[tuple[int, int, int]]:
    """(marker start, marker end, number) of every item, in order."""
    starts = []
    for m in MARKER.finditer(text):
        number = int(m.group("number"))
        if m.group("line") is None:  # inside a line: only the next number, followed by a space
            expected = starts[-1][2] + 1 if starts else 1
            if number != expected or not text[m.end():m.end() + 1].isspace():
                continue
        starts.append((m.start(), m.end(), number))
    return starts


def _items(text: str) -> list[tuple[int, str]]:
    """(number as written, raw body) of every item, in order; text before the first item is ignored."""
    starts = item_starts(text)
    ends = [start for start, _, _ in starts[1:]] + [len(text)]
    return [(number, text[end:stop]) for (_, end, number), stop in zip(starts, ends)]


def item_titles(text: str) -> list[str]:
    """The title of every numbered item, in order, as a plan names it (repeats and all)."""
    titles = [_clean_title(body)[0] for _, body in _items(text)]
    return [title for title in titles if any(c.isalpha() for c in title)]


def _clean_title(body: str) -> tuple[str, int | None]:
    """A short title and the predicted length from an item's raw body (its first non-empty line)."""
    line = next((ln for ln in body.splitlines() if ln.strip(LEADING_JUNK + TRAILING_JUNK)), "")
    line = DOUBLED.sub("", line, count=1)
    title = "".join(c for c in line if c.isprintable()).replace("**", "").replace("__", "").replace("`", "")
    title = " ".join(title.split()).lstrip(LEADING_JUNK).rstrip(TRAILING_JUNK)
    predicted = None
    length = LENGTH.search(title)
    if length:
        predicted = int(length.group("a") or length.group("b") or length.group("c")) or None
        title = title[:length.start()].rstrip(TRAILING_JUNK)
    if len(title) > 1 and title[0] in "\"'“‘" and title[-1] in "\"'”’":
        title = title[1:-1].lstrip(LEADING_JUNK).rstrip(TRAILING_JUNK)
    return _shorten(_head(title)), predicted


def _head(title: str) -> str:
    """A title written as a head and its explanation ("Comfort: Comfortable and supportive") is
    its head, where the head is one to four words not ending in a number ("Day 2: Rome" stays)
    and the explanation is longer: the plan asked for short points, and the explanation is what
    the point's text is for."""
    head, colon, rest = title.partition(": ")
    words = head.split()
    if not colon or not 1 <= len(words) <= MAX_HEAD_WORDS or len(rest.split()) <= len(words):
        return title
    last = words[-1].lower()
    return title if last.isdigit() or last in NUMBER_WORDS else head.rstrip(TRAILING_JUNK)


def _shorten(title: str) -> str:
    """At most MAX_TITLE_WORDS words: the first sentence, else the first clause, else the first words."""
    for pattern in (SENTENCE_END, CLAUSE_BREAK):
        if len(title.split()) > MAX_TITLE_WORDS:
            title = pattern.split(title, maxsplit=1)[0].rstrip(TRAILING_JUNK)
    return " ".join(title.split()[:MAX_TITLE_WORDS]).rstrip(TRAILING_JUNK)
