"""The skeleton stage (a device stage): routes each question, and decodes the skeletons of the
questions that go the SoT way, several requests' skeletons in one running batch."""

from __future__ import annotations

import time
from dataclasses import dataclass

from specsot_mq.errors import SpecSotError
from specsot_mq.generate import Job
from specsot_mq.messages import Ask, Failed, Skeleton, SkeletonText, ids
from specsot_mq.prompts import direct_ids, history_end, load_format
from specsot_mq.sot.engine import SoTConfig, skeleton_params, skeleton_text
from specsot_mq.sot.router import route
from specsot_mq.stages.worker import DeviceStage, Progress, batch_key


@dataclass(slots=True)
class _Skeleton:
    """A request whose skeleton is being decoded."""

    ask: Ask
    reason: str  # why the router sent it the SoT way
    text: str  # the skeleton so far, its prefilled beginning included
    progress: Progress


class SkeletonStage(DeviceStage):
    message = Ask

    async def start(self) -> None:
        self.slots = self.spec.skeleton_slots
        self.config = SoTConfig(**self.spec.sot)
        self.format = load_format(self.config.prompt_format)
        self.parse = self.spec.named("parse")[0]
        await super().start()  # self.running: rid -> its _Skeleton

    def build(self):
        gen = super().build()
        # Every skeleton prompt begins the same way: compute that once (before any request).
        gen.keep_prefix(self.format.skeleton_head(gen.tokenizer))
        return gen

    def accept(self, msg: Ask, params) -> None:
        try:
            decision = route(msg.question, msg.sot)
        except SpecSotError as exc:
            self.post("gateway", Failed(msg.rid, str(exc)))
            return
        if not decision.use_sot:
            self.post(self.parse, Skeleton(msg.rid, msg.question, msg.params, "direct", decision.reason, "",
                                           self._prompt_stats(msg), history=msg.history))  # fmt: skip
            return
        prompt = self.format.skeleton_ids(self.gen.tokenizer, msg.question, msg.history)
        self.running[msg.rid] = _Skeleton(msg, decision.reason, self.format.skeleton_prefix, Progress(time.monotonic()))
        self.post("gateway", SkeletonText(msg.rid, self.format.skeleton_prefix, ids([])))
        keep = history_end(lambda h: self.format.skeleton_ids(self.gen.tokenizer, msg.question, h), msg.history)
        self.worker.submit([Job((msg.rid, 0), prompt, skeleton_params(self.config, params), keep=keep)],
                           batch_key(msg.rid, params))  # fmt: skip

    def on_delta(self, key, delta) -> None:
        rid = key[0]
        state = self.running.get(rid)
        if state is None:
            return
        self.tokens += len(delta.token_ids)
        state.progress.add(delta)
        text = skeleton_text(self.format, delta)
        state.text += text
        if text:
            self.post("gateway", SkeletonText(rid, text, ids(delta.token_ids)))
        if delta.finish_reason:
            del self.running[rid]
            if delta.finish_reason == "abort":
                return
            ask, progress = state.ask, state.progress
            stats = self._prompt_stats(ask) | {
                "skeleton": {"tokens": progress.tokens, "steps": progress.steps, "seconds": progress.seconds()}}
            self.post(self.parse, Skeleton(rid, ask.question, ask.params, "sot", state.reason, state.text, stats,
                                           delta.finish_reason, ask.history))  # fmt: skip

    def _prompt_stats(self, ask: Ask) -> dict:
        """The request's prompt size as a plain chat server counts it: the conversation with the
        question, as one chat prompt (what the API reports as usage.prompt_tokens)."""
        return {"prompt_tokens": len(direct_ids(self.gen.tokenizer, ask.question, ask.history))}

