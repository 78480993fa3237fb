"""The model side of a device stage: one thread loads the stage's one Generator (one model, one
draft head, one KV cache allocated at start) and runs the generation loop over it, admitting the
prompts of any request into the running batch as slots free up. The event loop hands jobs in with
submit() and gets every delta back on the loop through `emit`; call() runs other model work there
(the learned router's forward), between two steps of the running batch.

Every torch call of a stage process runs on that one thread, loading included, so the process
holds one OpenMP thread pool (specsot_mq/openmp.py says why that matters).

Sampling: one decoder samples for its whole batch, so a batch holds greedy jobs of any requests,
or the jobs of one sampled request (its seed then reproduces). A job that cannot join the running
batch waits until the batch drains, and while one waits no more jobs are admitted, so none starve.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from specsot_mq.core_share import CoreShare
from specsot_mq.errors import PromptTooLong, SpecSotError
from specsot_mq.generate import Delta, Generator, Job
from specsot_mq.messages import Failed, FailCode
from specsot_mq.stages.base import Stage

log = logging.getLogger("specsot.worker")

# A job's new tokens leave the worker at most this often (its first ones and its end at once). Each
# message wakes the event loop and then every stage process it passes through, on the cores the
# model's next step runs on: sent a step at a time, answers through a launch on 2 cores came at
# 0.58x the in-process engine's rate at 1 client, 0.86x joined (benchmarks/HISTORY.md). A reader
# sees 20 updates a second.
STREAM_INTERVAL_S = 0.05


class DeviceWorker:
    """A thread that builds the Generator with `load()`, then decodes jobs; `emit(key, delta)` is
    called on the event loop. Await `ready` for the Generator (or the error that load raised)."""

    def __init__(self, load: Callable[[], Generator], emit: Callable[[object, Delta], None],
                 loop: asyncio.AbstractEventLoop, on_error: Callable[[object, str, str], None],
                 share: CoreShare | None = None, threads: int | None = None):  # fmt: skip
        """share: this CPU stage's place on its host's core board; threads: a fixed torch thread
        count instead (None for both: torch's own)."""
        self.emit, self.loop, self.on_error = emit, loop, on_error
        self.share = share
        self.threads = threads  # the torch thread count the worker thread runs with (fixed, or its latest share)
        self.gen: Generator | None = None
        self.ready: asyncio.Future = loop.create_future()
        self.inbox: queue.Queue = queue.Queue()
        self.cancelled: dict = {}  # request ids whose jobs stop (job keys are (rid, index)); the newest kept
        self.active: set = set()  # keys of the jobs decoding now
        self.decoder = None  # the running batch's decoder
        self.done_counts = [0, 0, 0]  # speculative decoding's steps, drafted and accepted tokens of finished batches
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(load,), name="device-worker", daemon=True)
        self.thread.start()

    def _main(self, load: Callable[[], Generator]) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        self._fit_threads()
        try:
            self.gen = load()
        except BaseException as exc:  # the stage's start() raises it
            self.loop.call_soon_threadsafe(_settle, self.ready, None, exc)
            return
        finally:
            self._idle()
        self.loop.call_soon_threadsafe(_settle, self.ready, self.gen, None)
        self._serve()

    def submit(self, jobs: list[Job], batch_key: object) -> None:
        """Queue jobs; jobs with equal batch_key may share a batch (see the module docstring)."""
        self.inbox.put((batch_key, jobs))

    def call(self, fn: Callable[[], object]) -> asyncio.Future:
        """Run fn() on the worker thread (at once when idle, else between two steps of the running
        batch); the future, on the event loop, gets its result or its exception."""
        future = self.loop.create_future()
        self.inbox.put(_Call(fn, future))
        return future

    def cancel(self, rid: str) -> None:
        self.cancelled[rid] = True
        while len(self.cancelled) > 10_000:  # bounded: memory stays flat however long the stage runs
            del self.cancelled[next(iter(self.cancelled))]

    def close(self) -> None:
        self._stop.set()
        self.inbox.put(None)
        self.thread.join(timeout=10)

    def _serve(self) -> None:
        held: list[tuple[object, list[Job]]] = []  # jobs waiting for the next batch
        while not self._stop.is_set():
            if not held:
                item = self.inbox.get()
                if item is None:
                    return
                if isinstance(item, _Call):
                    item.run(self.loop)
                    continue
                held.append(item)
            key = held[0][0]
            pending = [job for k, jobs in held if k == key for job in jobs]
            held = [(k, jobs) for k, jobs in held if k != key]

            def admit(room: int) -> list[Job]:
                while True:  # take what has arrived since
                    try:
                        item = self.inbox.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        self._stop.set()
                        break
                    if isinstance(item, _Call):
                        item.run(self.loop)
                    elif item[0] == key and not held:
                        pending.extend(item[1])
                    else:
                        held.append(item)
                pending[:] = [job for job in pending if job.key[0] not in self.cancelled]
                taken = pending[:room]
                del pending[:room]
                # A job whose request failed just now (an earlier job of it did not fit) is dropped too.
                return [job for job in taken if job.key[0] not in self.cancelled and self._fits(job)]

            if not pending:
                continue
            active = self.active = set()
            try:
                decoder = self.decoder = self.gen.new_decoder(pending[0].params)
                outgoing = Coalescer(STREAM_INTERVAL_S)
                for job_key, delta in self.gen.run(self._tracking(admit, active), decoder,
                                                   cancelled=lambda k: k[0] in self.cancelled,
                                                   before_step=self._fit_threads):  # fmt: skip
                    if delta.finish_reason:
                        active.discard(job_key)
                    for key, due in outgoing.add(job_key, delta):
                        self.loop.call_soon_threadsafe(self.emit, key, due)
                    if self._stop.is_set():
                        return
            except Exception as exc:  # a failed batch fails its requests, not the stage
                log.exception("decoding failed")
                self.gen.slots.forget_claims()  # what a slot held may be lost (a range server that restarted)
                for job_key in active | {job.key for job in pending}:
                    self.loop.call_soon_threadsafe(self.on_error, job_key, f"{type(exc).__name__}: {exc}", "internal")
            self.done_counts = self.spec_counts()
            self.decoder = None
            active.clear()
            if not held:  # held jobs start the next batch at once
                self._idle()

    def spec_counts(self) -> list[int]:
        """Speculative decoding since start: [sequence-steps verified, draft tokens verified,
        draft tokens accepted] (read from the event loop: plain ints, a step late at worst)."""
        stats = getattr(self.decoder, "stats", None)
        now = [stats.steps, stats.drafted, stats.accepted] if stats is not None else [0, 0, 0]
        return [a + b for a, b in zip(self.done_counts, now)]

    def _idle(self) -> None:
        if self.share is not None:
            self.share.idle()

    def _fit_threads(self) -> None:
        """Before each step: this stage's share of its host's cores (core_share.py), set on the
        thread that runs the model (OpenMP's thread count is per thread)."""
        if self.share is not None and (n := self.share.take()) != self.threads:
            torch.set_num_threads(n)
            self.threads = n

    def _fits(self, job: Job) -> bool:
        """A prompt too long for the cache fails its request alone (the running batch goes on);
        the request's other jobs stop too."""
        try:
            self.gen.check_prompt(job.ids)
            return True
        except SpecSotError as exc:
            self.cancel(job.key[0])
            code = "too_long" if isinstance(exc, PromptTooLong) else "invalid"
            self.loop.call_soon_threadsafe(self.on_error, job.key, str(exc), code)
            return False

    @staticmethod
    def _tracking(admit, active: set):
        def wrapped(room: int) -> list[Job]:
            jobs = admit(room)
            active.update(job.key for job in jobs)
            return jobs

        return wrapped


