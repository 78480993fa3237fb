"""Soak under faults: N requests at C concurrent clients while a device stage is killed (SIGKILL)
every K seconds and the launcher restarts it, in the p2p and the ring topology, each beside the
same load without faults.

    python benchmarks/faults.py --requests 200 --concurrency 8 --every 30 --victims branch

Reports, per topology: requests answered, failed (with their reasons), lost (neither answered nor
failed clearly within the client's timeout) and duplicated (a request that got more than one
final message), the median and p95 latency with and without faults, the kills, and each stage's
RSS at the end. Last line: one JSON object with `answered`, `failed` and `lost` per topology.
`--victims branch` kills the branch stages in turn (two devices: one always survives);
`skeleton` kills the skeleton stage (its requests fail with its name; the rest are answered
after its restart); `range`, with `--split layers --replicas 2` and four devices, kills the layer
ranges' servers in turn, each range keeping its replica:

    python benchmarks/faults.py --split layers --replicas 2 --victims range --topologies p2p \
        --devices 127.0.0.1#cpu0,127.0.0.1#cpu1,127.0.0.1#cpu2,127.0.0.1#cpu3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from decode import cpu_name, load_prompts  # noqa: E402  (a sibling script)

from specsot_mq.client import Client  # noqa: E402
from specsot_mq.messages import Answer  # noqa: E402
from specsot_mq.sampling import REPEAT_STOP, SamplingParams  # noqa: E402
from specsot_mq.stages.launch import LaunchOptions, start_topology, wait_ready  # noqa: E402

LOST = "in time"  # the client's own timeout message: the request neither answered nor failed


def soak(args, topology: str, questions: list[str], faults: bool, progress) -> dict:
    options = LaunchOptions(devices=args.devices, topology=topology, model=args.model, point_tokens=args.max_tokens,
                            skeleton_tokens=args.max_tokens, split=args.split, replicas=args.replicas)  # fmt: skip
    launcher, spec = start_topology(options)
    kills, stop = [], threading.Event()
    try:
        asyncio.run(wait_ready(launcher))
        victims = list(spec.ranges) if args.victims == "range" else spec.named(args.victims)
        if not victims:
            raise SystemExit(f"no {args.victims} stage to kill: --victims range needs --split layers")

        def watch():  # the launcher's own loop: restart what died; kill the next victim every K s
            next_kill, turn = time.monotonic() + args.every, 0
            while not stop.wait(0.5):
                launcher.check()
                if faults and time.monotonic() >= next_kill:
                    name = victims[turn % len(victims)]
                    proc = launcher.stages[name].proc
                    if proc is not None and proc.poll() is None:
                        proc.kill()
                        kills.append(name)
                    turn, next_kill = turn + 1, time.monotonic() + args.every

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        params = SamplingParams(max_tokens=args.max_tokens, repeat_stop=REPEAT_STOP)
        task = progress.add_task(f"{topology}{' with kills' if faults else ''}", total=args.requests)

        async def go():
            gate = asyncio.Semaphore(args.concurrency)
            async with Client(spec.client_address) as client:

                async def one(i):
                    async with gate:
                        start = time.monotonic()
                        msg = await client.answer(questions[i % len(questions)], params, "auto", timeout=args.timeout)
                    progress.advance(task)
                    return msg, time.monotonic() - start

                rows = await asyncio.gather(*(one(i) for i in range(args.requests)))
                await asyncio.sleep(2)  # late duplicates arrive
                status = await client.status()
                return rows, Counter(client.finals), status

        rows, finals, status = asyncio.run(go())
    finally:
        stop.set()
        launcher.stop()
    answered = [s for m, s in rows if isinstance(m, Answer)]
    failed = [m.error for m, _ in rows if not isinstance(m, Answer) and LOST not in m.error]
    return {"answered": len(answered), "failed": len(failed), "lost": sum(1 for m, _ in rows if not isinstance(m, Answer) and LOST in m.error),
            "duplicated": sum(1 for n in finals.values() if n > 1), "reasons": dict(Counter(e[:90] for e in failed)),
            "p50": statistics.median(answered) if answered else None,
            "p95": sorted(answered)[int(0.95 * len(answered))] if answered else None, "kills": kills,
            "rss_mb": {s["stage"]: round(s.get("rss_mb", 0)) for s in status.stages}}  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--devices", default="127.0.0.1#cpu0,127.0.0.1#cpu1")
    p.add_argument("--topologies", default="p2p,ring")
    p.add_argument("--questions", type=Path, default=None)
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64, help="cap on every phase")
    p.add_argument("--every", type=float, default=30.0, help="seconds between kills")
    p.add_argument("--victims", default="branch", choices=["branch", "skeleton", "range"])
    p.add_argument("--split", default="none", choices=["none", "layers"])
    p.add_argument("--replicas", type=int, default=1, help="with --split layers: servers of each layer range")
    p.add_argument("--timeout", type=float, default=300.0, help="the client's wait for a request")
    p.add_argument("--no-baseline", action="store_true", help="skip the runs without faults")
    args = p.parse_args(argv)
    console = Console(stderr=True)
    questions, source = load_prompts(args.questions, args.limit)
    result = {"cpu": cpu_name(), "requests": args.requests, "concurrency": args.concurrency, "every_s": args.every,
              "victims": args.victims, "split": args.split, "replicas": args.replicas, "questions": source}  # fmt: skip
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console)  # fmt: skip
    with progress:
        for topology in args.topologies.split(","):
            result[topology] = {"faults": soak(args, topology, questions, True, progress)}
            if not args.no_baseline:
                result[topology]["none"] = soak(args, topology, questions, False, progress)
    table = Table(title=f"{args.requests} requests · {args.concurrency} clients · a {args.victims} stage killed every "
                        f"{args.every:.0f} s · {cpu_name()}")  # fmt: skip
    for col in ("topology", "run", "answered", "failed", "lost", "duplicated", "kills", "p50 s", "p95 s"):
        table.add_column(col, justify="left" if col in ("topology", "run") else "right")
    for topology in args.topologies.split(","):
        for run, r in result[topology].items():
            table.add_row(topology, run, *(str(r[k]) for k in ("answered", "failed", "lost", "duplicated")), str(len(r["kills"])),
                          f"{r['p50']:.2f}" if r["p50"] else "-", f"{r['p95']:.2f}" if r["p95"] else "-")  # fmt: skip
        faulted, clean = result[topology]["faults"], result[topology].get("none")
        if clean and faulted["p50"] and clean["p50"]:
            result[topology]["added_latency_p50"] = faulted["p50"] / clean["p50"]
        for reason, n in faulted["reasons"].items():
            console.print(f"[yellow]{topology}: {n} failed:[/] {reason}")
        console.print(f"{topology} RSS at the end, MB: {faulted['rss_mb']}")
    console.print(table)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
