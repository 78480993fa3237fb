"""The in-process Skeleton-of-Thought engine: skeleton, parse, schedule, branches decoded together,
merge; every phase through the one generation loop (so with EAGLE when the generator has a head).

    engine = SoTEngine(load_generator(num_slots=8))
    for event in engine.stream("How do I start running?"):
        ...  # SkeletonDelta, PointDelta, PointDone, AnswerDelta, Final

The branch prompts share one prefix (instructions, question, skeleton) and differ only in a short
suffix (the point's number and title), so the prefix is computed once per question and copied into
every branch's cache slot; all points then decode in one batched forward per step, and with more
points than `max_parallel` a waiting point takes the slot of the first to finish.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace

from specsot_mq.errors import SpecSotError
from specsot_mq.generate import Delta, Generator
from specsot_mq.layout import check_layout
from specsot_mq.prompts import common_prefix, direct_ids, load_format
from specsot_mq.sampling import SamplingParams
from specsot_mq.sot.parser import Plan, item_starts
from specsot_mq.sot.router import MODES, route
from specsot_mq.sot.scheduler import DeviceProfile, schedule


@dataclass(slots=True)
class SkeletonDelta:
    """New skeleton text (the first one starts with the prefilled '1.')."""

    text: str


@dataclass(slots=True)
class PointDelta:
    """New text of one point's expansion."""

    index: int  # the point's number in the plan (1-based)
    text: str


@dataclass(slots=True)
class PointDone:
    """A point finished."""

    index: int
    text: str  # its whole expansion
    token_ids: list[int]


@dataclass(slots=True)
class AnswerDelta:
    """New text of a direct (not planned) answer."""

    text: str


@dataclass(slots=True)
class PhaseStats:
    """One phase's work."""

    tokens: int = 0
    seconds: float = 0.0
    tau: float | None = None  # mean tokens per verify step, when decoded with EAGLE
    steps: int = 0  # sequence-steps verified (each running point counts once per step)


@dataclass(slots=True)
class Final:
    """The finished answer, last event of a stream."""

    answer: str
    mode: str  # "sot" or "direct"
    reason: str  # why this mode (router or parser verdict)
    skeleton: str  # the raw skeleton text ('' when direct)
    skeleton_ids: list[int] = field(default_factory=list)  # its tokens, as decoded
    points: list[tuple[int, str, str]] = field(default_factory=list)  # (index, title, expansion)
    phases: dict[str, PhaseStats] = field(default_factory=dict)  # "skeleton", "points", "direct"
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.phases.values())

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        taus = [f"{name} {p.tau:.2f}" for name, p in self.phases.items() if p.tau is not None]
        return (
            f"mode {self.mode} · {len(self.points)} points · {self.tokens} tokens · {self.seconds:.2f} s · "
            f"{self.tokens_per_second:.1f} tok/s" + (f" · tau {', '.join(taus)}" if taus else "")
        )


Event = SkeletonDelta | PointDelta | PointDone | AnswerDelta | Final


@dataclass(slots=True)
class SoTConfig:
    """How the engine splits and bounds an answer."""

    sot: str = "auto"  # auto | always | never (see sot/router.py)
    prompt_format: str = "sot"
    max_points: int = 8
    max_parallel: int = 8  # points decoding at once (cache slots)
    skeleton_tokens: int = 128
    point_tokens: int = 160
    layout: str = "batching"  # branches: "batching" (a cache slot each) or "bim" (one slot, see layout.py)

    def __post_init__(self):
        load_format(self.prompt_format)  # an unknown name fails here, naming the known ones
        check_layout(self.layout)
        if self.sot not in MODES:
            raise SpecSotError(f"--sot must be one of {', '.join(MODES)}, got '{self.sot}'")
        for flag, value, low in (("--max-points", self.max_points, 2), ("--max-parallel", self.max_parallel, 1)):
            if value < low:
                raise SpecSotError(f"{flag} must be at least {low}, got {value}")