class Coalescer:
    """A running batch's deltas on their way out, each job's joined until they are due: a job's
    first delta and its last (a finish) at once, and every job's held tokens together once
    `interval` seconds have passed since they last went (one wake-up downstream for the batch's
    jobs, not one each). Every job ends with a finish, so nothing is held for good."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval, self.clock = interval, clock
        self.held: dict[object, Delta] = {}  # key -> its tokens not sent yet, as one delta
        self.started: set = set()  # keys whose first delta went
        self.last = clock()  # when the held deltas last went together

    def add(self, key, delta: Delta) -> list[tuple[object, Delta]]:
        """Take a job's delta; return the deltas due now, (key, delta) each, a job's in order."""
        if (old := self.held.pop(key, None)) is not None:
            delta = replace(delta, text=old.text + delta.text, token_ids=old.token_ids + delta.token_ids,
                            steps=old.steps + delta.steps)  # its end (finish, stop string) is the newer one's
        self.held[key] = delta
        if (now := self.clock()) - self.last >= self.interval:
            self.last = now
            due = list(self.held)
        else:
            due = [key] if delta.finish_reason or key not in self.started else []
        out = [(k, self.held.pop(k)) for k in due]
        for k, d in out:
            (self.started.discard if d.finish_reason else self.started.add)(k)
        return out


class _Call:
    """A function for the worker thread, and the future its result goes to."""

    def __init__(self, fn: Callable[[], object], future: asyncio.Future):
        self.fn, self.future = fn, future

    def run(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            result = self.fn()
        except Exception as exc:
            loop.call_soon_threadsafe(_settle, self.future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, self.future, result, None)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def replica_groups(ranges: dict[str, dict]) -> list[dict[str, str]]:
    """RunSpec.ranges as load_generator takes them: for each range, in layer order, its servers
    (its replicas) as {name: address}."""
    groups: dict[tuple, dict[str, str]] = {}
    for name, served in ranges.items():
        groups.setdefault(tuple(served["layers"]), {})[name] = served["address"]
    return [group for _, group in sorted(groups.items())]


class DeviceStage(Stage):
    """A stage that owns a device: one Generator (model, draft head, KV cache allocated at start)
    and the worker thread that decodes on it. Messages go out in order through one sender task."""

    slots = 8  # sequences decoded at once; subclasses set it from the spec
    message: type = object  # the message a subclass decodes (it gets them in accept())

    async def start(self) -> None:
        from specsot_mq.devices import parse_devices

        self.running: dict[str, object] = {}  # rid -> what the subclass keeps about that request
        self.device = parse_devices(self.spec.devices[self.name], resolve=False)[0].torch_device
        threads = self.spec.threads.get(self.name) if self.device == "cpu" else None  # --threads fixed it
        # Otherwise a CPU stage takes its share of the host's cores, by how many of its stages are busy.
        self.share = host_share(self.spec, self.name) if self.device == "cpu" and threads is None else None
        self.outbox: asyncio.Queue = asyncio.Queue()
        self._sender = asyncio.create_task(self._drain())
        self.worker = DeviceWorker(self.build, self.on_delta, asyncio.get_running_loop(), self.on_error, self.share,
                                   threads)  # fmt: skip
        self.gen = await self.worker.ready

    def build(self) -> Generator:
        """The stage's Generator; runs on the worker thread (see the module docstring)."""
        from specsot_mq.loader import load_generator
        from specsot_mq.decode_params import TreeParams

        if self.device.startswith("cuda"):  # its share of the GPU's memory (stages on one GPU)
            import torch

            torch.cuda.set_per_process_memory_fraction(gpu_share(self.spec, self.name), torch.device(self.device))
        return load_generator(self.spec.model, self.spec.dtype, self.device, self.spec.max_len, self.slots,
                              self.spec.draft, TreeParams(**self.spec.tree), self.spec.quantize,
                              self.spec.prefix_cache_mb, replica_groups(self.spec.ranges), self.spec.prefill_chunk)  # fmt: skip

    async def _drain(self) -> None:
        while True:
            dst, msg = await self.outbox.get()
            await self.send(dst, msg)

    def post(self, dst: str, msg) -> None:
        """Send without awaiting, keeping the order of posts."""
        self.outbox.put_nowait((dst, msg))

    async def handle(self, env) -> None:
        if isinstance(env.msg, self.message):
            self.accept(env.msg)

    def accept(self, msg) -> None:
        """A request's message (its SamplingParams checked by the codec): queue its decoding."""

    def on_delta(self, key, delta: Delta) -> None:
        """A job's new tokens (on the event loop)."""

    def on_error(self, key, error: str, code: FailCode) -> None:
        """A job failed (its batch, or its prompt too long): so does its request."""
        if self.running.pop(key[0], None) is not None:
            self.post("gateway", Failed(key[0], f"stage {self.name} failed: {error}", code))

    def inflight(self) -> int:
        return len(self.running)

    def counters(self) -> dict:
        drafts, drafted, accepted = self.worker.spec_counts()
        store = self.gen.prefixes
        return {"slots": self.slots, "slots_used": len(self.worker.active), "drafts": drafts, "draft_tokens": drafted,
                "accepted_tokens": accepted, "prefix_lookups": store.lookups, "prefix_hits": store.hits,
                "prefix_tokens": store.reused_tokens, "prefix_bytes": store.size}  # fmt: skip

    async def abort(self, rid: str) -> None:
        self.running.pop(rid, None)
        self.worker.cancel(rid)

    async def stop(self) -> None:
        self.worker.close()
        self._sender.cancel()
        if self.share is not None:
            self.share.idle()
            self.share.path.unlink(missing_ok=True)


def host_share(spec, name: str) -> CoreShare:
    """The core board of the CPU device stages on `name`'s host (see core_share.py), with all of
    this host's cores counted here: a remote host may have more or fewer than the launcher's."""
    members = _sharing(spec, name)
    return CoreShare(CoreShare.board_path(spec.client_address, spec.hosts[name]), members.index(name), len(members),
                     os.cpu_count() or 1)  # fmt: skip


def gpu_share(spec, name: str) -> float:
    """The part of its GPU's memory a GPU device stage may take: an equal share between the device
    stages of its host on the same GPU (a skeleton and a branch stage on GPU 0 take half each)."""
    return 1.0 / len(_sharing(spec, name))


def _sharing(spec, name: str) -> list[str]:
    """The device stages on `name`'s host on the same device as it (all CPU stages share the CPU)."""
    from specsot_mq.devices import parse_devices

    def device(n: str) -> str:
        return parse_devices(spec.devices[n], resolve=False)[0].torch_device

    return [n for n in spec.devices if spec.hosts[n] == spec.hosts[name] and device(n) == device(name)]


def batch_key(rid: str, params) -> object:
    """Greedy jobs of any requests share a batch; a sampled request gets its own (its seed)."""
    return "greedy" if params.greedy else rid
