"""The skeleton stage (a device stage): routes each question, and decodes the skeletons of the
questions that go the SoT way, several requests' skeletons in one running batch (sot/flow.py's
route and skeleton steps). --sot auto routes by the model's learned router (sot/learned_router.py:
loaded, or trained on a new model, as the stage starts), whose forward runs on the worker thread
between two steps of the running batch."""

from __future__ import annotations

import asyncio

from specsot_mq.errors import SpecSotError
from specsot_mq.messages import Ask, Failed
from specsot_mq.sot.flow import Flow, Skeletoning, SoTConfig
from specsot_mq.sot.router import Route
from specsot_mq.stages.worker import DeviceStage, batch_key


class SkeletonStage(DeviceStage):
    message = Ask

    async def start(self) -> None:
        self.slots = self.spec.skeleton_slots
        self.parse = self.spec.named("parse")[0]
        self.flow = Flow(SoTConfig(**self.spec.sot))  # its tokenizer and router: the model's, once loaded
        self.routing: set[str] = set()  # requests whose route the router is deciding
        await super().start()  # self.running: rid -> its Skeletoning
        self.flow.tokenizer = self.gen.tokenizer

    def build(self):
        from specsot_mq.sot.learned_router import LearnedRouter

        gen = super().build()
        # Every skeleton prompt begins the same way: compute that once (before any request).
        for head in self.flow.format.skeleton_heads(gen.tokenizer):
            gen.keep_prefix(head)
        self.flow.router = LearnedRouter.for_model(gen.model, gen.tokenizer)
        return gen

    def accept(self, msg: Ask) -> None:
        if msg.sot != "auto":
            self._start(msg, None)
            return
        self.routing.add(msg.rid)
        self.worker.call(lambda: self.flow.decide(msg)).add_done_callback(lambda done: self._routed(msg, done))

    def _routed(self, msg: Ask, done: asyncio.Future) -> None:
        if msg.rid not in self.routing:  # aborted meanwhile
            return
        self.routing.discard(msg.rid)
        if done.exception() is not None:
            self.post("gateway", Failed(msg.rid, f"stage {self.name} failed to route: {done.exception()}", "internal"))
            return
        self._start(msg, done.result())

    def _start(self, msg: Ask, decision: Route | None) -> None:
        try:
            first = self.flow.route(msg, decision, self.gen.cache.capacity)
        except SpecSotError as exc:  # a bad sot mode
            self.post("gateway", Failed(msg.rid, str(exc), "invalid"))
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
        if text := state.add(key, delta):
            self.post("gateway", text)
        if delta.finish_reason and not state.running:  # the round's last job ended
            text, jobs = state.next_round(self.gen.tokenizer) if delta.finish_reason != "abort" else (None, [])
            if text is not None:
                self.post("gateway", text)
            if jobs:  # a counted list short of points: its variants, decoded together
                self.worker.submit(jobs, batch_key(key[0], state.ask.params))
                return
            del self.running[key[0]]
            if delta.finish_reason != "abort":
                self.post(self.parse, state.done())

    def inflight(self) -> int:
        return len(self.running) + len(self.routing)

    async def abort(self, rid: str) -> None:
        self.routing.discard(rid)
        await super().abort(rid)
