"""The schedule stage: spreads a plan's points over the live branch stages (sot/flow.py's assign
step: longest predicted first by each device's profile, one shared prefix and a short suffix per
point), tells the merge stage what to wait for, and keeps the tasks it sent to reroute a dead
stage's, and gives the points a counted answer left out to a branch stage to write again (Again,
from merge). A direct answer goes whole to one branch stage, in turn. Each task names the branch stage
that kept the longest beginning of its prompts (a conversation's last turn), where that is another
one: the receiver may have that KV shipped instead of recomputing it (kv_ship.py)."""

from __future__ import annotations

from collections import OrderedDict

from msgspec.structs import replace

from specsot_mq.errors import SpecSotError
from specsot_mq.messages import Again, BranchTask, Failed, Membership, Planned, PointEnd, Reassign, Reroute
from specsot_mq.sot.flow import Flow, SoTConfig
from specsot_mq.sot.parser import asked_count
from specsot_mq.sot.scheduler import DeviceProfile
from specsot_mq.stages.base import Stage


class Holders:
    """Which branch stage last kept which prompt beginning (a task's first `keep` tokens, which it
    puts in its prefix store), the newest `limit` of them."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self.kept: OrderedDict[tuple[int, ...], str] = OrderedDict()

    def add(self, ids: list[int], stage: str) -> None:
        key = tuple(ids)
        self.kept[key] = stage
        self.kept.move_to_end(key)
        while len(self.kept) > self.limit:
            self.kept.popitem(last=False)

    def longest(self, ids: list[int]) -> tuple[str, int] | None:
        """(stage, length) of the longest kept beginning of `ids` shorter than it; None if none."""
        for n in sorted({len(k) for k in self.kept if len(k) < len(ids)}, reverse=True):
            if (stage := self.kept.get(tuple(ids[:n]))) is not None:
                return stage, n
        return None


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
        self.planned: OrderedDict[str, Planned] = OrderedDict()  # rid -> its plan, for its points written again
        self.holders = Holders()

    async def handle(self, env) -> None:
        msg = env.msg
        if isinstance(msg, Membership):
            self.alive = [name for name in self.spec.named("branch") if name in msg.branches]
        elif isinstance(msg, Reroute):
            await self._reroute(msg)
        elif isinstance(msg, Again):
            await self._again(msg)
        elif isinstance(msg, Planned):
            if not self.alive:
                why = "no branch stage is up: wait for the launcher to restart one"
                await self.send("gateway", Failed(msg.rid, why, "unavailable"))
                return
            try:
                await self._assign(msg)
            except SpecSotError as exc:
                await self.send("gateway", Failed(msg.rid, str(exc), "internal"))

    async def _assign(self, msg: Planned) -> None:
        self.turn += 1
        k = self.turn % len(self.alive)
        order = self.alive[k:] + self.alive[:k]
        plan, prompts = self.flow.assign(msg, [DeviceProfile(name, **self.spec.profiles[name]) for name in order],
                                         self.spec.max_len)  # fmt: skip
        if plan.mode == "sot" and asked_count(msg.question):  # only a counted answer's points are written again
            remember(self.planned, msg.rid, msg)
        await self.send(self.merge, plan)
        for branch, indices in plan.branches.items():
            await self._task(branch, self._held_elsewhere(branch, prompts.task(indices), prompts.prompt(indices[0])))

    def _held_elsewhere(self, branch: str, task: BranchTask, prompt: list[int]) -> BranchTask:
        """The task (its first prompt `prompt`), naming the live branch stage other than `branch`
        that kept the longest beginning of its prompts, if one did; `branch` will keep the task's own."""
        held = self.holders.longest(prompt)
        if self.spec.kv_ship != "never" and held is not None and held[0] != branch and held[0] in self.alive:
            task.kv_from, task.kv_tokens = held
        if task.keep >= 2:
            self.holders.add(prompt[: task.keep], branch)
        return task

    async def _task(self, branch: str, task: BranchTask) -> None:
        """Send a task, and remember it while its request may still need it again."""
        remember(self.sent, task.rid, self.sent.get(task.rid, {}))
        self.sent[task.rid].setdefault(branch, []).append(task)
        await self.send(branch, task)

    async def _again(self, msg: Again) -> None:
        """Points a counted answer left out, written again by the next live branch stage in turn;
        merge (and through it the gateway) learns which. Where this request's plan is no longer
        known, or no branch stage is up, they end at once, saying nothing."""
        planned = self.planned.get(msg.rid)
        if planned is None or not self.alive:
            for index, _, _ in msg.points:
                await self.send(self.merge, PointEnd(msg.rid, index, "abort", 0, 0, 0.0))
            return
        self.turn += 1
        branch = self.alive[self.turn % len(self.alive)]
        task = self.flow.again(planned, msg).task([index for index, _, _ in msg.points])
        await self.send(self.merge, replace(msg, stage=branch))
        await self._task(branch, task)

    async def _reroute(self, msg: Reroute) -> None:
        """A dead branch stage's tasks of a request go to the survivor next in turn; merge (and
        through it the client) learns which points start again where."""
        tasks = self.sent.get(msg.rid, {}).pop(msg.dead, [])
        survivors = [name for name in self.alive if name != msg.dead]
        if not tasks or not survivors:
            why = "no other branch stage is up" if tasks else "its tasks are no longer known here"
            error = f"stage {msg.dead} died holding this request and {why}"
            await self.send("gateway", Failed(msg.rid, error, "unavailable"))
            return
        self.turn += 1
        target = survivors[self.turn % len(survivors)]
        for task in tasks:
            await self.send(self.merge, Reassign(msg.rid, task.indices, target, msg.dead))
            await self._task(target, replace(task, kv_from="", kv_tokens=0))  # (a redo recomputes: the keeper may be the dead one)


def remember(recent: OrderedDict, key, value, limit: int = 4096) -> None:
    """recent[key] = value, as the newest of at most `limit` entries."""
    recent[key] = value
    recent.move_to_end(key)
    while len(recent) > limit:
        recent.popitem(last=False)
