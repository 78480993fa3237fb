"""The merge stage: collects every point of a request, streams each point's text on to the gateway
as it grows, streams the merged answer in plan order as far as it is certain (AnswerText, see
sot/ordered.py), asks the scheduler to have the points a counted answer left out written again
(Again), and sends the whole answer once the last point ends (sot/flow.py's Merging)."""

from __future__ import annotations

from specsot_mq.messages import Again, MergePlan, PointEnd, PointText, Reassign
from specsot_mq.prompts import load_format
from specsot_mq.sot.flow import Merging, SoTConfig, merged
from specsot_mq.stages.base import Stage


class MergeStage(Stage):
    async def start(self) -> None:
        self.format = load_format(SoTConfig(**self.spec.sot).prompt_format)
        self.requests: dict[str, Merging] = {}
        self.aborted: dict[str, bool] = {}  # recent aborts, so late points of one are ignored (bounded)
        # A replacement merger (merge() overridden) gets its answer streamed whole, at the end.
        self.replaced = self.merge if type(self).merge is not MergeStage.merge else None

    def inflight(self) -> int:
        return len(self.requests)

    def merge(self, plan: MergePlan, texts: dict[int, str]) -> str:
        """The answer from the plan and every point's text (index -> text); a replacement merger
        overrides this."""
        return merged(self.format, plan, texts)

    async def handle(self, env) -> None:
        msg = env.msg
        if not isinstance(msg, (MergePlan, PointText, PointEnd, Reassign, Again)) or msg.rid in self.aborted:
            return
        state = self.requests.setdefault(msg.rid, Merging(self.format, self.replaced))
        for out in state.feed(msg, env.src):
            if isinstance(out, Again) and not out.stage:  # points to write again: the scheduler gives them
                await self.send(self.spec.named("schedule")[0], out)  # to a stage and sends them back naming it
            await self.send("gateway", out)  # (which learns who holds the request meanwhile)
        if state.done:
            del self.requests[msg.rid]

    async def abort(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self.aborted[rid] = True
        while len(self.aborted) > 10_000:
            del self.aborted[next(iter(self.aborted))]
