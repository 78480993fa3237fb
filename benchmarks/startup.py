"""`specsot ask` from a fresh process: what a one-off question costs beyond its answer.

Each run is a new Python process doing what `specsot ask QUESTION` does (cli/app.py: the imports,
load_generator with 8 cache slots and the default draft head, SoTEngine, one answer), timed from
its start to its end, in two ways side by side, alternating, --rounds times each:

  lazy   the engine as it ships: a shared prompt beginning (the skeleton's instructions and worked
         examples, a point's or a direct answer's instructions; six in all) is computed the first
         time a prompt that begins with it runs
  eager  SoTEngine.keep_heads() right after the engine is made: all six computed up front, as
         the engine did before

With --against REV, a third way, alternating with the two:

  REV    lazy, with the project's code as at git revision REV (a worktree of it, first on the
         run's PYTHONPATH; this script's own worker runs there, so REV must load and answer as
         this one calls it): a start made faster or slower since REV, side by side. Its runs
         have a SPECSOT_HOME of their own, linked to every cache of the real one but the kernels
         (a kernel built from another folder's sources is built again, even where they are the
         same: the two ways would rebuild each other's), built there in its untimed first run

Prints, per way, the median seconds of the whole process and of its parts (interpreter and
imports, loading, making the engine, the answer), the ratio eager / lazy of the whole (and REV /
lazy), and whether lazy and eager gave the same answer (they must: only when the same tokens are
computed changes; REV's answers are compared too, and may differ where decoding changed since).
The last line is JSON.

    python benchmarks/startup.py [--rounds 3] [--question "..."]... [--against REV]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

QUESTIONS = ["Give me three tips for staying healthy.", "How can I improve my public speaking?"]
ROOT = Path(__file__).resolve().parents[1]
PARTS = ("imports", "load", "engine", "answer")


def worker(way: str, question: str) -> None:
    """One run (a process of its own): the parts' seconds and the answer, as one JSON line."""
    began = time.perf_counter()
    from specsot_mq.loader import load_generator
    from specsot_mq.sampling import REPEAT_STOP, SamplingParams
    from specsot_mq.sot.engine import SoTEngine
    from specsot_mq.sot.flow import SoTConfig

    marks = [time.perf_counter()]
    gen = load_generator(None, num_slots=8)
    marks.append(time.perf_counter())
    engine = SoTEngine(gen, SoTConfig())
    if way == "eager":  # (any other way: lazy)
        engine.keep_heads()
    marks.append(time.perf_counter())
    answer = engine.generate(question, SamplingParams(max_tokens=256, repeat_stop=REPEAT_STOP))
    marks.append(time.perf_counter())
    parts = dict(zip(PARTS, (b - a for a, b in zip([began, *marks], marks))))
    print(json.dumps({"parts": parts, "text": answer.answer, "mode": answer.mode}), flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--question", action="append", default=None, help="(repeatable; default: two questions)")
    p.add_argument("--against", metavar="REV", help="also run lazy with the code at this git revision")
    p.add_argument("--json-only", action="store_true")
    p.add_argument("--worker", nargs=2, metavar=("WAY", "QUESTION"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    tree = home = None
    if args.against:
        from specsot_mq.pull import specsot_home

        tree = tempfile.mkdtemp(prefix="specsot-startup-")
        added = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", tree, args.against],
                               capture_output=True, text=True)  # fmt: skip
        if added.returncode:
            shutil.rmtree(tree, ignore_errors=True)
            sys.exit(f"benchmarks/startup.py: --against {args.against}: {added.stderr.strip()}")
        home = Path(tempfile.mkdtemp(prefix="specsot-startup-home-"))
        for entry in specsot_home().iterdir():
            if entry.name != "kernels":
                (home / entry.name).symlink_to(entry)
    try:
        return measure(args, tree, home)
    finally:
        if tree:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", tree], capture_output=True)
            shutil.rmtree(home, ignore_errors=True)  # (its links only: never what they point to)


def measure(args, tree: str | None, home: Path | None) -> dict:
    out = Console(quiet=args.json_only, soft_wrap=True)
    questions = args.question or QUESTIONS
    at = f"at {args.against}"  # the third way's name (never "lazy" or "eager", whatever REV is called)
    ways = ("lazy", "eager", *([at] if tree else []))
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    texts: dict[tuple[str, str], set] = {}

    def run(way: str, question: str) -> dict:
        env = os.environ
        if way == at:
            env = env | {"PYTHONPATH": os.pathsep.join([tree, env.get("PYTHONPATH", "")]), "SPECSOT_HOME": str(home)}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--worker", way, question], capture_output=True, text=True, env=env)
        if done.returncode:
            sys.exit(f"benchmarks/startup.py: the {way} run failed:\n{done.stderr[-2000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["whole"] = time.perf_counter() - start
        row["parts"]["interpreter"] = row["whole"] - sum(row["parts"].values())
        texts.setdefault((way, question), set()).add(row["text"])
        return row

    for q in questions:  # untimed: kernels built, model converted, router trained, all cached
        for way in ways:
            if way != "eager":  # (eager runs lazy's code)
                run(way, q)
    for r in range(args.rounds):
        for i, q in enumerate(questions):
            for way in ways if (r + i) % 2 == 0 else reversed(ways):
                runs[way].append(run(way, q))
                print(f"\rround {r + 1}/{args.rounds}, question {i + 1}/{len(questions)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    def same(a: str, b: str) -> bool:
        return all(texts[(a, q)] == texts[(b, q)] and len(texts[(a, q)]) == 1 for q in questions)

    cols = ("whole", "interpreter", *PARTS)
    med = {way: {c: statistics.median(r[c] if c == "whole" else r["parts"][c] for r in runs[way]) for c in cols} for way in ways}
    table = Table(title=f"a fresh process answering one question, median seconds over {args.rounds} rounds x {len(questions)} questions")
    table.add_column("way")
    for c in cols:
        table.add_column(c, justify="right")
    for way in ways:
        table.add_row(way if way != at else f"lazy {at}", *(f"{med[way][c]:.2f}" for c in cols))
    out.print(table)
    ratio = med["eager"]["whole"] / med["lazy"]["whole"]
    out.print(f"lazy heads: the whole run {ratio:.3f}x as fast as eager ({med['eager']['whole']:.2f} s -> "
              f"{med['lazy']['whole']:.2f} s); the same answers both ways: {same('lazy', 'eager')}")  # fmt: skip
    result = {"rounds": args.rounds, "questions": len(questions), "median_seconds": {w: {c: round(v, 3) for c, v in med[w].items()} for w in ways},
              "eager_over_lazy": round(ratio, 3), "same_answers": same("lazy", "eager")}  # fmt: skip
    if tree:
        against = med[at]["whole"] / med["lazy"]["whole"]
        out.print(f"against {args.against}: the whole run {against:.3f}x as fast now ({med[at]['whole']:.2f} s -> "
                  f"{med['lazy']['whole']:.2f} s), loading {med[at]['load']:.2f} s -> {med['lazy']['load']:.2f} s; "
                  f"the same answers: {same('lazy', at)}")  # fmt: skip
        result |= {"against": args.against, "against_over_lazy": round(against, 3), "same_answers_as_against": same("lazy", at)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
