"""A branch stage (one per device): decodes the points it is given, together with the points of
other requests in one running batch, each request's prompts sharing their prefix in the cache.

KV shipping (kv_ship.py): a task whose prompts begin with what another branch stage kept (the
conversation's last turn went there) may ask that stage for the KV, where the link's measured
bandwidth beats this device's measured prefill; the branch stage asked answers from its prefix
store. Either way the prompts decode to the same tokens."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from specsot_mq.errors import SpecSotError
from specsot_mq.messages import BranchTask, KvAsk, KvPart, PointEnd, PointText, ids
from specsot_mq.prompts import load_format
from specsot_mq.sot.flow import AnswerPrompts, Progress, SoTConfig
from specsot_mq.stages.worker import DeviceStage, batch_key

log = logging.getLogger("specsot.branch")


class BranchStage(DeviceStage):
    message = BranchTask

    async def start(self) -> None:
        from specsot_mq.kv_ship import ShipRule

        self.slots = int(self.spec.profiles[self.name]["max_parallel"])
        self.merge = self.spec.named("merge")[0]
        # Shipping needs another branch stage, and a cache of this process's own (not a split's ranges).
        self.ships = self.spec.kv_ship != "never" and len(self.spec.named("branch")) > 1 and not self.spec.ranges
        self.rule = ShipRule()
        self.asked: dict[str, tuple[asyncio.Future, list[KvPart]]] = {}  # ask id -> its answer's parts so far
        self.ask_ids = itertools.count()
        self.fetching: set[asyncio.Task] = set()
        self.shipped = 0  # prompt tokens whose KV came from another branch stage
        self.shipped_for: dict[str, int] = {}  # rid -> those of its task, until its first point ends
        await super().start()  # self.running: rid -> {point index: its Progress}

    def build(self):
        from specsot_mq.kv_ship import Shape

        gen = super().build()
        # Every point prompt and direct answer begins the same way: compute that once.
        for head in load_format(SoTConfig(**self.spec.sot).prompt_format).answer_heads(gen.tokenizer):
            gen.keep_prefix(head)
        if self.ships:
            gen.time_prefill()  # what recomputing costs here, before the first choice needs it
            self.shape = Shape.of(gen)
        return gen

    async def handle(self, env) -> None:
        msg = env.msg
        if isinstance(msg, KvAsk):
            await self._give(env.src, msg)
        elif isinstance(msg, KvPart):
            if (asked := self.asked.get(msg.rid)) is not None:
                asked[1].append(msg)
                if len(asked[1]) == msg.parts and not asked[0].done():
                    asked[0].set_result(asked[1])
        else:
            await super().handle(env)

    def accept(self, msg: BranchTask) -> None:
        # A request may send more points later (a dead stage's, rerouted here).
        self.running.setdefault(msg.rid, {}).update({i: Progress() for i in msg.indices})
        if self.ships and msg.kv_from and msg.kv_from != self.name:
            task = asyncio.create_task(self._fetch_then_decode(msg))
            self.fetching.add(task)
            task.add_done_callback(self.fetching.discard)
        else:
            self._decode(msg)

    def _decode(self, msg: BranchTask) -> None:
        if msg.rid in self.running:  # not aborted meanwhile
            self.worker.submit(AnswerPrompts.of(msg).jobs(msg.indices), batch_key(msg.rid, msg.params))

    # -- KV shipping ---------------------------------------------------------------------------

    async def _fetch_then_decode(self, msg: BranchTask) -> None:
        """Have the KV of the prompts' beginning that msg.kv_from kept shipped here, where the rule
        says that beats recomputing it, then decode."""
        from specsot_mq.kv_ship import MIN_TOKENS, from_parts

        try:
            peer, prompt = msg.kv_from, AnswerPrompts.of(msg).prompt(msg.indices[0])
            own = self.gen.prefixes.longest(prompt[:-1], whole=True, count=False)
            gain = msg.kv_tokens - (len(own.ids) if own is not None else 0)
            if gain < MIN_TOKENS:
                return
            if not self.rule.measured(peer):
                await self._probe(peer)
            nbytes = self.shape.nbytes(msg.kv_tokens)
            ship, ship_s, recompute_s = self.rule.decide(peer, nbytes, gain, self.gen.prefill.seconds_per_token)
            ship = ship or self.spec.kv_ship == "always"
            log.info("%s: %s the KV of %d tokens (%.1f MB) from %s: %.3f s to ship at %.0f MB/s, %.3f s to recompute "
                     "%d tokens here", msg.rid, "shipping" if ship else "recomputing, not shipping", msg.kv_tokens,
                     nbytes / 1e6, peer, ship_s, self.rule.bandwidth[peer] / 1e6, recompute_s, gain)  # fmt: skip
            if not ship:
                return
            parts = await self._ask(peer, KvAsk(msg.rid, ids(prompt), 0), timeout=2.0 + 4 * ship_s)
            if n := parts[0].tokens:
                self.gen.prefixes.add(prompt[:n], from_parts(parts, self.shape))
                if prompt[:n] in self.gen.prefixes:  # (a store too small for it keeps nothing)
                    self.shipped += n
                    self.shipped_for[msg.rid] = n
        except (SpecSotError, asyncio.TimeoutError, ValueError, RuntimeError) as exc:
            log.warning("%s: no KV from %s (%s): recomputing", msg.rid, msg.kv_from, exc or type(exc).__name__)
        finally:
            self._decode(msg)

    async def _probe(self, peer: str) -> None:
        """Time the link to `peer`: a round trip without payload, then one with PROBE_BYTES."""
        from specsot_mq.kv_ship import PROBE_BYTES

        began = time.perf_counter()
        await self._ask(peer, KvAsk("probe", ids([]), 1), timeout=2.0)
        empty = time.perf_counter() - began
        began = time.perf_counter()
        await self._ask(peer, KvAsk("probe", ids([]), PROBE_BYTES), timeout=5.0)
        self.rule.record(peer, PROBE_BYTES, time.perf_counter() - began, empty)

    async def _ask(self, peer: str, ask: KvAsk, timeout: float) -> list[KvPart]:
        """Send an ask straight to `peer`; its answer's parts, once all are here (timed into the
        rule, a probe's by _probe)."""
        from specsot_mq.kv_ship import nbytes

        key = f"{ask.rid}#{next(self.ask_ids)}"
        self.asked[key] = (asyncio.get_running_loop().create_future(), [])
        began = time.perf_counter()
        try:
            await self.direct(peer, KvAsk(key, ask.ids, ask.probe))
            parts = await asyncio.wait_for(self.asked[key][0], timeout)
        finally:
            self.asked.pop(key, None)
        if not ask.probe and parts[0].tokens:
            self.rule.record(peer, nbytes(parts), time.perf_counter() - began)
        return parts

    async def _give(self, src: str, ask: KvAsk) -> None:
        """Answer a KvAsk from this stage's prefix store: its longest stored beginning of the
        prompt (a stored beginning is never changed in place, so it is read here as it is)."""
        from specsot_mq.kv_ship import to_parts

        if ask.probe:
            await self.direct(src, KvPart(ask.rid, 0, 0, 1, pad=bytes(min(ask.probe, 16 << 20))))
            return
        prompt = ask.ids.tolist()
        entry = self.gen.prefixes.longest(prompt[:-1], whole=True, count=False)
        try:
            parts = to_parts(ask.rid, entry.state, len(entry.ids)) if entry is not None and len(entry.ids) >= 2 else []
        except SpecSotError as exc:
            log.warning("%s asked for KV this stage will not send: %s", src, exc)
            parts = []
        for part in parts or [KvPart(ask.rid, 0, 0, 1)]:
            await self.direct(src, part)

    def counters(self) -> dict:
        return super().counters() | {"shipped_tokens": self.shipped}

    async def abort(self, rid: str) -> None:
        self.shipped_for.pop(rid, None)
        await super().abort(rid)

    # -- decoding ------------------------------------------------------------------------------

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
                                           progress.seconds(), self.shipped_for.pop(rid, 0)))  # fmt: skip
