"""The merge stage: collects every point of a request, streams each point's text on to the gateway
as it grows, streams the merged answer in plan order as far as it is certain (AnswerText, see
sot/ordered.py), and sends the whole answer once the last point ends."""

from __future__ import annotations

from dataclasses import dataclass, field

from specsot_mq.messages import Answer, AnswerText, MergePlan, PointEnd, PointText, Reassign
from specsot_mq.prompts import load_format
from specsot_mq.sot.engine import SoTConfig
from specsot_mq.sot.ordered import OrderedAnswer
from specsot_mq.stages.base import Stage


@dataclass(slots=True)
class _Merging:
    """A request's pieces as they arrive (a point's first text can overtake the plan: they come
    from different stages)."""

    plan: MergePlan | None = None
    texts: dict[int, list[str]] = field(default_factory=dict)  # point index -> its text so far, in pieces
    ends: dict[int, PointEnd] = field(default_factory=dict)  # point index -> how it ended
    ordered: OrderedAnswer | None = None  # the merged answer's text released so far (a planned answer)
    owner: dict[int, str] = field(default_factory=dict)  # point index -> the branch stage that decodes it
    released: int = 0  # characters of a direct answer sent as AnswerText (a redo sends only what goes beyond)


class MergeStage(Stage):
    async def start(self) -> None:
        self.format = load_format(SoTConfig(**self.spec.sot).prompt_format)
        self.requests: dict[str, _Merging] = {}
        self.aborted: dict[str, bool] = {}  # recent aborts, so late points of one are ignored (bounded)
        # A replacement merger (merge() overridden) gets its answer streamed whole, at the end.
        self.streams = type(self).merge is MergeStage.merge

    def inflight(self) -> int:
        return len(self.requests)

    def merge(self, plan: MergePlan, texts: dict[int, str]) -> str:
        """The answer from the plan and every point's text; a replacement merger overrides this."""
        if plan.mode != "sot":
            return texts.get(0, "")
        return self.format.merge([(index, title, texts.get(index, "")) for index, title in plan.points])

    async def handle(self, env) -> None:
        msg = env.msg
        if not isinstance(msg, (MergePlan, PointText, PointEnd, Reassign)) or msg.rid in self.aborted:
            return
        state = self.requests.setdefault(msg.rid, _Merging())
        if isinstance(msg, Reassign):
            await self._reassign(msg, state)
            return
        if isinstance(msg, (PointText, PointEnd)) and state.owner.get(msg.index, env.src) != env.src:
            return  # from a stage that no longer decodes this point (it died; its last messages arrive late)
        if isinstance(msg, MergePlan):
            state.plan = msg
            state.owner = {i: stage for stage, indices in msg.branches.items() for i in indices} | state.owner
            await self.send("gateway", msg)
            if self.streams and msg.mode == "sot":  # what arrived before the plan is released now
                state.ordered = OrderedAnswer(self.format, [(i, t) for i, t in msg.points])
                for index, parts in state.texts.items():
                    await self._answer_text(msg.rid, state.ordered.add(index, "".join(parts)))
                for index in state.ends:
                    await self._answer_text(msg.rid, state.ordered.end(index))
            elif self.streams:
                await self._direct_text(msg.rid, state)
        elif isinstance(msg, PointText):
            state.texts.setdefault(msg.index, []).append(msg.text)
            await self.send("gateway", msg)
            if state.ordered is not None:
                await self._answer_text(msg.rid, state.ordered.add(msg.index, msg.text))
            elif state.plan is not None and self.streams:
                await self._direct_text(msg.rid, state)
        else:
            state.ends[msg.index] = msg
            if state.ordered is not None:
                await self._answer_text(msg.rid, state.ordered.end(msg.index))
        await self._maybe_done(msg.rid, state)

    async def _reassign(self, msg: Reassign, state: _Merging) -> None:
        """Points that start again on another stage: what they wrote is dropped (the client is
        told), and only the new stage's text counts from now on."""
        for index in msg.indices:
            state.owner[index] = msg.stage
            state.texts.pop(index, None)
            state.ends.pop(index, None)
            if state.ordered is not None:
                state.ordered.restart(index)
        await self.send("gateway", msg)

    async def _direct_text(self, rid: str, state: _Merging) -> None:
        """A direct answer's new text: what its point wrote beyond what was sent (after a redo on
        another stage, greedy decoding writes the same again)."""
        text = "".join(state.texts.get(0, []))
        await self._answer_text(rid, text[state.released :])
        state.released = max(state.released, len(text))

    async def _answer_text(self, rid: str, text: str) -> None:
        if text:
            await self.send("gateway", AnswerText(rid, text))

    async def _maybe_done(self, rid: str, state: _Merging) -> None:
        plan = state.plan
        if plan is None or len(state.ends) < sum(len(v) for v in plan.branches.values()):
            return
        del self.requests[rid]
        texts = {i: "".join(parts) for i, parts in state.texts.items()}
        ends = state.ends.values()
        phase = "points" if plan.mode == "sot" else "direct"
        stats = dict(plan.stats)
        stats[phase] = {"tokens": sum(e.tokens for e in ends), "steps": sum(e.steps for e in ends),
                        "seconds": max((e.seconds for e in ends), default=0.0)}  # fmt: skip
        points = [[i, title, texts.get(i, "")] for i, title in plan.points] if plan.mode == "sot" else []
        finish = "length" if any(e.finish == "length" for e in ends) else "stop"
        answer = self.merge(plan, texts)
        if not self.streams:
            await self._answer_text(rid, answer)
        await self.send("gateway", Answer(rid, answer, plan.mode, plan.reason, plan.skeleton, points,
                                          stats, finish))  # fmt: skip

    async def abort(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self.aborted[rid] = True
        while len(self.aborted) > 10_000:
            del self.aborted[next(iter(self.aborted))]
