"""Prompt formats as data files: `<name>.json` beside this module, or a user's own file (any path
ending in .json: `--prompt-format my_format.json`, read once per process)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from specsot_mq.errors import SpecSotError
from specsot_mq.sot.ordered import merge_points
from specsot_mq.sot.parser import Plan, asked_count, parse_plan_direct, parse_skeleton
from specsot_mq.tokenizer import chat_prompt_ids

# How each format's skeleton is read (see sot/parser.py).
PARSERS = {"numbered": parse_skeleton, "plan_direct": parse_plan_direct}

FOLDER = Path(__file__).parent


@dataclass(frozen=True, slots=True)
class PromptFormat:
    """One format's templates; {question}, {skeleton}, {index}, {title} are filled in (the point's
    user text may name its point too: what differs between points must come late in the prompt,
    since the points share the prompt's common beginning)."""

    name: str
    skeleton_user: str
    skeleton_prefix: str  # the assistant's answer starts with this (prefilled, not generated)
    point_user: str
    point_prefix: str
    parser: str = "numbered"  # a key of PARSERS
    skeleton_stop: tuple[str, ...] = ()  # where the skeleton ends besides the point cap (generated text)
    point_stop: tuple[str, ...] = ()  # where a point ends besides the next point's number
    examples: tuple[tuple[str, str], ...] = ()  # (question, skeleton) turns shown before the question
    points: str = "3 to 8"  # how many points the skeleton asks for ({points} in skeleton_user)
    points_counted: str = "exactly {count}"  # the same where the question names its number of points
    # a direct answer's request where the skeleton of a question that names its number of points
    # is no usable plan (Flow.parse): the question, then that number asked for
    counted_direct: str = "{question}"
    # the point's request where the question names its number of points: each of them is to say
    # what sets it apart (point_ids)
    point_counted: str = ""
    # other sets of worked examples (none is a set too): the prompts a counted skeleton that lists
    # too few distinct points is asked again with, all in one batch (flow.Skeletoning.next_round)
    variants: tuple[tuple[tuple[str, str], ...], ...] = ()
    # the request a point left out of a counted answer is written again from ({question} and its
    # {title}, no plan: again_ids); "" = none is written again (sot/ordered.py)
    point_again: str = ""

    def plan(self, skeleton: str, max_points: int, question: str = "") -> Plan:
        """The skeleton's text (prefilled part included) read into a Plan; never raises on text.
        `question`: the question it plans (its points must not restate it)."""
        return PARSERS[self.parser](skeleton, max_points, question)

    def merge(self, points, question: str = "", cut=(), first: int | None = None) -> str:
        """The answer from (index, title, expansion) triples in plan order: each point's prefilled
        beginning, then what the model wrote after it, without a last line that repeats one of
        its earlier lines (where the point's loop stop ended it) and trailing whitespace; a point
        in `cut` (a cap or a loop stop ended it) keeps its complete sentences, and a point that
        says nothing beyond the question and its title is left out; `first`: how many of the
        points are the plan's, the rest written again (sot/ordered.py)."""
        return merge_points(self, points, question, cut, first)

    def skeleton_ids(self, tokenizer, question: str, history: list[dict] = (), count: int | None = None,
                     examples: tuple[tuple[str, str], ...] | None = None) -> list[int]:  # fmt: skip
        """Chat prompt for the skeleton, ending inside the assistant turn after the prefix: the
        worked examples, the conversation's earlier turns, then the planning request for the
        question (a system message of the conversation comes first); `count`: the number of
        points the question names, which the request then asks for; `examples`: other worked
        examples than the format's (one of its variants)."""
        system, earlier = split_system(history)
        turns = list(system)
        # an example that names its count is asked as the question would be
        for q, skeleton in self.examples if examples is None else examples:
            shown = skeleton.count("\n") + 1
            asked = self.points_counted.format(count=shown) if asked_count(q) else self.points
            turns += [{"role": "user", "content": self.skeleton_user.format(question=q, points=asked)},
                      {"role": "assistant", "content": skeleton}]  # fmt: skip
        points = self.points if count is None else self.points_counted.format(count=count)
        turns += [*earlier, {"role": "user", "content": self.skeleton_user.format(question=question, points=points)}]
        ids = chat_prompt_ids(tokenizer, turns)
        return ids + tokenizer.encode(self.skeleton_prefix, add_special_tokens=False)

    def skeleton_heads(self, tokenizer) -> list[list[int]]:
        """The tokens every skeleton prompt begins with, whatever the question (system prompt,
        instructions, worked examples, the request up to its number of points): one for a
        question that names no number of points, one for a question that does (the request words
        it differently), and one for each variant's counted request: each worth computing once
        (Generator.keep_prefix)."""

        def counted(examples=None):
            return common_prefix([self.skeleton_ids(tokenizer, "Why?", count=n, examples=examples) for n in (2, 5, 10)])

        return [fixed_beginning(lambda q: self.skeleton_ids(tokenizer, q)), counted(), *map(counted, self.variants)]

    def answer_heads(self, tokenizer) -> list[list[int]]:
        """The tokens every point prompt, and every direct answer's prompt, begins with whatever
        the question (the system prompt and the instructions up to the question): each worth
        computing once where points and direct answers are decoded."""
        return [fixed_beginning(lambda q: self.point_ids(tokenizer, q, "1. A", 1, "A")),
                fixed_beginning(lambda q: direct_ids(tokenizer, q))]  # fmt: skip

    def point_ids(self, tokenizer, question: str, skeleton: str, index: int, title: str,
                  history: list[dict] = ()) -> list[int]:  # fmt: skip
        """Chat prompt that expands one point, prefilled with the point's number and title: the
        conversation's system message and earlier questions (not its earlier answers: a small
        model copies them into unrelated points, and the plan already says what the point is
        about), then the request for this point (point_counted's, where the question names its
        number of points and the format has one)."""
        fields = {"question": question, "skeleton": skeleton, "index": index, "title": title}
        user = self.point_counted if self.point_counted and asked_count(question) else self.point_user
        return self._point_prompt(tokenizer, user, fields, history)

    def again_ids(self, tokenizer, question: str, index: int, title: str, history: list[dict] = ()) -> list[int]:
        """Chat prompt that writes a point again (point_again's request, then the point's
        prefill), with the conversation's system message and earlier questions as point_ids."""
        fields = {"question": question, "skeleton": "", "index": index, "title": title}
        return self._point_prompt(tokenizer, self.point_again, fields, history)

    def _point_prompt(self, tokenizer, user: str, fields: dict, history: list[dict]) -> list[int]:
        """A point's chat prompt: the conversation's system message and earlier questions, the
        request `user` with `fields`, then the point's prefill."""
        earlier = [m for m in history if m["role"] != "assistant"]
        ids = chat_prompt_ids(tokenizer, [*earlier, {"role": "user", "content": user.format(**fields)}])
        return ids + tokenizer.encode(self.point_prefix.format(**fields), add_special_tokens=False)


