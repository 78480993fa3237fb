"""The schedule stage: spreads a plan's points over the live branch stages, longest predicted first
(LPT, by each device's profile; see specsot_mq/sot/scheduler.py), builds every branch's prompts (one
shared prefix, a short suffix per point) and tells the merge stage what to wait for. A direct answer
goes whole to one branch stage, in turn."""

from __future__ import annotations

from specsot_mq.errors import SpecSotError
from collections import OrderedDict

from specsot_mq.messages import (
    BranchTask, Failed, Membership, MergePlan, Planned, Reassign, Reroute, ids, params_from_wire, params_to_wire,
)  # fmt: skip
from specsot_mq.prompts import direct_ids, history_end, load_format
from specsot_mq.sot.engine import SoTConfig, point_params, point_prompts
from specsot_mq.sot.parser import Plan, Point
from specsot_mq.sot.scheduler import DeviceProfile, schedule
from specsot_mq.stages.base import Stage


class ScheduleStage(Stage):
    async def start(self) -> None:
        from specsot_mq.pull import resolve_model
        from specsot_mq.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(resolve_model(self.spec.model))
        self.config = SoTConfig(**self.spec.sot)
        self.format = load_format(self.config.prompt_format)
        self.merge = self.spec.named("merge")[0]
        self.alive = self.spec.named("branch")
        self.turn = 0  # rotates the device order, so equal points spread over requests
        # rid -> branch stage -> the tasks sent to it, for rerouting when it dies (the newest requests)
        self.sent: OrderedDict[str, dict[str, list[BranchTask]]] = OrderedDict()

    async def handle(self, env) -> None:
        msg = env.msg
        if isinstance(msg, Membership):
            self.alive = [name for name in self.spec.named("branch") if name in msg.branches]
        elif isinstance(msg, Reroute):
            await self._reroute(msg)
        elif isinstance(msg, Planned):
            if not self.alive:
                await self.send("gateway", Failed(msg.rid, "no branch stage is up: wait for the launcher to restart one"))
                return
            try:
                await self._assign(msg)
            except SpecSotError as exc:
                await self.send("gateway", Failed(msg.rid, str(exc)))

    async def _assign(self, msg: Planned) -> None:
        params = params_from_wire(msg.params)
        self.turn += 1
        k = self.turn % len(self.alive)
        order = self.alive[k:] + self.alive[:k]
        if msg.mode != "sot":
            branch = order[0]
            prompt = direct_ids(self.tokenizer, msg.question, msg.history)
            await self.send(self.merge, MergePlan(msg.rid, "direct", msg.reason, "", [[0, ""]], {branch: [0]}, msg.stats))
            # The whole prompt: the next turn's begins with it (this question, then its answer).
            await self._task(branch, BranchTask(msg.rid, msg.params, ids([]), [0], [ids(prompt)], len(prompt)))
            return
        plan = Plan("plan", [Point(i, title, predicted or None) for i, title, predicted in msg.points])
        prefix, suffixes = point_prompts(self.tokenizer, self.format, msg.question, plan, msg.history)
        devices = [DeviceProfile(name, **self.spec.profiles[name]) for name in order]
        assignments = [a for a in schedule(plan.points, devices) if a.point_indices]
        branches = {a.device: a.point_indices for a in assignments}
        points = [[p.index, p.title] for p in plan.points]
        await self.send(self.merge, MergePlan(msg.rid, "sot", msg.reason, msg.skeleton, points, branches, msg.stats))
        wire = params_to_wire(point_params(self.config, params, plan))
        first = plan.points[0]
        keep = history_end(lambda h: self.format.point_ids(self.tokenizer, msg.question, "", first.index, first.title, h),
                           msg.history)  # fmt: skip
        for a in assignments:
            await self._task(a.device, BranchTask(msg.rid, wire, ids(prefix), a.point_indices,
                                                  [ids(suffixes[i]) for i in a.point_indices], keep))  # fmt: skip

    async def _task(self, branch: str, task: BranchTask) -> None:
        """Send a task, and remember it while its request may still need it again."""
        self.sent.setdefault(task.rid, {}).setdefault(branch, []).append(task)
        self.sent.move_to_end(task.rid)
        while len(self.sent) > 4096:
            self.sent.popitem(last=False)
        await self.send(branch, task)

    async def _reroute(self, msg: Reroute) -> None:
        """A dead branch stage's tasks of a request go to the survivor next in turn; merge (and
        through it the client) learns which points start again where."""
        tasks = self.sent.get(msg.rid, {}).pop(msg.dead, [])
        survivors = [name for name in self.alive if name != msg.dead]
        if not tasks or not survivors:
            why = "no other branch stage is up" if tasks else "its tasks are no longer known here"
            await self.send("gateway", Failed(msg.rid, f"stage {msg.dead} died holding this request and {why}"))
            return
        self.turn += 1
        target = survivors[self.turn % len(survivors)]
        for task in tasks:
            await self.send(self.merge, Reassign(msg.rid, task.indices, target, msg.dead))
            await self._task(target, task)
