"""A branch stage (one per device): decodes the points it is given, together with the points of
other requests in one running batch, each request's prompts sharing their prefix in the cache."""

from __future__ import annotations

from specsot_mq.messages import BranchTask, PointEnd, PointText, ids
from specsot_mq.prompts import load_format
from specsot_mq.sot.flow import AnswerPrompts, Progress, SoTConfig
from specsot_mq.stages.worker import DeviceStage, batch_key


class BranchStage(DeviceStage):
    message = BranchTask

    async def start(self) -> None:
        self.slots = int(self.spec.profiles[self.name]["max_parallel"])
        self.merge = self.spec.named("merge")[0]
        await super().start()  # self.running: rid -> {point index: its Progress}

    def build(self):
        gen = super().build()
        # Every point prompt and direct answer begins the same way: compute that once.
        for head in load_format(SoTConfig(**self.spec.sot).prompt_format).answer_heads(gen.tokenizer):
            gen.keep_prefix(head)
        return gen

    def accept(self, msg: BranchTask) -> None:
        # A request may send more points later (a dead stage's, rerouted here).
        self.running.setdefault(msg.rid, {}).update({i: Progress() for i in msg.indices})
        self.worker.submit(AnswerPrompts.of(msg).jobs(msg.indices), batch_key(msg.rid, msg.params))

    def on_delta(self, key, delta) -> None:
        rid, index = key
        points = self.running.get(rid)
        if points is None or index not in points:
            return
        progress = points[index]
        self.tokens += len(delta.token_ids)
        progress.add(delta)
        if delta.text or delta.token_ids:  # tokens whose text is still held back (a stop string may follow) too
            self.post(self.merge, PointText(rid, index, delta.text, ids(delta.token_ids)))
        if delta.finish_reason:
            del points[index]
            if not points:
                del self.running[rid]
            self.post(self.merge, PointEnd(rid, index, delta.finish_reason, progress.tokens, progress.steps,
                                           progress.seconds()))  # fmt: skip