def direct_ids(tokenizer, question: str, history: list[dict] = ()) -> list[int]:
    """Chat prompt of a direct answer: the conversation's earlier turns, then the question."""
    return chat_prompt_ids(tokenizer, [*history, {"role": "user", "content": question}])


def history_end(build, history: list[dict]) -> int:
    """How many tokens of a phase's prompt, `build(history)`, cover the conversation's earlier
    turns: the part the next turn's prompt (with this turn added to its history) begins with too,
    worth keeping in the prefix store. 0 without earlier turns."""
    if not history:
        return 0
    later = [*history, {"role": "user", "content": "?"}, {"role": "assistant", "content": "."}]
    return len(common_prefix([build(list(history)), build(later)]))


ROLES = ("system", "user", "assistant")


def check_history(history) -> list[dict]:
    """A conversation's earlier turns as the prompts take them, [{"role", "content"}], or
    SpecSotError naming what is wrong."""
    if not isinstance(history, list):
        raise SpecSotError(f"the earlier turns must be a list of {{'role', 'content'}} messages, not {type(history).__name__}")
    for n, m in enumerate(history):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise SpecSotError(f"earlier turn {n} must be {{'role': ..., 'content': ...}} and nothing else")
        if m["role"] not in ROLES or not isinstance(m["content"], str):
            raise SpecSotError(f"earlier turn {n}: role must be one of {', '.join(ROLES)} and content a string")
    return history


def with_system(history: list[dict], system: str | None) -> list[dict]:
    """`history` with the system message `system` first (the --system flags, chat's /set system),
    unless `system` is blank or the history brings a system message of its own."""
    text = (system or "").strip()
    if not text or any(m["role"] == "system" for m in history):
        return list(history)
    return [{"role": "system", "content": text}, *history]


