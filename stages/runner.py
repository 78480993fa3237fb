"""One stage process: `python -m specsot_mq.stages.runner --name NAME --spec JSON`.

It runs on uvloop, binds the stage's inbox, starts the stage (loads its model), says Ready to the
gateway, sends a Heartbeat every `heartbeat_s`, feeds every message to the stage, and on SIGTERM
stops the stage and exits 0; so too once the process that started it is gone (a launcher killed
with no chance to stop its stages). A malformed frame is logged and dropped by the transport.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import signal
import socket
import sys
import time

# Set before torch loads OpenMP (libgomp): an idle OpenMP thread spins about 0.1 ms, then sleeps.
# Within a forward, the gaps between kernels are shorter, so a stage's threads stay awake while it
# decodes (threads that sleep at once slow every kernel down); a stage waiting for work, or running
# on fewer threads while its host's cores are shared (core_share.py), takes no core. The policies
# compared: benchmarks/HISTORY.md (benchmarks/cores.py).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from specsot_mq.messages import Abort, Down, Heartbeat, Ready  # noqa: E402
from specsot_mq.openmp import release_freed_memory  # noqa: E402
from specsot_mq.stages.base import RunSpec, Stage, stage_class  # noqa: E402
from specsot_mq.transports import make_transport  # noqa: E402

log = logging.getLogger("specsot.stage")


def rss_mb() -> float:
    """Resident memory of this process now, in MB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def serve(name: str, spec: RunSpec, ctx=None, keys: dict | None = None) -> None:
    """Run stage `name` until SIGTERM (or until the task is cancelled, as tests do in-process).
    keys: the run's CURVE keys (a run over tcp): its tcp sockets accept only peers that hold them."""
    parent = os.getppid()  # the launcher (read before the inbox is bound: once it is, this is known)
    authenticator = _authenticate(ctx, keys) if keys else None
    transport = make_transport(spec.topology, name, spec.table, ctx, keys)
    stage: Stage = stage_class(spec.kinds[name], spec.overrides)(name, spec, transport.send, transport.send_direct)
    stage.route_around = transport.set_down
    stage.keys = keys
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGTERM, stopping.set)
        loop.add_signal_handler(signal.SIGINT, stopping.set)
    except (NotImplementedError, RuntimeError):  # not the main thread (tests run stages in threads)
        pass
    await stage.start()
    release_freed_memory()  # what loading freed (a tokenizer's JSON, a model's conversion) goes back to the OS
    host = spec.hosts.get(name, socket.gethostname())
    if name != "gateway":
        await transport.send_direct("gateway", Ready(name, os.getpid(), host, spec.devices.get(name, "")))

    async def heartbeat():
        last_tokens, last_time = 0, time.monotonic()
        rate = peak = 0.0
        was_busy = False
        while True:
            await asyncio.sleep(spec.heartbeat_s)
            now = time.monotonic()
            if now - last_time >= 2.0:  # tokens/s over the last ~2 seconds
                rate = (stage.tokens - last_tokens) / (now - last_time)
                last_tokens, last_time = stage.tokens, now
            inflight = stage.inflight()
            if was_busy and not inflight:
                release_freed_memory()
            was_busy = inflight > 0
            # The peak is sampled here: ru_maxrss would count the launcher's memory from before exec.
            now_mb = rss_mb()
            peak = max(peak, now_mb)
            beat = Heartbeat(name, os.getpid(), "busy" if inflight else "idle", inflight, rate, now_mb, peak,
                             **stage.counters())  # fmt: skip
            if name == "gateway":
                await stage.handle_local(beat)
            else:
                await transport.send_direct("gateway", beat)

    async def receive():
        while True:
            env = await transport.recv()
            try:
                if isinstance(env.msg, Abort):
                    await stage.abort(env.msg.rid)
                elif isinstance(env.msg, Down):
                    transport.set_down(env.msg.stages)
                else:
                    await stage.handle(env)
            except Exception:  # one bad message must not take the stage down
                log.exception("%s failed on %s from %s", name, type(env.msg).__name__, env.src)

    async def orphaned():
        # A stage outlives no launcher: once the process that started it is gone (this one
        # re-parented, as a SIGKILLed launcher leaves its stages), it stops as on SIGTERM.
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        log.warning("%s: the process that started it (pid %d) is gone: stopping", name, parent)
        stopping.set()

    tasks = [asyncio.create_task(heartbeat()), asyncio.create_task(receive()), asyncio.create_task(orphaned())]
    try:
        await stopping.wait()
    finally:
        for task in tasks:
            task.cancel()
        await stage.stop()
        transport.close()
        if authenticator is not None:
            authenticator.stop()


class _RunKey:
    """The CURVE authenticator's check: only the run's own public key gets in; any other peer
    is refused and logged."""

    def __init__(self, public: str):
        self.public = public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.public:
            return True
        log.warning("refused a tcp peer that does not hold this run's key (CURVE key %s)", key.decode(errors="replace"))
        return False


def _authenticate(ctx, keys: dict):
    """ZeroMQ's authenticator (ZAP) on the stage's context: CURVE peers must hold the run's key."""
    import zmq.asyncio
    from zmq.auth.asyncio import AsyncioAuthenticator

    authenticator = AsyncioAuthenticator(ctx or zmq.asyncio.Context.instance())
    authenticator.start()
    authenticator.configure_curve_callback("*", credentials_provider=_RunKey(keys["public"]))
    return authenticator


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One SpecSoT stage process (started by `specsot launch`).")
    parser.add_argument("--name", required=True)
    parser.add_argument("--spec", required=True, help="the run's RunSpec as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(levelname)s %(message)s")
    spec = RunSpec.from_json(args.spec)
    # A run over tcp: its keys come on standard input (never on the command line, which any user
    # of the host can read).
    keys = json.loads(sys.stdin.readline()) if spec.curve else None
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed: running on the default asyncio loop")
        asyncio.run(serve(args.name, spec, keys=keys))
    else:
        uvloop.run(serve(args.name, spec, keys=keys))


if __name__ == "__main__":
    main()
