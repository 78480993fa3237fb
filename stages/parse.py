"""The parse stage: the skeleton's text becomes a plan of points, or the direct way when it is not
a usable list (see specsot_mq/sot/parser.py; it never raises on model output)."""

from __future__ import annotations

from specsot_mq.messages import Planned, Skeleton
from specsot_mq.prompts import load_format
from specsot_mq.sot.engine import SoTConfig, finished_lines
from specsot_mq.sot.parser import Plan
from specsot_mq.stages.base import Stage


class ParseStage(Stage):
    async def start(self) -> None:
        self.config = SoTConfig(**self.spec.sot)
        self.format = load_format(self.config.prompt_format)
        self.schedule = self.spec.named("schedule")[0]

    def plan(self, skeleton: str) -> Plan:
        """The plan for a skeleton; a replacement parser overrides this."""
        return self.format.plan(skeleton, self.config.max_points)

    async def handle(self, env) -> None:
        msg = env.msg
        if not isinstance(msg, Skeleton):
            return
        mode, reason, points = msg.mode, msg.reason, []
        if mode == "sot":
            plan = self.plan(finished_lines(msg.text, msg.finish))
            if plan.kind == "plan":
                points = [[p.index, p.title, p.predicted_tokens or 0] for p in plan.points]
                reason = plan.reason or "planned"
            else:
                mode, reason = "direct", f"skeleton says direct: {plan.reason}"
        await self.send(self.schedule, Planned(msg.rid, msg.question, msg.params, mode, reason, msg.text, points,
                                               msg.stats, msg.history))  # fmt: skip
