"""Two stage processes on one host's cores: milliseconds per forward of each, alone and together.

A launched run puts the skeleton stage and a branch stage of one CPU in two processes. This
times a decoding-sized forward (one row of --tokens tokens, the default model) in one process
alone and in two processes running at once, with each process on half the cores or on all of
them, and with OpenMP's idle threads spinning (its default, "active") or sleeping ("passive",
what stage processes use, see stages/runner.py). Every case runs in fresh processes, because
OpenMP reads its wait policy once, when torch loads it.

    python benchmarks/cores.py [--seconds 8] [--tokens 8] [--dtype auto|bf16|fp32]

The last stdout line is one JSON object: per case, ms per forward of each process and the ratio
to one process alone on all cores (active).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import add_dtype_option, chosen_dtype, cpu_name, run_script  # noqa: E402

CHILD = """
import json, sys, time
import torch
from specsot_mq.loader import load_generator
threads, start, seconds, tokens, dtype = sys.argv[1:]
torch.set_num_threads(int(threads))
model = load_generator(dtype=dtype, draft=None).model
cache = model.new_cache(1, 4 * int(tokens))
ids = torch.ones(1, int(tokens), dtype=torch.long)
positions = torch.arange(int(tokens))[None]
def forward():
    with torch.inference_mode():
        cache.truncate(0, 0)
        model(ids, positions, cache, last_only=True)
for _ in range(3):
    forward()
time.sleep(max(0.0, float(start) - time.time()))  # the processes of one case start together
began, n = time.perf_counter(), 0
while time.perf_counter() - began < float(seconds):
    forward()
    n += 1
print(json.dumps({"ms": (time.perf_counter() - began) / n * 1000}))
"""


def run_case(threads: list[int], policy: str, seconds: float, tokens: int, dtype: str) -> list[float]:
    """ms per forward of each process (one per entry of threads), all started at once."""
    env = dict(os.environ, OMP_WAIT_POLICY=policy.upper())
    start = time.time() + 20  # time to load the model in every process first
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(t), str(start), str(seconds), str(tokens), dtype],
                              env=env, stdout=subprocess.PIPE, text=True) for t in threads]  # fmt: skip
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a measuring process failed (its error is above)")
    return [json.loads(out.strip().splitlines()[-1])["ms"] for out in outs]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=8.0, help="how long each process runs forwards")
    p.add_argument("--tokens", type=int, default=8, help="tokens per forward (a verify of a small tree)")
    add_dtype_option(p)
    args = p.parse_args(argv)
    chosen_dtype(args)  # args.dtype: what auto picks here, for the children and the table
    cores = os.cpu_count() or 1
    half = max(1, cores // 2)
    cases = [  # (name, threads of each process, OpenMP wait policy)
        ("alone, all cores", [cores], "active"),
        ("alone, all cores", [cores], "passive"),
        ("two, half the cores each", [half, half], "active"),
        ("two, all cores each", [cores, cores], "active"),
        ("two, all cores each", [cores, cores], "passive"),
    ]
    console = Console(stderr=True)
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:  # fmt: skip
        task = progress.add_task("cases", total=len(cases))
        for name, threads, policy in cases:
            progress.update(task, description=f"{name} ({policy})")
            results.append((name, threads, policy, run_case(threads, policy, args.seconds, args.tokens, args.dtype)))
            progress.advance(task)
    base = results[0][3][0]
    table = Table(title=f"ms per forward (1 x {args.tokens} tokens, {args.dtype}), {cores} cores: {cpu_name()}")
    for column in ("processes", "threads each", "OpenMP waiting", "ms per forward", "vs alone (active)"):
        table.add_column(column, justify="right" if column.startswith(("ms", "vs", "threads")) else "left")
    out = []
    for name, threads, policy, ms in results:
        table.add_row(name, str(threads[0]), policy, " / ".join(f"{m:.1f}" for m in ms),
                      " / ".join(f"{m / base:.2f}x" for m in ms))  # fmt: skip
        out.append({"case": name, "threads": threads, "policy": policy, "ms": [round(m, 2) for m in ms],
                    "vs_alone": [round(m / base, 3) for m in ms]})  # fmt: skip
    Console().print(table)
    summary = {"cores": cores, "tokens": args.tokens, "dtype": args.dtype, "cases": out}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    run_script(main)
