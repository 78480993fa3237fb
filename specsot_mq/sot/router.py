"""Routing: does a question get a skeleton (SoT) or a plain direct answer?

The rule (mode "auto"): a question goes direct when its answer does not split into independent
points, which is when it
- is maths: digits with operators or an equation, "calculate", "compute", "solve" with numbers,
  "how many", "prove", probability, percentages, money amounts, areas, remainders;
- is code: "write a function/program/code/...", "implement", "debug", a language name (python,
  c++, sql, html, ...), a regex, a code fence;
- has a one-fact answer: a short question (fewer than 8 words) starting with who, when, where,
  which, what is, how much, how many, ..., or a short yes/no question ("Is ...?", "Can I ...?");
- rewrites a given text: rewrite, rephrase, translate, summarize, proofread, edit, paraphrase, or
  quotes a long passage;
- extracts from a given text: "extract", "from/given/analyze the following", "the paragraph
  below", or asks for JSON, CSV, YAML or XML.
Everything else goes SoT: explanations, lists, comparisons, advice, essays, plans, tips, ways,
steps, blog posts. The first matching row of DIRECT_RULES gives the reason; mode "always" and
"never" skip the table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from specsot_mq.errors import SpecSotError

MODES = ("auto", "always", "never")

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


@dataclass(slots=True)
class Route:
    """Which way a question is answered, and why."""

    use_sot: bool  # True: skeleton then points; False: one direct answer
    reason: str  # the rule that decided, for the logs and the chat's status line


def route(question: str, mode: str = "auto") -> Route:
    """Decide SoT or direct for a question; mode is "auto" (the rule above), "always" or "never"."""
    if mode == "always":
        return Route(True, "--sot always")
    if mode == "never":
        return Route(False, "--sot never")
    if mode != "auto":
        raise SpecSotError(f"unknown SoT mode '{mode}': use --sot auto|always|never")
    for pattern, reason in _COMPILED:
        if pattern.search(question):
            return Route(False, reason)
    return Route(True, "open question: the answer splits into independent points")
