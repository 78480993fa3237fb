"""A request's Skeleton-of-Thought flow, written once:

    route -> skeleton -> parse -> (direct | schedule -> points) -> merge

as pure steps over the wire messages (specsot_mq/messages.py), with no model and no sockets:

    flow = Flow(SoTConfig(), tokenizer)
    first = flow.route(ask)                 # a Skeleton (the direct way), or a Skeletoning to decode
                                            # (Flow(..., router=LearnedRouter) routes --sot auto)
    skeleton = first.done()                 # after first.add(key, delta) for each delta of its jobs,
                                            # then next_round() (a counted list short of points: its variants)
    planned = flow.parse(skeleton)          # the points, or the direct way
    plan, prompts = flow.assign(planned, devices)  # a MergePlan, and the points' prompts
    merging = Merging(flow.format)          # fed MergePlan, PointText, PointEnd, Reassign and Again,
    events = merging.feed(msg, src)         # returns what the client sees next, Answer last
                                            # (and an Again: points to write again, flow.again)

The stage processes run one step each (stages/skeleton|parse|schedule|branch|merge.py); the
in-process engine (sot/engine.py) runs them in turn on one generator. A client gets the same
events either way: SkeletonText, MergePlan, PointText, PointEnd, AnswerText, then Answer.

The steps up to the prompts need no model, so parse, schedule and merge run them without torch:
only the jobs (generate.Job) a device decodes import the decoding side.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from specsot_mq.errors import RAISE_MAX_LEN, PromptTooLong, SpecSotError
from specsot_mq.messages import (
    Again, Answer, AnswerText, Ask, BranchTask, MergePlan, Planned, PointEnd, PointText, Reassign, Skeleton, SkeletonText,
    ids,
)  # fmt: skip
from specsot_mq.prompts import common_prefix, direct_ids, history_end, load_format
from specsot_mq.sampling_params import SamplingParams
from specsot_mq.sot.ordered import CUT_OFF, OrderedAnswer, dropped_points
from specsot_mq.sot.parser import SPARE, Plan, Point, asked_count, item_starts, item_titles
from specsot_mq.sot.router import Route, check_mode, route
from specsot_mq.sot.scheduler import DeviceProfile, schedule

if TYPE_CHECKING:
    from specsot_mq.generate import Delta, Job

# A skeleton line this long is a paragraph, not a point (a title is at most parser.MAX_TITLE_WORDS
# words; with a short explanation after it, as SmolLM2 sometimes writes, about half this)
SKELETON_LINE_CHARS = 200


@dataclass(slots=True)
class SoTConfig:
    """How a request's answer is split and bounded."""

    sot: str = "auto"  # auto | always | never (see sot/router.py)
    prompt_format: str = "sot"
    max_points: int = 8  # a question that names its number of points gets that many (up to parser.MOST_ASKED)
    max_parallel: int = 8  # points decoding at once (cache slots)
    skeleton_tokens: int = 128
    point_tokens: int = 160

    def __post_init__(self):
        if self.prompt_format.endswith(".json"):  # a user's format file: the same file for every stage process
            self.prompt_format = str(Path(self.prompt_format).expanduser().resolve())
        load_format(self.prompt_format)  # an unknown name or a bad file fails here, saying what is wrong
        check_mode(self.sot)
        for flag, value, low in (("--max-points", self.max_points, 2), ("--max-parallel", self.max_parallel, 1),
                                 ("--skeleton-tokens", self.skeleton_tokens, 1), ("--point-tokens", self.point_tokens, 1)):
            if value < low:
                raise SpecSotError(f"{flag} must be at least {low}, got {value}")


@dataclass(slots=True)
class Progress:
    """One decoding job's counts so far (a skeleton, a point), for its request's stats."""

    started: float = field(default_factory=time.monotonic)  # when it was queued
    tokens: int = 0
    steps: int = 0  # the loop's deltas it got: decoder steps that gave it tokens

    def add(self, delta: Delta) -> None:
        self.tokens += len(delta.token_ids)
        self.steps += delta.steps

    def seconds(self) -> float:
        return time.monotonic() - self.started

    def stats(self) -> dict:
        return {"tokens": self.tokens, "steps": self.steps, "seconds": self.seconds()}