class SoTEngine:
    """Skeleton-of-Thought over one Generator (its cache needs max_parallel slots)."""

    def __init__(self, gen: Generator, config: SoTConfig | None = None, device: DeviceProfile | None = None):
        self.gen = gen
        self.config = config or SoTConfig()
        if self.config.max_parallel > gen.cache.num_slots:
            raise SpecSotError(
                f"max_parallel {self.config.max_parallel} needs as many cache slots; the generator has "
                f"{gen.cache.num_slots}: load it with num_slots={self.config.max_parallel}"
            )
        self.format = load_format(self.config.prompt_format)
        self.device = device or DeviceProfile("local", 1.0, 1.0, 1.0, self.config.max_parallel)
        gen.keep_prefix(self.format.skeleton_head(gen.tokenizer))  # the same for every question

    def stream(self, question: str, params: SamplingParams | None = None, history: list[dict] = ()) -> Iterator[Event]:
        """Answer one question, yielding events as the skeleton and the points grow; `history`:
        the conversation's earlier turns ({"role", "content"}), which every phase's prompt shows."""
        params = params or SamplingParams()
        start = time.perf_counter()
        decision = route(question, self.config.sot)
        if not decision.use_sot:
            yield from self._direct(question, params, decision.reason, start, {}, history)
            return
        phases: dict[str, PhaseStats] = {}
        skeleton = self.format.skeleton_prefix
        yield SkeletonDelta(skeleton)
        sk_params = skeleton_params(self.config, params)
        sk_ids, finish = [], None
        for _, delta in self._run("skeleton", [self.format.skeleton_ids(self.gen.tokenizer, question, history)], sk_params, phases):
            text = skeleton_text(self.format, delta)
            skeleton += text
            sk_ids += delta.token_ids
            finish = delta.finish_reason
            yield SkeletonDelta(text)
        plan = self.format.plan(finished_lines(skeleton, finish), self.config.max_points)
        if plan.kind != "plan":
            yield from self._direct(question, params, f"skeleton says direct: {plan.reason}", start, phases, history)
            return
        yield from self._points(question, skeleton, sk_ids, plan, params, phases, start, history)

    def _points(self, question, skeleton, sk_ids, plan: Plan, params, phases, start, history=()) -> Iterator[Event]:
        prefix, suffixes = point_prompts(self.gen.tokenizer, self.format, question, plan, history)
        # Longest predicted first, so the long points start early (LPT over the one local device).
        order = schedule(plan.points, [self.device])[0].point_indices
        points = [next(p for p in plan.points if p.index == i) for i in order]
        prompts = [prefix + suffixes[p.index] for p in points]
        texts = {p.index: "" for p in points}
        ids = {p.index: [] for p in points}
        pt_params = point_params(self.config, params, plan)
        for seq, delta in self._run("points", prompts, pt_params, phases, shared=len(prefix)):
            index = points[seq].index
            texts[index] += delta.text
            ids[index] += delta.token_ids
            if delta.text:
                yield PointDelta(index, delta.text)
            if delta.finish_reason:
                yield PointDone(index, texts[index], ids[index])
        expansions = [(p.index, p.title, texts[p.index]) for p in plan.points]
        yield Final(self.format.merge(expansions), "sot", plan.reason or "planned", skeleton, sk_ids, expansions, phases,
                    time.perf_counter() - start)  # fmt: skip

    def expand(self, question: str, plan: Plan, params: SamplingParams | None = None) -> Iterator[Event]:
        """Only the branch phase: expand a given plan's points (all together), then merge."""
        yield from self._points(question, "", [], plan, params or SamplingParams(), {}, time.perf_counter())

    def _direct(self, question, params, reason, start, phases, history=()) -> Iterator[Event]:
        text = ""
        for _, delta in self._run("direct", [direct_ids(self.gen.tokenizer, question, history)], params, phases):
            text += delta.text
            if delta.text:
                yield AnswerDelta(delta.text)
        yield Final(text, "direct", reason, "", [], [], phases, time.perf_counter() - start)

    def _run(self, phase: str, prompts, params, phases, shared: int = 0) -> Iterator[tuple[int, Delta]]:
        """One phase through the generation loop, counting its tokens, time and tau."""
        stats = phases.setdefault(phase, PhaseStats())
        decoder = self.gen.new_decoder(params, self.config.layout if phase == "points" else "batching")
        began = time.perf_counter()
        for seq, delta in self.gen.stream_many(prompts, params, decoder, shared, self.config.max_parallel):
            stats.tokens += len(delta.token_ids)
            yield seq, delta
        stats.seconds += time.perf_counter() - began
        spec = getattr(decoder, "stats", None)
        stats.tau = spec.tau if spec is not None and spec.steps else None
        stats.steps = spec.steps if spec is not None else 0

    def generate(self, question: str, params: SamplingParams | None = None,
                 on_event: Callable[[Event], None] | None = None, history: list[dict] = ()) -> Final:  # fmt: skip
        """Run to the end, calling on_event for every event; return the Final one."""
        final = None
        for event in self.stream(question, params, history):
            if on_event is not None:
                on_event(event)
            if isinstance(event, Final):
                final = event
        return final

    async def astream(self, question: str, params: SamplingParams | None = None,
                      history: list[dict] = ()) -> AsyncIterator[Event]:  # fmt: skip
        """The same stream as an async generator; model steps run on the generator's model thread."""
        async for event in self.gen.on_model_thread(self.stream(question, params, history)):
            yield event


def skeleton_params(config: SoTConfig, params: SamplingParams) -> SamplingParams:
    """The skeleton phase's settings: its own length cap, a stop past the point cap, the prompt
    format's own stops ("DIRECT]" in the plan format), and an end at a point listed again, on a
    line of its own or run on inside a line (the parser would drop it, and a small model that
    repeats one point tends to repeat them all)."""
    stops = (f"\n{config.max_points + 1}.", *load_format(config.prompt_format).skeleton_stop)
    return replace(_bounded(params, config.skeleton_tokens, stops), stop_repeated_line=True, stop_repeated_item=True)


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
    stops = (*(f"\n{i}." for i in range(1, config.max_points + 2)), *load_format(config.prompt_format).point_stop,
             *(f"{p.index}. {p.title}" for p in plan.points))  # fmt: skip
    bounded = _bounded(params, config.point_tokens, (*params.stop, *stops))
    return replace(bounded, stop_after_text=True, stop_repeated_line=True)


def point_prompts(tokenizer, fmt, question: str, plan: Plan, history: list[dict] = ()) -> tuple[list[int], dict[int, list[int]]]:
    """The points' shared prefix (earlier turns, instructions, question, the plan as a clean
    list: the longest beginning all their prompts have in common) and each point's suffix; a
    point's full prompt, prefix + suffix, is exactly `fmt.point_ids` of that point."""
    outline = "\n".join(f"{p.index}. {p.title}" for p in plan.points)
    prompts = {p.index: fmt.point_ids(tokenizer, question, outline, p.index, p.title, history) for p in plan.points}
    # Every suffix keeps at least one token.
    shared = min(len(common_prefix(list(prompts.values()))), min(map(len, prompts.values())) - 1)
    return next(iter(prompts.values()))[:shared], {index: p[shared:] for index, p in prompts.items()}


def _bounded(params: SamplingParams, max_tokens: int, stop: tuple[str, ...]) -> SamplingParams:
    """The request's sampling settings with a phase's own length cap and stop strings."""
    return replace(params, max_tokens=min(max_tokens, params.max_tokens), stop=tuple(stop))
