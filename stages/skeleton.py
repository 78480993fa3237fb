"""The skeleton stage (a device stage): routes each question, and decodes the skeletons of the
questions that go the SoT way, several requests' skeletons in one running batch (sot/flow.py's
route and skeleton steps)."""

from __future__ import annotations

from specsot_mq.errors import SpecSotError
from specsot_mq.messages import Ask, Failed
from specsot_mq.sot.flow import Flow, Skeletoning, SoTConfig
from specsot_mq.stages.worker import DeviceStage, batch_key


class SkeletonStage(DeviceStage):
    message = Ask

    async def start(self) -> None:
        self.slots = self.spec.skeleton_slots
        self.parse = self.spec.named("parse")[0]
        self.flow = Flow(SoTConfig(**self.spec.sot))  # its tokenizer: the model's, once loaded
        await super().start()  # self.running: rid -> its Skeletoning
        self.flow.tokenizer = self.gen.tokenizer

    def build(self):
        gen = super().build()
        # Every skeleton prompt begins the same way: compute that once (before any request).
        gen.keep_prefix(self.flow.format.skeleton_head(gen.tokenizer))
        return gen

    def accept(self, msg: Ask) -> None:
        try:
            first = self.flow.route(msg)
        except SpecSotError as exc:
            self.post("gateway", Failed(msg.rid, str(exc)))
            return
        if not isinstance(first, Skeletoning):  # the direct way
            self.post(self.parse, first)
            return
        self.running[msg.rid] = first
        self.post("gateway", first.first())
        self.worker.submit([first.job], batch_key(msg.rid, msg.params))

    def on_delta(self, key, delta) -> None:
        state = self.running.get(key[0])
        if state is None:
            return
        self.tokens += len(delta.token_ids)
        if text := state.add(delta):
            self.post("gateway", text)
        if delta.finish_reason:
            del self.running[key[0]]
            if delta.finish_reason != "abort":
                self.post(self.parse, state.done(delta.finish_reason))