def split_system(history: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the system messages, the other turns) of a conversation's earlier turns."""
    return [m for m in history if m["role"] == "system"], [m for m in history if m["role"] != "system"]


def fixed_beginning(prompt_ids) -> list[int]:
    """The tokens that prompt_ids(question) begins with whatever the question."""
    return common_prefix([prompt_ids(q) for q in ("Why?", "List three colours.")])


def common_prefix(prompts: list[list[int]]) -> list[int]:
    """The longest beginning all the token lists have in common."""
    first = prompts[0]
    n = min(map(len, prompts))
    for other in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], other)) if a != b), n)
    return first[:n]


@cache
def load_format(name: str = "sot") -> PromptFormat:
    """A shipped format by name (sot, plan), or a format file by its path (ending in .json: a
    copy of a shipped one, changed). Raises SpecSotError naming what is wrong."""
    if name.endswith(".json"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise SpecSotError(f"prompt format file {name} not found: give the path of a JSON file like "
                               f"{FOLDER / 'sot.json'}, or a shipped format's name ({shipped_formats()})")  # fmt: skip
    else:
        path = FOLDER / f"{name}.json"
        if not path.exists():
            raise SpecSotError(f"unknown prompt format '{name}': use one of {shipped_formats()}, or a format file's "
                               "path (.json)")  # fmt: skip
    try:
        data = json.loads(path.read_text())
        skeleton, point = data["skeleton"], data["point"]
        fmt = PromptFormat(
            data.get("name", path.stem),
            skeleton["user"],
            skeleton["assistant_prefix"],
            point["user"],
            point["assistant_prefix"],
            data.get("parser", "numbered"),
            tuple(skeleton.get("stop", ())),
            tuple(point.get("stop", ())),
            examples(skeleton.get("examples", ())),
            skeleton.get("points", "3 to 8"),
            skeleton.get("points_counted", "exactly {count}"),
            data.get("counted_direct", "{question}"),
            point.get("user_counted", ""),
            tuple(map(examples, skeleton.get("variants", ()))),
            point.get("user_again", ""),
        )
    except (OSError, ValueError) as e:
        raise SpecSotError(f"prompt format {path} cannot be read ({e}): fix the file") from None
    except (KeyError, TypeError, AttributeError) as e:
        raise SpecSotError(f"prompt format {path} lacks {e} or has it in the wrong shape: it needs skeleton.user, "
                           "skeleton.assistant_prefix, point.user and point.assistant_prefix, as in "
                           f"{FOLDER / 'sot.json'}") from None  # fmt: skip
    if fmt.parser not in PARSERS:
        raise SpecSotError(f"prompt format {path} names parser '{fmt.parser}': use one of {', '.join(PARSERS)}")
    # each template formatted once with the fields it is given (skeleton_ids, point_ids, Flow.assign)
    a_point = {"question": "Q?", "skeleton": "1. A", "index": 1, "title": "A"}
    templates = (("skeleton.user", fmt.skeleton_user, {"question": "Q?", "points": "3 to 8"}),
                 ("skeleton.points_counted", fmt.points_counted, {"count": 3}),
                 ("point.user", fmt.point_user, a_point), ("point.user_counted", fmt.point_counted, a_point),
                 ("point.assistant_prefix", fmt.point_prefix, a_point),
                 ("point.user_again", fmt.point_again, {"question": "Q?", "index": 1, "title": "A"}),
                 ("counted_direct", fmt.counted_direct, {"question": "Q?", "count": 3}))  # fmt: skip
    for key, template, fields in templates:
        if not isinstance(template, str):
            raise SpecSotError(f"prompt format {path}: {key} must be a string, got {template!r}")
        try:
            template.format(**fields)
        except (KeyError, IndexError, ValueError) as e:
            named = ", ".join("{" + f + "}" for f in fields)
            raise SpecSotError(f"prompt format {path}: {key} has a bad placeholder ({e!r}); "
                               f"its fields are {named}") from None
    return fmt


def shipped_formats() -> str:
    """The names of the formats beside this module, for an error message (the folder's other data
    file, train_questions.json, is none)."""
    return ", ".join(sorted(p.stem for p in FOLDER.glob("*.json") if '"skeleton"' in p.read_text()))


def examples(listed: list[dict]) -> tuple[tuple[str, str], ...]:
    """A format file's worked examples as (question, skeleton) pairs."""
    return tuple((e["question"], e["skeleton"]) for e in listed)
