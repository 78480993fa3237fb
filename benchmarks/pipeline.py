"""Answers per minute of a launched stage topology at 1, 4 and 8 concurrent clients, against the
in-process engine answering the same questions one at a time, plus every device stage's peak memory.
Each client count gets a fresh launch: a stage's History (prompt lookup's guesses from what it wrote
lately) would copy its greedy answers to the questions asked at the count before. The in-process
engine and the launches run minutes apart, on machines whose speed drifts: to compare two commits'
launches, `benchmarks/versus.py --launch` takes turns instead.

    python benchmarks/pipeline.py --limit 16 --max-tokens 64

The pipeline gains by overlapping phases (request 2's skeleton while request 1's points decode) and
by batching the points of several requests in a branch stage. Last line: one JSON object with
`pipeline_vs_inproc_N` for each client count N, answers per minute, and peak memory per stage.
`--soak N` then sends N more requests (4 clients) and reports each stage's memory (RSS once idle)
before them and after each quarter of them. `--split-devices D` then launches the model split by
layers over the devices D (`--split layers`, draft none on both sides; each device given a memory
budget of `--split-memory` times the model's weight bytes, 0.75 by default: none could hold it whole)
beside the same model whole on --devices, and reports split over whole answers per minute at each
client count:

    python benchmarks/pipeline.py --draft none --split-devices 127.0.0.1#cpu0,127.0.0.1#cpu1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from decode import load_prompts, run_script  # noqa: E402  (a sibling script)

from specsot_mq.client import Client  # noqa: E402
from specsot_mq.devices import parse_devices  # noqa: E402
from specsot_mq.stages.launch import Launcher, plan_run, wait_ready  # noqa: E402
from specsot_mq.messages import Answer  # noqa: E402
from specsot_mq.sampling import SamplingParams  # noqa: E402
from specsot_mq.sot.scheduler import default_profiles_path, load_profiles  # noqa: E402


def budget_file(args, run_dir: Path) -> tuple[Path | None, float]:
    """A devices file giving each of --split-devices a memory budget of --split-memory times the
    model's weight bytes (below 1: no device could hold the whole model), and that budget in GB;
    (None, 0) for --split-memory 0 (devices.json as it is)."""
    if not args.split_memory:
        return None, 0.0
    from specsot_mq.config import ModelConfig
    from specsot_mq.pull import resolve_model
    from specsot_mq.split import weight_bytes

    folder = resolve_model(args.model)
    layer, embed, head = weight_bytes(folder)
    gb = round(args.split_memory * (layer * ModelConfig.from_folder(folder).num_layers + embed + head) / 1e9, 3)
    profiles = json.loads(default_profiles_path().read_text())["profiles"]
    profiles["budget"] = dict(profiles["cpu"], memory_gb=gb)
    path = run_dir / "split-devices.json"
    path.write_text(json.dumps({"profiles": profiles, "devices": dict.fromkeys(args.split_devices.split(","), "budget")}))
    return path, gb


def measure_split(args, questions, params, progress, run_dir: Path) -> tuple[dict[int, float], float]:
    """Answers per minute at each client count of a launch with the model's layers over
    --split-devices (as `specsot launch --split layers` starts it), each device with the memory
    budget of budget_file; and that budget in GB (0: devices.json's)."""
    from specsot_mq.stages.launch import LaunchOptions, start_topology

    devices_file, gb = budget_file(args, run_dir)
    if gb:
        progress.console.print(f"each split device's memory budget: {gb} GB ({args.split_memory} of the model's weights)")
    results = {}
    for n in [int(c) for c in args.clients.split(",")]:  # a fresh launch each (see main)
        launcher, spec = start_topology(LaunchOptions(
            devices=args.split_devices, topology=args.topology, split="layers", model=args.model, dtype=args.dtype,
            draft="none", threads=args.threads, point_tokens=args.max_tokens, skeleton_tokens=args.max_tokens,
            devices_file=None if devices_file is None else str(devices_file)))  # fmt: skip
        try:
            asyncio.run(wait_ready(launcher))
            with progress:
                task = progress.add_task(f"split, {n} clients", total=len(questions))
                results[n] = asyncio.run(answers_per_min(spec.client_address, params, n, questions,
                                                          done=lambda: progress.advance(task)))  # fmt: skip
        finally:
            launcher.stop()
    return results, gb


async def answers_per_min(address: str, params, n_clients: int, items: list[str], keys: dict | None = None,
                          done=None) -> float:  # fmt: skip
    """Answers per minute of the topology at `address` (its CURVE `keys` where it has them) to
    `items`, `n_clients` requests in flight at once; `done()` after each answer."""
    gate = asyncio.Semaphore(n_clients)
    async with Client(address, keys=keys) as client:
        async def one(q):
            async with gate:
                msg = await client.answer(q, params, timeout=600)
            if not isinstance(msg, Answer):
                raise RuntimeError(f"a request failed: {msg.error}")
            if done is not None:
                done()

        start = time.perf_counter()
        await asyncio.gather(*(one(q) for q in items))
        return 60 * len(items) / (time.perf_counter() - start)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--questions", type=Path, default=None)
    p.add_argument("--limit", type=int, default=16, help="questions per measurement (few leave a long tail with several clients)")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on every phase (skeleton, each point, direct)")
    p.add_argument("--devices", default="127.0.0.1#cpu")
    p.add_argument("--topology", default="p2p")
    p.add_argument("--clients", default="1,4,8")
    p.add_argument("--threads", type=int, default=None, help="torch threads per device stage (default: all of the host's cores)")
    p.add_argument("--soak", type=int, default=0, help="extra requests to check memory stays flat")
    p.add_argument("--split-devices", default=None, help="also launch the model split by layers over these devices")
    p.add_argument("--split-memory", type=float, default=0.75,
                   help="each split device's memory budget, times the model's weight bytes (0: devices.json's)")
    args = p.parse_args(argv)
    console = Console(stderr=True)
    questions, source = load_prompts(args.questions, args.limit)
    params = SamplingParams(max_tokens=args.max_tokens)
    sot = {"point_tokens": args.max_tokens, "skeleton_tokens": args.max_tokens}
    clients = [int(c) for c in args.clients.split(",")]
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console)  # fmt: skip

    # In-process: one engine, one question at a time.
    from specsot_mq.loader import load_generator
    from specsot_mq.sot.engine import SoTEngine
    from specsot_mq.sot.flow import SoTConfig

    gen = load_generator(args.model, args.dtype, "cpu", 2048, 8, args.draft)
    engine = SoTEngine(gen, SoTConfig(point_tokens=args.max_tokens, skeleton_tokens=args.max_tokens))
    engine.keep_heads()  # as the stage processes do at start
    with progress:
        task = progress.add_task("in-process, sequential", total=len(questions))
        start = time.perf_counter()
        for q in questions:
            engine.generate(q, params)
            progress.advance(task)
        inproc_apm = 60 * len(questions) / (time.perf_counter() - start)
    del engine, gen

    run_dir = Path(tempfile.mkdtemp(prefix="specsot-bench-"))
    spec = plan_run(parse_devices(args.devices), load_profiles(default_profiles_path()), args.topology, run_dir,
                    stage_threads=args.threads, model=args.model, dtype=args.dtype, draft=args.draft, sot=sot)  # fmt: skip
    results, memory = {}, {}

    async def batch(n_clients: int, items: list[str], task) -> float:
        return await answers_per_min(spec.client_address, params, n_clients, items, done=lambda: progress.advance(task))

    async def stage_memory() -> dict:
        async with Client(spec.client_address) as client:
            status = await client.status()
        return {s["stage"]: (s.get("rss_mb", 0.0), s.get("peak_rss_mb", 0.0)) for s in status.stages}

    # A fresh launch for each client count: a stage remembers what it wrote lately (prompt lookup's
    # History) and would copy its greedy answers to the questions asked at the count before.
    for i, n in enumerate(clients):
        launcher = Launcher(spec, run_dir)
        launcher.start()
        try:
            asyncio.run(wait_ready(launcher))
            with progress:
                task = progress.add_task(f"pipeline, {n} clients", total=len(questions))
                results[n] = asyncio.run(batch(n, questions, task))
            if i < len(clients) - 1:  # the memory figures and the soak: on the last launch
                continue
            time.sleep(2 * spec.heartbeat_s + 0.5)  # idle stages release freed memory on a heartbeat
            memory = asyncio.run(stage_memory())
            soak = None
            if args.soak:  # memory after each quarter of the soak: flat means no growth per request
                soak = {name: [round(now)] for name, (now, _) in memory.items()}
                task = progress.add_task(f"soak, {args.soak} requests", total=args.soak)
                done = 0
                for quarter in range(1, 5):
                    items = [questions[i % len(questions)] for i in range(done, args.soak * quarter // 4)]
                    done += len(items)
                    asyncio.run(batch(4, items, task))
                    time.sleep(2 * spec.heartbeat_s + 0.5)
                    for name, (now, _) in asyncio.run(stage_memory()).items():
                        soak[name].append(round(now))
        finally:
            launcher.stop()

    table = Table(title=f"{len(questions)} questions ({source}), {args.max_tokens} tokens per phase, {args.topology} "
                        f"over {args.devices}, {torch.get_num_threads()} threads in-process")  # fmt: skip
    for col in ("engine", "clients", "answers/min", "vs in-process"):
        table.add_column(col, justify="right")
    table.add_row("in-process", "1 (sequential)", f"{inproc_apm:.1f}", "1.00x")
    for n, apm in results.items():
        table.add_row("pipeline", str(n), f"{apm:.1f}", f"{apm / inproc_apm:.2f}x")
    Console().print(table)
    split, budget_gb = measure_split(args, questions, params, progress, run_dir) if args.split_devices else (None, 0.0)
    if split:
        cmp = Table(title=f"split by layers over {args.split_devices} against whole on {args.devices}")
        for col in ("clients", "whole answers/min", "split answers/min", "split / whole"):
            cmp.add_column(col, justify="right")
        for n, apm in split.items():
            cmp.add_row(str(n), f"{results[n]:.1f}", f"{apm:.1f}", f"{apm / results[n]:.2f}x")
        Console().print(cmp)
    mem = Table(title="stage memory (MB)")
    marks = [f"after {args.soak * q // 4}" for q in range(5)] if soak else []
    for col in ("stage", "now", "peak", *(f"soak {m}" for m in marks)):
        mem.add_column(col, justify="right")
    for name, (now, peak) in memory.items():
        mem.add_row(name, f"{now:.0f}", f"{peak:.0f}", *(map(str, soak[name]) if soak else []))
    Console().print(mem)
    summary = {"inproc_answers_per_min": round(inproc_apm, 2),
               **{f"pipeline_answers_per_min_{n}": round(a, 2) for n, a in results.items()},
               **{f"pipeline_vs_inproc_{n}": round(a / inproc_apm, 3) for n, a in results.items()},
               "peak_rss_mb": {name: round(peak) for name, (_, peak) in memory.items()}, "soak_rss_mb": soak,
               **({f"split_vs_whole_{n}": round(a / results[n], 3) for n, a in split.items()} if split else {}),
               **({f"split_answers_per_min_{n}": round(a, 2) for n, a in split.items()} if split else {}),
               **({"split_memory_gb": budget_gb} if split else {})}  # fmt: skip
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    run_script(main)
