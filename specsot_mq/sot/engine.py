"""The in-process Skeleton-of-Thought engine: the request flow of sot/flow.py, every step run in
turn in this process, every decoding through the one generation loop on one generator (so with
EAGLE when it has a head). It yields the same events as a request through the stage processes:

    engine = SoTEngine(load_generator(num_slots=8))
    for event in engine.stream("How do I start running?"):
        ...  # SkeletonText, MergePlan, PointText, PointEnd, AnswerText, then Answer

The points' prompts share one prefix (instructions, question, skeleton) and differ only in a
short suffix (the point's number and title), so the prefix is computed once per question and
copied into every point's cache slot; all points then decode in one batched forward per step, and
with more points than `max_parallel` a waiting point takes the slot of the first to finish.

--sot auto routes by the model's learned router (sot/learned_router.py), loaded from its cache or
trained on the first question it routes. The router runs the question's direct prompt half way up
the model; a question it sends direct (or whose skeleton turns out no plan) is prefilled from
there, through the upper half only (sequence.Resume): routing adds little where the answer goes
direct.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

from msgspec.structs import replace

from specsot_mq.errors import SpecSotError
from specsot_mq.generate import Delta, Generator, Job
from specsot_mq.messages import Again, Answer, Ask, ClientEvent, Planned, PointEnd, PointText, Skeleton, ids
from specsot_mq.sampling_params import SamplingParams
from specsot_mq.sequence import Resume
from specsot_mq.sot.flow import Flow, Merging, Progress, Skeletoning, SoTConfig
from specsot_mq.sot.parser import Plan
from specsot_mq.sot.router import Route
from specsot_mq.sot.scheduler import DeviceProfile


class SoTEngine:
    """Skeleton-of-Thought over one Generator (its cache needs max_parallel slots)."""

    def __init__(self, gen: Generator, config: SoTConfig | None = None, device: DeviceProfile | None = None,
                 router: Callable[[str], Route] | None = None):  # fmt: skip
        """router: question -> Route for --sot auto (default: the model's learned router, on first use)."""
        self.gen = gen
        self.router = router
        self.config = config or SoTConfig()
        if self.config.max_parallel > gen.cache.num_slots:
            raise SpecSotError(
                f"max_parallel {self.config.max_parallel} needs as many cache slots; the generator has "
                f"{gen.cache.num_slots}: load it with num_slots={self.config.max_parallel}"
            )
        self.flow = Flow(self.config, gen.tokenizer, self._route)
        # the router's forward of the question being answered (learned_router: its direct prompt,
        # half way up), which its direct answer's prefill goes on from instead of starting again
        self.routed: Resume | None = None
        self.format = self.flow.format
        self.device = device or DeviceProfile("local", 1.0, 1.0, 1.0, self.config.max_parallel)
        # The prompt beginnings that no question changes (instructions, worked examples): each is
        # computed once, when the first prompt that begins with it runs, and kept (_run); not all
        # up front, since a one-off `specsot ask` needs two or three of the six
        # (benchmarks/startup.py). A process that answers many questions may keep them all now.
        # Those not kept yet (a kept one is pinned in the prefix store: never dropped):
        self.unkept = [*self.format.skeleton_heads(gen.tokenizer), *self.format.answer_heads(gen.tokenizer)]

    def keep_heads(self, jobs: list[Job] | None = None) -> None:
        """Compute and keep the shared prompt beginnings not kept yet that one of `jobs` begins
        with (None: all of them, not on first use: the benchmarks time answers as a long-running
        process gives them). Call it while no answer runs."""
        for head in [h for h in self.unkept if jobs is None or any(job.ids[: len(h)] == h for job in jobs)]:
            self.gen.keep_prefix(head)
            self.unkept.remove(head)

    def stream(self, question: str, params: SamplingParams | None = None, history: list[dict] = ()) -> Iterator[ClientEvent]:
        """Answer one question, yielding events as the skeleton and the points grow; `history`:
        the conversation's earlier turns ({"role", "content"}), which every phase's prompt shows."""
        if self.config.sot == "auto":
            self._router()  # trained once per model, on first use: not this answer's time
        start = time.monotonic()
        ask = Ask(uuid.uuid4().hex[:12], question, params or SamplingParams(), self.config.sot, list(history))
        self.routed = None
        self.flow.check_fits(ask, self.gen.cache.capacity)
        try:
            skeleton = self.flow.route(ask, capacity=self.gen.cache.capacity)
            yield from self._answer(skeleton, start)
        finally:
            self.routed = None

    def _answer(self, skeleton: Skeleton | Skeletoning, start: float) -> Iterator[ClientEvent]:
        """A routed request's skeleton (where it has one), then its points."""
        if isinstance(skeleton, Skeletoning):
            yield skeleton.first()
            jobs = [skeleton.job]
            while jobs:  # the skeleton's job, then (a counted list short of points) its variants' (one batch)
                for key, delta in self._run(jobs):
                    if text := skeleton.add(key, delta):
                        yield text
                text, jobs = skeleton.next_round(self.gen.tokenizer)
                if text is not None:
                    yield text
            skeleton = skeleton.done()
        yield from self._points(self.flow.parse(skeleton), start)

    def expand(self, question: str, plan: Plan, params: SamplingParams | None = None) -> Iterator[ClientEvent]:
        """Only the points phase: expand a given plan's points (all together), then merge."""
        points = [(p.index, p.title, p.predicted_tokens or 0) for p in plan.points]
        planned = Planned(uuid.uuid4().hex[:12], question, params or SamplingParams(), "sot", "given", "", points, {})
        yield from self._points(planned, time.monotonic())

    def _points(self, planned: Planned, start: float) -> Iterator[ClientEvent]:
        """The rest of a request once its plan is known: its points (or its direct answer), merged,
        then those a counted answer left out written again (Merging's Again), where it asks."""
        rid, device = planned.rid, self.device.name
        plan, prompts = self.flow.assign(planned, [self.device], self.gen.cache.capacity)
        merging = Merging(self.format)
        yield from merging.feed(plan, device)
        jobs = prompts.jobs(plan.branches[device])
        if plan.mode == "direct":  # the prefill goes on from the router's forward where it ran this prompt (layout.resumes)
            jobs[0].resume, self.routed = self.routed, None
        while jobs:
            progress = {job.key: Progress() for job in jobs}
            # A counted plan's spares stop once the answer shows the question's count (the merged
            # answer is the same: they come after every point it shows).
            unneeded: set[int] = set()
            again = None
            for key, delta in self._run(jobs, lambda key: key[1] in unneeded):
                _, index = key
                progress[key].add(delta)
                events = [PointText(rid, index, delta.text, ids(delta.token_ids))] if delta.text or delta.token_ids else []
                if delta.finish_reason:
                    p = progress[key]
                    events.append(PointEnd(rid, index, delta.finish_reason, p.tokens, p.steps, p.seconds()))
                for event in (out for msg in events for out in merging.feed(msg, device)):
                    if isinstance(event, Again):  # for this engine to write (after this round)
                        again = replace(event, stage=device)
                        continue
                    if isinstance(event, Answer):
                        event.stats["seconds"] = time.monotonic() - start
                    yield event
                if merging.ordered is not None:
                    unneeded.update(merging.ordered.unneeded())
            jobs = []
            if again is not None:
                yield from merging.feed(again, device)
                jobs = self.flow.again(planned, again).jobs([index for index, _, _ in again.points])

    def _router(self):
        """The router --sot auto asks: the one given, else the model's learned one (cached)."""
        if self.router is None:
            from specsot_mq.sot.learned_router import LearnedRouter

            self.router = LearnedRouter.for_model(self.gen.model, self.gen.tokenizer)
        return self.router

    def _route(self, question: str) -> Route:
        if not hasattr(self._router(), "route"):  # a plain question -> Route (no forward to go on from)
            return self.router(question)
        draft = self.gen.draft
        decision, self.routed = self.router.route(question, tuple(draft.cfg.feature_layers) if draft else ())
        return decision

    def _run(self, jobs: list[Job], cancelled: Callable[[object], bool] | None = None) -> Iterator[tuple[object, Delta]]:
        """Jobs of one phase (one sampling setting) through the generation loop (`cancelled`: a
        job key -> whether to stop it, see Generator.run), the shared beginnings they start with
        computed and kept first where none of them ran before (the generator is idle here)."""
        self.keep_heads(jobs)
        yield from self.gen.run_jobs(jobs, self.gen.new_decoder(jobs[0].params), self.config.max_parallel, cancelled)

    def generate(self, question: str, params: SamplingParams | None = None,
                 on_event: Callable[[ClientEvent], None] | None = None, history: list[dict] = ()) -> Answer:  # fmt: skip
        """Run to the end, calling on_event for every event; return the Answer."""
        answer = None
        for event in self.stream(question, params, history):
            if on_event is not None:
                on_event(event)
            if isinstance(event, Answer):
                answer = event
        return answer
