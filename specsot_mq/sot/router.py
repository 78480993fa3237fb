"""Routing: does a question get a skeleton (SoT) or a plain direct answer?

Mode "auto" asks a classifier trained on labelled questions (sot/learned_router.py: the base
model's own representation of the question, one short forward, logistic regression), labelled in
the manner of Skeleton-of-Thought's router (SoT-R): plan where the answer is a set of independent
points (advice, knowledge, roleplay, common sense, counterfactuals, comparisons); go direct for
maths, code, estimates that need a chain of reasoning, short facts, rewriting or reading a given
text, and writing that needs one voice (a story, a poem, a letter). The labels ship as data
(sot/labels/, a train and a validation split).

A question the classifier would plan still goes direct when it asks for a short answer
(`short_answer`): a plan costs a skeleton of about 30-50 tokens decoded before any point starts,
and then its longest point, so it only pays where the direct answer would be longer than about
100 tokens (75 words); a question that bounds its answer below that ("in one sentence", "in under
50 words", "briefly") is answered faster without one.

DIRECT_RULES, the hand-written pattern table this project routed by before, remains only as the
fallback for a model whose representation the classifier cannot use (validation accuracy under
learned_router.MIN_ACCURACY, such as the tests' tiny random models): on the default model it
does not help (rules first, then the classifier: one question fewer right in cross-validation).
Mode "always" and "never" skip both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from specsot_mq.errors import SpecSotError

MODES = ("auto", "always", "never")


def check_mode(mode: str) -> None:
    """SpecSotError naming the modes where `mode` (a --sot value) is none of them."""
    if mode not in MODES:
        raise SpecSotError(f"--sot must be one of {', '.join(MODES)}, got {mode!r}")

_AUX = r"(?:is|are|was|were|do|does|did|can|could|will|would|should|shall|has|have|had|am|may|must)"

# (pattern, reason), tried in order, case-insensitive; the first match sends the question direct.
DIRECT_RULES = [
    (r"^\s*$", "empty question"),
    (r"```", "code: the question contains a code fence"),
    (r"\d\s*[+*×÷^=<>]\s*[\w(]|[\w)]\s*[+*×÷^=<>]\s*-?\d", "maths: an expression or equation"),
    (r"\b(calculate|compute|prove|probability|remainder|how many)\b|\bsolve\b[^.?!]*[0-9=]"
     r"|\d\s*%|\$\s?\d|\barea of\b|\bvalue of\b", "maths: a calculation or proof"),
    (r"\b(write|develop|create|give me)\s+(?:an?\s+|the\s+|some\s+)?(?:\w+\s+){0,3}?"
     r"(function|program|code|query|website|web page)\b"
     r"|\b(implement|debug|refactor)\b", "code: asks for a program"),
    (r"\b(python|javascript|typescript|java|golang|sql|html|css|bash|regex|regular expression)\b|c\+\+",
     "code: names a programming language"),
    (r"^\s*(?=(?:\S+\s+){0,6}\S+\s*$)(who|when|where|which|what\s+is|what's|how\s+much|how\s+old|"
     r"how\s+far|how\s+long|how\s+tall|define)\b", "one fact: a short factual question"),
    (rf"^\s*(?!(?:can|could|would|will)\s+you\b){_AUX}\b[^.?!\n]{{0,80}}\?\s*$", "one fact: a yes/no question"),
    (r"\b(rewrite|rephrase|translate|summari[sz]e|proofread|edit|paraphrase)\b", "rewriting a given text"),
    (r"[\"“][^\"”]{200,}[\"”]|:[ \t]*(?:\n[ \t]*)+\S[^\n]{199,}", "rewriting or reading a quoted passage"),
    (r"\bextract\b|\b(from|given|analy[sz]e|evaluate|read|classify|categori[sz]e) the following\b"
     r"|\b(passage|paragraph|article|text|data|reviews?|sentences?) below\b", "extraction from a given text"),
    (r"\b(json|csv|yaml|xml)\b", "extraction: asks for structured output"),
]
_COMPILED = [(re.compile(pattern, re.I), reason) for pattern, reason in DIRECT_RULES]

_FEW = r"(?:one|a single|two|three|1|2|3)"
# A bound on the answer's length below about 100 tokens: "in one sentence", "in under 50 words",
# "a one-line definition", "briefly", "keep it short", "answer in one word".
SHORT = re.compile(
    rf"\b(?:in|with|using|within|to)\s+(?:just\s+|only\s+)?{_FEW}\s+(?:short\s+)?(?:sentences?|lines?|words?)\b"
    r"|\b(?:one|single)[- ](?:line|sentence|word)\b|\bin a (?:single )?(?:sentence|line|word|tweet|nutshell)\b"
    r"|\b(?:in|with|using|within)\s+(?:under|fewer than|less than|no more than|at most|up to)\s+"
    r"(?P<words>\d{1,3})\s+words\b|\bin\s+(?P<words2>\d{1,2})\s+words\b"
    r"|\bbriefly\b|\bin brief\b|\bkeep it (?:short|brief)\b|\bshort answer\b|\btl;?dr\b",
    re.I,
)
SHORT_WORDS = 75  # a word bound below this is a short answer (about 100 tokens)


@dataclass(slots=True)
class Route:
    """Which way a question is answered, and why."""

    use_sot: bool  # True: skeleton then points; False: one direct answer
    reason: str  # what decided, for the logs and the chat's status line


def route(question: str, mode: str = "auto", classify=None) -> Route:
    """Decide SoT or direct for a question; mode is "auto", "always" or "never". `classify`:
    question -> Route, the learned router (learned_router.LearnedRouter), which mode "auto" needs;
    it applies short_answer itself."""
    check_mode(mode)
    if mode == "always":
        return Route(True, "--sot always")
    if mode == "never":
        return Route(False, "--sot never")
    if classify is None:
        raise SpecSotError("--sot auto needs the model's router: route where the model is (the engine, the skeleton stage)")
    return classify(question)


def rule_route(question: str) -> Route:
    """The fallback: the first row of DIRECT_RULES that matches sends the question direct, then
    short_answer; everything else is planned."""
    for pattern, reason in _COMPILED:
        if pattern.search(question):
            return Route(False, reason)
    if reason := short_answer(question):
        return Route(False, reason)
    return Route(True, "open question (pattern rules): the answer splits into independent points")


def short_answer(question: str) -> str | None:
    """Why planning would be slower than answering directly, where the question bounds its answer
    below about 100 tokens; None otherwise."""
    for m in SHORT.finditer(question):
        words = m.group("words") or m.group("words2")
        if words is None or int(words) < SHORT_WORDS:
            return f"direct, because planning would be slower: a short answer is asked for ({m.group(0).strip()!r})"
    return None