@dataclass(slots=True)
class Skeletoning:
    """A request whose skeleton is being decoded: its job (then, for a counted list short of
    points, its variants' jobs: next_round), and the text so far."""

    ask: Ask
    reason: str  # why the router sent it the SoT way
    job: Job
    text: str  # its prefilled beginning, then what the job wrote (and the new points of its variants)
    stats: dict  # the request's prompt size
    fmt: object
    progress: Progress = field(default_factory=Progress)
    finish: str = "stop"  # how the first job ended
    running: set = field(default_factory=set)  # keys of this round's jobs not yet ended
    variants: dict = field(default_factory=dict)  # a variant job's key -> [its text so far, how it ended]
    asked_again: bool = False  # whether its variants were asked (next_round)

    def __post_init__(self):
        self.running.add(self.job.key)

    def first(self) -> SkeletonText:
        """The skeleton's prefilled beginning, for the client."""
        return SkeletonText(self.ask.rid, self.text, ids([]))

    def add(self, key, delta: Delta) -> SkeletonText | None:
        """Job `key`'s new tokens; the client's next text, if any (a variant's text is shown
        only as the new points it lists, when its round ends)."""
        self.progress.add(delta)
        if delta.finish_reason:
            self.running.discard(key)
        text = skeleton_text(self.fmt, delta)
        if key in self.variants:
            self.variants[key][0] += text
            self.variants[key][1] = delta.finish_reason or self.variants[key][1]
            return None
        self.finish = delta.finish_reason or self.finish
        self.text += text
        return SkeletonText(self.ask.rid, text, ids(delta.token_ids)) if text or delta.token_ids else None

    def next_round(self, tokenizer) -> tuple[SkeletonText | None, list[Job]]:
        """Once every job of the round has ended: the jobs of the next one, and the text it adds.

        A counted skeleton that ended ("stop") with fewer distinct points than its question
        names (a small model stops early, or loops on a point, which the parser drops) is asked
        again, once, with each of the format's variants (other worked examples, none among them):
        one prompt each, decoded together, each greedily as the loop decodes any prompt, so every
        list is one lossless output of its own prompt and no token of one is changed. The points
        of theirs that are new (the parser would keep them after those so far: not a repeat, not
        a restatement of the question) are then added to the skeleton, numbered on from its last
        item, up to the count and SPARE; that text is the round's. A list with enough points,
        one cut off (a length cap, a loop), an uncounted one, or too few tokens left: no round."""
        if self.running:
            return None, []
        if self.variants:  # the variants' round ended: their new points
            more = self._new_points()
            self.variants = {}
            return (SkeletonText(self.ask.rid, more, ids(tokenizer.encode(more, add_special_tokens=False))) if more
                    else None), []  # fmt: skip
        count, fmt = asked_count(self.ask.question), self.fmt
        left = self.job.params.max_tokens - self.progress.tokens
        if not count or not fmt.variants or self.finish != "stop" or left < 8 * len(fmt.variants):
            return None, []
        plan = fmt.plan(self.text, count + SPARE, self.ask.question)
        if plan.kind == "plan" and len(plan.points) >= count:
            return None, []
        rid, history = self.ask.rid, self.ask.history
        params = replace(self.job.params, max_tokens=left // len(fmt.variants))
        jobs = [replace(self.job, key=(rid, n), ids=fmt.skeleton_ids(tokenizer, self.ask.question, history, count, examples),
                        params=params, shared=0, group=None, keep=0, resume=None)  # fmt: skip
                for n, examples in enumerate(fmt.variants, 1)]
        self.variants = {job.key: [fmt.skeleton_prefix, "stop"] for job in jobs}
        self.running, self.asked_again = {job.key for job in jobs}, True
        return None, jobs

    def _new_points(self) -> str:
        """The variants' points that the parser keeps after the skeleton's own, as numbered
        lines to add to it (none past the count and SPARE)."""
        question, fmt = self.ask.question, self.fmt
        want = asked_count(question) + SPARE
        text, added = self.text, ""
        kept = len(fmt.plan(text, want, question).points)
        starts = item_starts(text)
        number = starts[-1][2] + 1 if starts else 1
        for listed, finish in self.variants.values():
            for title in item_titles(finished_lines(listed, finish)):
                if kept >= want:
                    break
                line = f"\n{number}. {title}"
                now = len(fmt.plan(text + line, want, question).points)  # (a list of one point is none)
                if now > kept:
                    text, added, kept, number = text + line, added + line, now, number + 1
        self.text = text
        return added

    def done(self) -> Skeleton:
        ask = self.ask
        again = {"variants": len(self.fmt.variants)} if self.asked_again else {}
        stats = self.stats | {"skeleton": self.progress.stats() | again}
        return Skeleton(ask.rid, ask.question, ask.params, "sot", self.reason, self.text, stats, self.finish, ask.history)


class Flow:
    """The steps of a request, over one prompt format and tokenizer (parse needs no tokenizer);
    `router`: question -> Route for --sot auto (learned_router.LearnedRouter, where the model is)."""

    def __init__(self, config: SoTConfig, tokenizer=None, router: Callable[[str], Route] | None = None):
        self.config, self.tokenizer, self.router = config, tokenizer, router
        self.format = load_format(config.prompt_format)

    def decide(self, ask: Ask) -> Route:
        """Which way the question goes (the router's forward, for --sot auto). Raises
        SpecSotError on a bad `ask.sot`."""
        return route(ask.question, ask.sot, self.router)

    def route(self, ask: Ask, decision: Route | None = None, capacity: int | None = None) -> Skeleton | Skeletoning:
        """Direct (a Skeleton with no text), or the skeleton to decode; `decision`: decide(ask)
        if already made; `capacity`: the cache's tokens per sequence, past which a skeleton the
        router chose goes direct. Raises SpecSotError on a bad `ask.sot`."""
        from specsot_mq.generate import Job

        decision = decision or self.decide(ask)
        # The request's prompt size as a plain chat server counts it (the API's usage.prompt_tokens).
        stats = {"prompt_tokens": len(direct_ids(self.tokenizer, ask.question, ask.history))}
        fmt, tok, count = self.format, self.tokenizer, points_asked(ask.question)
        prompt = fmt.skeleton_ids(tok, ask.question, ask.history, count) if decision.use_sot else []
        if decision.use_sot and ask.sot == "auto" and capacity is not None and len(prompt) > capacity:
            decision = Route(False, f"the skeleton's prompt ({len(prompt)} tokens) would not fit the cache ({capacity})")
        if not decision.use_sot:
            return Skeleton(ask.rid, ask.question, ask.params, "direct", decision.reason, "", stats, history=ask.history)
        keep = history_end(lambda h: fmt.skeleton_ids(tok, ask.question, h, count), ask.history)
        job = Job((ask.rid, 0), prompt, skeleton_params(self.config, ask.params, count), keep=keep)
        return Skeletoning(ask, decision.reason, job, fmt.skeleton_prefix, stats, fmt)

    def prompt_size(self, ask: Ask) -> int:
        """Tokens of the longest prompt a request must fit: its direct answer's, and with --sot
        always its skeleton's (with auto a skeleton too long goes direct). Raises SpecSotError on
        a bad `ask.sot`."""
        check_mode(ask.sot)
        sizes = [len(direct_ids(self.tokenizer, ask.question, ask.history))]
        if ask.sot == "always":
            count = points_asked(ask.question)
            sizes.append(len(self.format.skeleton_ids(self.tokenizer, ask.question, ask.history, count)))
        return max(sizes)

    def check_fits(self, ask: Ask, capacity: int, fix: str = RAISE_MAX_LEN) -> None:
        """Raise PromptTooLong, saying `fix`, where the request's longest prompt (prompt_size)
        cannot fit a cache slot of `capacity` tokens; SpecSotError on a bad `ask.sot`."""
        size = self.prompt_size(ask)
        if size > capacity:
            raise PromptTooLong.of(size, capacity, fix)

    def parse(self, msg: Skeleton, plan: Callable[[str], Plan] | None = None) -> Planned:
        """The skeleton's plan of points, or the direct way when it is not a usable list; `plan`:
        a replacement parser (text -> Plan). As many points as the question names, where it
        names a number (and SPARE more, where the skeleton lists them: merge shows the first of
        them that say something); else at most max_points. A counted question whose skeleton is
        no usable plan goes direct asking for its count (Planned.count: the format's
        counted_direct request after the question). One whose plan has fewer distinct points than
        it names keeps them: sending those direct too gave few more answers with their count,
        each slower (figures in docs/design.md)."""
        mode, reason, points, asked = msg.mode, msg.reason, [], 0
        if mode == "sot":
            text = finished_lines(msg.text, msg.finish)
            most = points_asked(msg.question) or self.config.max_points
            parsed = plan(text) if plan is not None else self.format.plan(text, most, msg.question)
            if parsed.kind == "plan":
                points = [(p.index, p.title, p.predicted_tokens or 0) for p in parsed.points]
                reason = parsed.reason or "planned"
            else:  # a counted question's direct answer is asked for its count (assign)
                mode, reason, asked = "direct", f"skeleton says direct: {parsed.reason}", asked_count(msg.question) or 0
        return Planned(msg.rid, msg.question, msg.params, mode, reason, msg.text, points, msg.stats, msg.history, asked)

    def assign(self, msg: Planned, devices: list[DeviceProfile], capacity: int | None = None) -> tuple[MergePlan, AnswerPrompts]:
        """The points spread over the devices, longest predicted first (LPT; a direct answer goes
        whole to the first device; the plan's `branches` says which device decodes which points),
        with their prompts: one shared prefix, a short suffix each. `capacity`: the cache's tokens
        per sequence; a plan whose longest point prompt is longer goes direct (the request's
        direct prompt was checked to fit when it came in)."""
        fmt, tok = self.format, self.tokenizer
        if msg.mode == "sot":
            plan = Plan("plan", [Point(i, title, predicted or None) for i, title, predicted in msg.points])
            prefix, suffixes = point_prompts(tok, fmt, msg.question, plan, msg.history)
            longest = len(prefix) + max(map(len, suffixes.values()))
            if capacity is not None and longest > capacity:
                reason = f"the points' prompts ({longest} tokens) would not fit the cache ({capacity})"
                msg = msgspec.structs.replace(msg, mode="direct", reason=reason)  # the prompt the gateway checked
        if msg.mode != "sot":
            asked = fmt.counted_direct.format(question=msg.question, count=msg.count) if msg.count else msg.question
            prompt = direct_ids(tok, asked, msg.history)
            plan = MergePlan(msg.rid, "direct", msg.reason, "", [(0, "")], {devices[0].name: [0]}, msg.stats,
                             msg.question)  # fmt: skip
            # The whole prompt is kept: the next turn's begins with it (this question, then its
            # answer); not where the question was asked for its count (the history holds it as asked).
            keep = history_end(lambda h: direct_ids(tok, asked, h), msg.history) if msg.count else len(prompt)
            return plan, AnswerPrompts(msg.rid, msg.params, [], {0: prompt}, keep)
        assignments = [a for a in schedule(plan.points, devices) if a.point_indices]
        merge_plan = MergePlan(msg.rid, "sot", msg.reason, msg.skeleton, [(p.index, p.title) for p in plan.points],
                               {a.device: a.point_indices for a in assignments}, msg.stats, msg.question)  # fmt: skip
        first = plan.points[0]
        keep = history_end(lambda h: fmt.point_ids(tok, msg.question, "", first.index, first.title, h), msg.history)
        return merge_plan, AnswerPrompts(msg.rid, point_params(self.config, msg.params, plan), prefix, suffixes, keep)

    def again(self, msg: Planned, again: Again) -> AnswerPrompts:
        """The prompts of points written again (Again.points: a counted answer's points that said
        nothing; the format's point_again), with the plan's point settings: one shared prefix,
        a short suffix each."""
        fmt, tok = self.format, self.tokenizer
        prefix, suffixes = shared_prefix({new: fmt.again_ids(tok, msg.question, index, title, msg.history)
                                          for new, index, title in again.points})  # fmt: skip
        plan = Plan("plan", [Point(i, title, predicted or None) for i, title, predicted in msg.points])
        return AnswerPrompts(msg.rid, point_params(self.config, msg.params, plan), prefix, suffixes, 0)


@dataclass(slots=True)
class AnswerPrompts:
    """A request's answer prompts: the prefix they all begin with and each point's suffix (a
    direct answer: point 0, its whole prompt the suffix), their settings, and how many of their
    first tokens are worth keeping for the conversation's next turn (Job.keep)."""

    rid: str
    params: SamplingParams
    prefix: list[int]
    suffixes: dict[int, list[int]]  # point index -> the rest of its prompt
    keep: int

    def prompt(self, index: int) -> list[int]:
        """A point's whole prompt: the prefix, then its suffix."""
        return self.prefix + self.suffixes[index]

    def jobs(self, indices: list[int]) -> list[Job]:
        """These points' prompts, in this order, as jobs of one prefix group (the prefix computed
        once), for a device to decode."""
        from specsot_mq.generate import Job

        return [Job((self.rid, i), self.prompt(i), self.params, len(self.prefix), self.rid, self.keep) for i in indices]

    def task(self, indices: list[int]) -> BranchTask:
        """These points' prompts as the message for the branch stage that decodes them."""
        return BranchTask(self.rid, self.params, ids(self.prefix), indices, [ids(self.suffixes[i]) for i in indices],
                          self.keep)  # fmt: skip

    @classmethod
    def of(cls, task: BranchTask) -> AnswerPrompts:
        """A branch stage's task as received."""
        suffixes = {i: s.tolist() for i, s in zip(task.indices, task.suffixes)}
        return cls(task.rid, task.params, task.prefix.tolist(), suffixes, task.keep)


@dataclass(slots=True)
class Merging:
    """A request's points as they arrive, merged into its answer: fed MergePlan, PointText,
    PointEnd and Reassign (from `src`, a branch stage), it returns the messages for the client,
    the whole Answer last. A point's first text can overtake the plan (they come from different
    stages). After a Reassign only the new stage's messages about those points count. A counted
    answer short of its count once every point ended returns an Again without a stage: the
    points it left out, under new indices, for the caller to have written again (Flow.again);
    the Again that names their stage comes back through feed, and the answer waits for them.
    `merge`: a replacement merger (plan, texts -> answer), whose answer is streamed whole at the end."""

    fmt: object
    merge: Callable[[MergePlan, dict[int, str]], str] | None = None
    plan: MergePlan | None = None
    texts: dict[int, list[str]] = field(default_factory=dict)  # point index -> its text so far, in pieces
    ends: dict[int, PointEnd] = field(default_factory=dict)  # point index -> how it ended
    ordered: OrderedAnswer | None = None  # the merged answer's text released so far (a planned answer)
    owner: dict[int, str] = field(default_factory=dict)  # point index -> the branch stage that decodes it
    again: list[tuple[int, str]] = field(default_factory=list)  # (index, title) of the points written again
    released: int = 0  # characters of a direct answer sent as AnswerText (a redo sends only what goes beyond)
    done: bool = False

    def feed(self, msg, src: str) -> list:
        out = []
        if isinstance(msg, Reassign):  # points that start again on another stage: what they wrote is dropped
            for index in msg.indices:
                self.owner[index] = msg.stage
                self.texts.pop(index, None)
                self.ends.pop(index, None)
                if self.ordered is not None:
                    self.ordered.restart(index)
            return [msg]
        if isinstance(msg, Again):  # the branch stage that writes them again
            self.owner |= {index: msg.stage for index, _, _ in msg.points}
            return [msg]
        if isinstance(msg, (PointText, PointEnd)) and self.owner.get(msg.index, src) != src:
            return []  # from a stage that no longer decodes this point (it died; its last messages arrive late)
        streams = self.merge is None
        if isinstance(msg, MergePlan):
            self.plan = msg
            self.owner = {i: stage for stage, indices in msg.branches.items() for i in indices} | self.owner
            out.append(msg)
            if streams and msg.mode == "sot":  # what arrived before the plan is released now
                self.ordered = OrderedAnswer(self.fmt, [(i, t) for i, t in msg.points], msg.question)
                out += [self.ordered.add(index, "".join(parts)) for index, parts in self.texts.items()]
                out += [self.ordered.end(index, end.finish) for index, end in self.ends.items()]
            elif streams:
                out.append(self._direct_text())
            out += list(self.ends.values())
        elif isinstance(msg, PointText):
            self.texts.setdefault(msg.index, []).append(msg.text)
            out.append(msg)
            if self.ordered is not None:
                out.append(self.ordered.add(msg.index, msg.text))
            elif self.plan is not None and streams:
                out.append(self._direct_text())
        elif isinstance(msg, PointEnd):
            self.ends[msg.index] = msg
            if self.plan is not None:
                out.append(msg)
            if self.ordered is not None:
                out.append(self.ordered.end(msg.index, msg.finish))
        if self.ordered is not None and (left_out := self.ordered.again()):
            # a counted answer short of its count: the points it left out are written again
            base = max(i for i, _ in self.plan.points)
            again = [(base + n, index, self.ordered.titles[index]) for n, index in enumerate(left_out, 1)]
            self.again = [(new, title) for new, _, title in again]
            out += [self.ordered.extend(self.again), Again(msg.rid, again)]
        # Released answer text (strings) goes out as AnswerText, where there is any.
        out = [AnswerText(msg.rid, m) if isinstance(m, str) else m for m in out if m != ""]
        return out + self._answer()

    def _direct_text(self) -> str:
        """A direct answer's new text: what its point wrote beyond what was sent (after a redo on
        another stage, greedy decoding writes the same again)."""
        text = "".join(self.texts.get(0, []))
        new = text[self.released :]
        self.released = max(self.released, len(text))
        return new

    def _answer(self) -> list:
        plan = self.plan
        if plan is None or self.done or len(self.ends) < sum(len(v) for v in plan.branches.values()) + len(self.again):
            return []
        self.done = True
        texts = {i: "".join(parts) for i, parts in self.texts.items()}
        ends = self.ends.values()
        stats = dict(plan.stats)
        stats["points" if plan.mode == "sot" else "direct"] = {
            "tokens": sum(e.tokens for e in ends), "steps": sum(e.steps for e in ends),
            "seconds": max((e.seconds for e in ends), default=0.0)}  # fmt: skip
        if shipped := sum(e.kv_shipped for e in ends):
            stats["kv_shipped_tokens"] = shipped  # prompt tokens not recomputed: their KV came from another device
        listed = [*plan.points, *self.again]
        points = [(i, title, texts.get(i, "")) for i, title in listed] if plan.mode == "sot" else []
        finish = "length" if any(e.finish == "length" for e in ends) else "stop"
        cut = {i for i, e in self.ends.items() if e.finish in CUT_OFF}
        if plan.mode == "sot":  # the points the merged answer leaves out (they say nothing)
            stats["dropped_points"] = dropped_points(points, plan.question, cut, len(plan.points))
        if self.again:
            stats["written_again"] = [i for i, _ in self.again]
        answer = self.merge(plan, texts) if self.merge is not None else merged(self.fmt, plan, texts, cut, self.again)
        whole = [AnswerText(plan.rid, answer)] if self.merge is not None and answer else []
        return [*whole, Answer(plan.rid, answer, plan.mode, plan.reason, plan.skeleton, points, stats, finish)]


def merged(fmt, plan: MergePlan, texts: dict[int, str], cut=(), again=()) -> str:
    """The answer from the plan and every point's text (index -> text); `cut`: the points that
    a length cap or a loop stop ended; `again`: (index, title) of the points written again."""
    if plan.mode != "sot":
        return texts.get(0, "")
    points = [(index, title, texts.get(index, "")) for index, title in [*plan.points, *again]]
    return fmt.merge(points, plan.question, cut, len(plan.points))


def summary(answer: Answer) -> str:
    """One line about a finished answer: mode, points shown (and those the merge left out, and
    those written again), tokens, time, rate and each phase's tau (tokens per decoder step of a
    sequence)."""
    phases = {name: p for name, p in answer.stats.items() if isinstance(p, dict)}
    tokens = sum(p["tokens"] for p in phases.values())
    seconds = answer.stats.get("seconds", 0.0)
    taus = [f"{name} {p['tokens'] / p['steps']:.2f}" for name, p in phases.items() if p.get("steps")]
    left_out, again = len(answer.stats.get("dropped_points", [])), len(answer.stats.get("written_again", []))
    n = len(answer.points) - left_out
    shown = (f"{n} point{'' if n == 1 else 's'}" + (f" ({left_out} left out)" if left_out else "")
             + (f", {again} written again" if again else ""))  # fmt: skip
    return (f"mode {answer.mode} · {shown} · {tokens} tokens · {seconds:.2f} s · "
            f"{tokens / seconds if seconds else 0.0:.1f} tok/s" + (f" · tau {', '.join(taus)}" if taus else ""))  # fmt: skip


def answer_tokens(answer: Answer) -> int:
    """Tokens the answer's phases decoded."""
    return sum(p["tokens"] for p in answer.stats.values() if isinstance(p, dict))


def points_asked(question: str) -> int | None:
    """The number of points a skeleton is asked for where the question names one: that and
    SPARE more, which stand in for those the parser or the merge drops (a repeat, a point that
    says nothing); None where it names none."""
    count = asked_count(question)
    return count + SPARE if count else None


def skeleton_params(config: SoTConfig, params: SamplingParams, count: int | None = None) -> SamplingParams:
    """The skeleton phase's settings: its own length cap, a stop past the point cap (`count`, the
    number of points asked of the model where the question names one: that and SPARE; else
    max_points), the prompt format's own stops
    ("DIRECT]" in the plan format), and an end at a point listed again, on a line of its own or
    run on inside a line (the parser would drop it, and a small model that repeats one point
    tends to repeat them all), but for a counted list, which needs its count of distinct items.
    A line past SKELETON_LINE_CHARS ends it too, cut off: a "point" that is a paragraph means the
    model is answering, not planning (its unfinished line is left out; with it the first, the
    plan has too few points and the question goes direct, without decoding the rest)."""
    stops = (f"\n{(count or config.max_points) + 1}.", *load_format(config.prompt_format).skeleton_stop)
    bounded = replace(_bounded(params, config.skeleton_tokens, stops), max_line_chars=SKELETON_LINE_CHARS)
    # A counted list goes on past a repeat (the parser drops it; the items after it may be new),
    # bounded by the count's stop; an open one ends there.
    return bounded if count else replace(bounded, stop_repeated_line=True, stop_repeated_item=True)


def skeleton_text(fmt, delta: Delta) -> str:
    """A skeleton delta's text; a stop string of the format's own that is a decision (the plan
    format's "DIRECT]") stays in it, a blank line that ends the list does not."""
    keep = delta.stop in fmt.skeleton_stop and delta.stop.strip()
    return delta.text + (delta.stop if keep else "")


def finished_lines(skeleton: str, finish_reason: str | None) -> str:
    """The skeleton the parser reads: when it was cut off (its length cap, or a loop that the
    loop stops ended), its last line, or its last item where items run on in one line (as the
    parser reads them), is unfinished or a repeat and is left out."""
    if finish_reason in ("length", "repeat"):
        cut = max([skeleton.rfind("\n")] + [start for start, _, _ in item_starts(skeleton)])
        if cut > 0:
            return skeleton[:cut].rstrip()
    return skeleton


def point_params(config: SoTConfig, params: SamplingParams, plan: Plan) -> SamplingParams:
    """A point's settings: its own length cap and its ends: the end of its first paragraph (the
    format's stop), where a numbered line (another point) would begin, or where it starts to
    write the plan out again inline ("1. Title" of any point), or a line that repeats one of its
    earlier lines (a loop of short lines, which repeat_stop's 16 tokens miss). Stops count only
    past the point's leading whitespace, so a point that opens with a blank line is not empty."""
    most = max(config.max_points, len(plan.points))
    stops = (*(f"\n{i}." for i in range(1, most + 2)), *load_format(config.prompt_format).point_stop,
             *(f"{p.index}. {p.title}" for p in plan.points))  # fmt: skip
    bounded = _bounded(params, config.point_tokens, (*params.stop, *stops))
    return replace(bounded, stop_after_text=True, stop_repeated_line=True)


def point_prompts(tokenizer, fmt, question: str, plan: Plan, history: list[dict] = ()) -> tuple[list[int], dict[int, list[int]]]:
    """The points' shared prefix (earlier turns, instructions, question, the plan as a clean
    list: the longest beginning all their prompts have in common) and each point's suffix; a
    point's full prompt, prefix + suffix, is exactly `fmt.point_ids` of that point."""
    outline = "\n".join(f"{p.index}. {p.title}" for p in plan.points)
    return shared_prefix({p.index: fmt.point_ids(tokenizer, question, outline, p.index, p.title, history)
                          for p in plan.points})  # fmt: skip


def shared_prefix(prompts: dict[int, list[int]]) -> tuple[list[int], dict[int, list[int]]]:
    """Prompts (index -> ids) as the longest beginning they all share and each one's suffix
    (every suffix keeps at least one token)."""
    shared = min(len(common_prefix(list(prompts.values()))), min(map(len, prompts.values())) - 1)
    return next(iter(prompts.values()))[:shared], {index: p[shared:] for index, p in prompts.items()}


def _bounded(params: SamplingParams, max_tokens: int, stop: tuple[str, ...]) -> SamplingParams:
    """The request's sampling settings with a phase's own length cap and stop strings."""
    return replace(params, max_tokens=min(max_tokens, params.max_tokens), stop=tuple(stop))
