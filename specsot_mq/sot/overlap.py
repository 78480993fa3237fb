"""What a point says, as a set of content words: the rules that keep a plan's points worth reading
(the parser and the merge apply them) and the overlap figures benchmarks/quality.py reports.

Content words are a text's lower-cased words minus function words and the words a request is
phrased with ("give", "list", "tips", "ways"), each cut to a rough stem ("hiking" -> "hik"), and
its numbers, number words as digits ("Day two" -> {"day", "2"}), so that overlap counts what two
texts are about, not how they are worded.
"""

from __future__ import annotations

import math
import re

WORD = re.compile(r"[a-z][a-z'-]*|[0-9]+")
# Function words and the words questions and plans are phrased with.
STOP = frozenset("""
a about above after again against all also am an and any are as at be because been before being below between
both but by can could did do does doing down during each either else ever every few for from further had has
have having he her here hers him his how i if in into is it its itself just least less let like many may me
might more most much must my myself neither no nor not now of off often on once one only or other our ours out
over own per rather really same shall she should since so some such than that the their them then there these
they this those though through thus to too under until up upon us very was we were what when where whether
which while who whom whose why will with within without would yet you your yours yourself
first second third fourth fifth last next
answer ask briefly compare consider describe detail discuss example explain give idea important key list main
mention name note outline plan point provide question reason share short step suggest summary tell thing tip
way write
""".split())
NUMBER_WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
                "eleven": 11, "twelve": 12}  # fmt: skip


def stem(word: str) -> str:
    """A rough stem: possessive, plural and -ing/-ed endings cut ("cities" -> "city", "boxes" ->
    "box", "hiking" -> "hik")."""
    word = word.strip("'-")
    if word.endswith("'s"):
        word = word[:-2]
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if word.endswith(("sses", "xes", "ches", "shes", "zes")):
        return word[:-2]
    for end in ("ing", "ed", "s"):
        if len(word) > len(end) + 2 and word.endswith(end) and not word.endswith("ss"):
            return word[: -len(end)]
    return word


def content_words(text: str) -> set[str]:
    """The stems of the text's content words, and its numbers as digits."""
    words = (str(NUMBER_WORDS.get(w, w)) for w in WORD.findall(text.lower()))
    return {stem(w) for w in words if w.strip("'-") not in STOP} - STOP - {""}


def jaccard(a: set, b: set) -> float:
    """|a & b| / |a | b| (0.0 for two empty sets)."""
    return len(a & b) / len(a | b) if a or b else 0.0


def same_point(a: str, b: str) -> bool:
    """Two titles say the same thing: they share at least 60% of their content words together
    ("Upgrade your living room" and "Living room upgrades"), or the content words of one hold all
    of the other's, two or more ("Comfortable train seats" and "Train seats"; not "Aria's voice"
    and "Aria", a topic its points may each name)."""
    wa, wb = content_words(a), content_words(b)
    if not wa or not wb:
        return a.casefold().strip() == b.casefold().strip()
    small, large = sorted((wa, wb), key=len)
    return jaccard(wa, wb) >= 0.6 or (len(small) >= 2 and small <= large)


def restates(title: str, question: str) -> bool:
    """A title that only restates the question: every content word of it is in the question, and
    it holds at least three quarters of the question's ("Staying healthy" for "Give me three tips
    for staying healthy."; not "Cats" for "Compare cats and dogs as pets.")."""
    words = content_words(title)
    asked = {w for w in content_words(question) if not w.isdigit()}  # "three tips": a count, not a topic
    return bool(words) and words <= asked and len(words) >= math.ceil(0.75 * len(asked))


def says_nothing(text: str, question: str, title: str) -> bool:
    """A point's text with no content word beyond its question's and its title's: empty, or only
    saying again what was asked."""
    return not (content_words(text) - content_words(question) - content_words(title))
