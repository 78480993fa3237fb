"""The schedule stage: spreads a plan's points over the live branch stages (sot/flow.py's assign
step: longest predicted first by each device's profile, one shared prefix and a short suffix per
point), tells the merge stage what to wait for, and keeps the tasks it sent to reroute a dead
stage's. A direct answer goes whole to one branch stage, in turn."""

from __future__ import annotations

from collections import OrderedDict

from specsot_mq.errors import SpecSotError
from specsot_mq.messages import BranchTask, Failed, Membership, Planned, Reassign, Reroute
from specsot_mq.sot.flow import Flow, SoTConfig
from specsot_mq.sot.scheduler import DeviceProfile
from specsot_mq.stages.base import Stage


class ScheduleStage(Stage):
    async def start(self) -> None:
        from specsot_mq.pull import resolve_model
        from specsot_mq.tokenizer import load_tokenizer  # the tokenizers library alone: no torch, no transformers

        self.flow = Flow(SoTConfig(**self.spec.sot), load_tokenizer(resolve_model(self.spec.model)))
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
        self.turn += 1
        k = self.turn % len(self.alive)
        order = self.alive[k:] + self.alive[:k]
        plan, prompts = self.flow.assign(msg, [DeviceProfile(name, **self.spec.profiles[name]) for name in order])
        await self.send(self.merge, plan)
        for branch, indices in plan.branches.items():
            await self._task(branch, prompts.task(indices))

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
