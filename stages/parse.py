"""The parse stage: the skeleton's text becomes a plan of points, or the direct way when it is not
a usable list (sot/flow.py's parse step; the parser never raises on model output)."""

from __future__ import annotations

from specsot_mq.messages import Skeleton
from specsot_mq.sot.flow import Flow, SoTConfig
from specsot_mq.sot.parser import Plan
from specsot_mq.stages.base import Stage


class ParseStage(Stage):
    async def start(self) -> None:
        self.flow = Flow(SoTConfig(**self.spec.sot))
        self.schedule = self.spec.named("schedule")[0]
        # A replacement parser (plan() overridden) reads the text alone; the format's parser also
        # takes the question (its number of points, its restatements: Flow.parse).
        self.replaced = self.plan if type(self).plan is not ParseStage.plan else None

    def plan(self, skeleton: str) -> Plan:
        """The plan for a skeleton; a replacement parser overrides this."""
        return self.flow.format.plan(skeleton, self.flow.config.max_points)

    async def handle(self, env) -> None:
        if isinstance(env.msg, Skeleton):
            await self.send(self.schedule, self.flow.parse(env.msg, self.replaced))
