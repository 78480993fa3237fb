"""Two stage processes on one host's cores: milliseconds per forward of each, alone and together.

A launched run puts the skeleton stage and a branch stage of one CPU in two processes. This
times a decoding-sized forward (one row of --tokens tokens, the default model) in one process
alone and in two processes running at once, with each process on half the cores or on all of
them, and with OpenMP's idle threads spinning (libgomp's "active"), sleeping at once ("passive")
or spinning about 0.1 ms first ("bounded", GOMP_SPINCOUNT=10000: what stage processes use, see
stages/runner.py). Two more cases run the forwards on a thread other than the one that loaded
the model (as a stage would if its model were loaded off its worker thread, stages/worker.py),
the second with the loading thread's OpenMP pool freed first (openmp.release_pool, what the async
APIs do).
Every case runs in fresh processes, because OpenMP reads its settings once, when torch loads it.

    python benchmarks/cores.py [--seconds 8] [--tokens 8] [--dtype auto|bf16|fp32]

The last stdout line is one JSON object: per case, ms per forward of each process and the ratio
to one process alone on all cores (bounded).
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
import json, sys, threading, time
import torch
from specsot_mq.loader import load_generator
from specsot_mq.model import Step
threads, start, seconds, tokens, dtype, where = sys.argv[1:]
torch.set_num_threads(int(threads))
model = load_generator(dtype=dtype, draft=None).model
cache = model.new_cache(1, 4 * int(tokens))
ids = torch.ones(1, int(tokens), dtype=torch.long)
positions = torch.arange(int(tokens))[None]
def forward():
    with torch.inference_mode():
        model(ids, cache, Step.fresh(positions, logit_rows=[int(tokens) - 1]))
def measure(out):
    torch.set_num_threads(int(threads))  # OpenMP's thread count is per thread
    for _ in range(3):
        forward()
    time.sleep(max(0.0, float(start) - time.time()))  # the processes of one case start together
    began, n = time.perf_counter(), 0
    while time.perf_counter() - began < float(seconds):
        forward()
        n += 1
    out["ms"] = (time.perf_counter() - began) / n * 1000
out = {}
if where != "same":  # the model was loaded (and prepacked) on this thread; forwards run on another
    if where == "other, pool freed":
        from specsot_mq.openmp import release_pool
        release_pool()
    worker = threading.Thread(target=measure, args=(out,))
    worker.start()
    worker.join()
else:
    measure(out)
print(json.dumps(out))
"""

POLICIES = {  # what each name sets before torch loads OpenMP (libgomp)
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "bounded": {"GOMP_SPINCOUNT": "10000"},  # stages/runner.py
}


def run_case(threads: list[int], policy: str, seconds: float, tokens: int, dtype: str, where: str = "same") -> list[float]:
    """ms per forward of each process (one per entry of threads), all started at once."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | POLICIES[policy]
    start = time.time() + 20  # time to load the model in every process first
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(t), str(start), str(seconds), str(tokens), dtype, where],
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
    cases = [  # (name, threads of each process, OpenMP wait policy, thread running the forwards)
        ("alone, all cores", [cores], "bounded", "same"),
        ("alone, all cores", [cores], "active", "same"),
        ("alone, all cores", [cores], "passive", "same"),
        ("alone, all cores, another thread", [cores], "bounded", "other"),
        ("alone, all cores, another thread, the loader's pool freed", [cores], "bounded", "other, pool freed"),
        ("alone, half the cores", [half], "bounded", "same"),
        ("two, half the cores each", [half, half], "bounded", "same"),
        ("two, all cores each", [cores, cores], "bounded", "same"),
        ("two, all cores each", [cores, cores], "active", "same"),
        ("two, all cores each", [cores, cores], "passive", "same"),
    ]
    console = Console(stderr=True)
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:  # fmt: skip
        task = progress.add_task("cases", total=len(cases))
        for name, threads, policy, where in cases:
            progress.update(task, description=f"{name} ({policy})")
            results.append((name, threads, policy, run_case(threads, policy, args.seconds, args.tokens, args.dtype, where)))
            progress.advance(task)
    base = results[0][3][0]
    table = Table(title=f"ms per forward (1 x {args.tokens} tokens, {args.dtype}), {cores} cores: {cpu_name()}")
    for column in ("processes", "threads each", "OpenMP waiting", "ms per forward", "vs alone (bounded)"):
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
