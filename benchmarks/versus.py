"""This checkout against another commit, in lockstep: did a change make answers faster?

The machines these benchmarks run on are shared, and their speed drifts by 10-25% between runs of
one command, more than most changes move it. So both versions stay loaded, each in a process of its
own (`--base` checked out into a temporary git worktree, its kernels built there once), and answer
the same questions in turn, question by question, the order flipped every question and round; a
process waits idle (OpenMP spinning bounded as in stage processes) while the other answers. Both
answer every question the same way (SpecSoT, EAGLE or plain), with the same greedy settings, so a
question's two times differ by the code alone. Prints, for the questions this checkout routed to
SoT and those it answered directly, the median over questions of base seconds over ours (above 1:
this checkout is faster), and the total seconds and answer tokens of each (a change that makes
answers shorter shows there); the last line is JSON.

    python benchmarks/versus.py [--base HEAD~1] [--engine specsot|eagle|plain] [--limit 40] [--rounds 2]
                                [--questions benchmarks/router_heldout.jsonl --label direct]
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

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("specsot", "eagle", "plain")


def serve(args) -> None:
    """Worker mode: load this tree's engine, then answer question indices read from stdin."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode import load_prompts

    from specsot_mq.loader import load_generator
    from specsot_mq.sampling import SamplingParams
    from specsot_mq.sot.engine import SoTEngine
    from specsot_mq.sot.flow import SoTConfig, answer_tokens
    from specsot_mq.tokenizer import chat_prompt_ids

    questions, _ = load_prompts(args.questions, args.limit, args.per_category, args.label)
    gen = load_generator(num_slots=8, draft="none" if args.engine == "plain" else "auto")
    engine = SoTEngine(gen, SoTConfig(max_parallel=8))
    if hasattr(engine, "keep_heads"):  # (a base from before lazy heads kept them all when made)
        engine.keep_heads()
    params = SamplingParams(max_tokens=args.max_tokens, repeat_stop=args.repeat_stop)

    def answer(question: str) -> tuple[str, int]:
        if args.engine == "specsot":
            a = engine.generate(question, params)
            return a.mode, answer_tokens(a)
        done = gen.generate(chat_prompt_ids(gen.tokenizer, question), params)
        return "direct", len(done.token_ids)

    def forget() -> None:
        """A fresh History of outputs (prompt lookup's guesses from earlier answers, lookup.py), so
        that no answer copies from an earlier answer to the same question (the warm-up's, a round
        before's): each round answers as a server meeting these questions for the first time."""
        if hasattr(gen, "history"):
            gen.history = type(gen.history)()

    answer(questions[0])  # warm: kernels, caches, the chooser's first measurements
    forget()
    answered = set()
    print(json.dumps({"questions": len(questions)}), flush=True)
    for line in sys.stdin:
        i = int(line)
        if i in answered:  # the next round
            forget()
            answered.clear()
        answered.add(i)
        start = time.perf_counter()
        mode, tokens = answer(questions[i])
        print(json.dumps({"s": time.perf_counter() - start, "mode": mode, "tokens": tokens}), flush=True)


class Worker:
    """One tree's engine in a process of its own."""

    def __init__(self, tree: Path, argv: list[str], home: Path | None = None):
        env = dict(os.environ, PYTHONPATH=str(tree), GOMP_SPINCOUNT="10000")
        if home is not None:  # a cache of its own: another commit may store the model folder in another format
            env["SPECSOT_HOME"] = str(home)
        script = tree / "benchmarks" / "versus.py"
        if not script.exists():  # a base older than this script: run this one against its library
            script = Path(__file__).resolve()
        self.proc = subprocess.Popen([sys.executable, str(script), "--serve", *argv], cwd=tree, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"benchmarks/versus.py: the engine of {tree} did not start (see its error above)")
        self.questions = json.loads(line)["questions"]

    def answer(self, i: int) -> dict:
        self.proc.stdin.write(f"{i}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD~1", help="the git commit to compare with (default HEAD~1)")
    p.add_argument("--engine", choices=ENGINES, default="specsot")
    p.add_argument("--questions", type=Path, default=None)
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--per-category", type=int, default=5)
    p.add_argument("--label", default=None, help="only the questions of this label (router_heldout.jsonl: direct, plan)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeat-stop", type=int, default=16)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve(args)
    worker_argv = ["--engine", args.engine, "--limit", str(args.limit), "--per-category", str(args.per_category),
                   "--max-tokens", str(args.max_tokens), "--repeat-stop", str(args.repeat_stop)]  # fmt: skip
    if args.label:  # (a base from before --label cannot take it)
        worker_argv += ["--label", args.label]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode import DEFAULT_QUESTIONS

    questions = args.questions or (DEFAULT_QUESTIONS if DEFAULT_QUESTIONS.is_file() else None)
    if questions is not None:  # named by path: the base's worktree has no ../shared beside it
        worker_argv += ["--questions", str(questions.resolve())]
    base_dir = Path(tempfile.mkdtemp(prefix="specsot-versus-"))
    try:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_dir), args.base], check=True,
                       capture_output=True, text=True)  # fmt: skip
    except subprocess.CalledProcessError as e:
        shutil.rmtree(base_dir, ignore_errors=True)
        sys.exit(f"benchmarks/versus.py: cannot check out --base {args.base}: {e.stderr.strip()}")
    try:
        print(f"loading {args.base} and this checkout (each builds its kernels once)...", file=sys.stderr)
        from specsot_mq.pull import specsot_home

        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.base], capture_output=True,
                             text=True).stdout.strip()  # fmt: skip
        base = Worker(base_dir, worker_argv, specsot_home() / "versus" / sha)
        ours = Worker(ROOT, worker_argv)
        times = {"base": {}, "ours": {}}
        tokens = {"base": {}, "ours": {}}  # each answer's length (greedy: the same every round)
        modes = {}  # how this checkout answered each question
        n = min(base.questions, ours.questions)
        for r in range(args.rounds):
            for i in range(n):
                pair = [("base", base), ("ours", ours)]
                for name, worker in pair if (i + r) % 2 == 0 else reversed(pair):
                    out = worker.answer(i)
                    times[name].setdefault(i, []).append(out["s"])
                    tokens[name][i] = out["tokens"]
                    if name == "ours":
                        modes[i] = out["mode"]
                print(f"\rround {r + 1}/{args.rounds}, question {i + 1}/{n}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        base.close()
        ours.close()
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_dir)], capture_output=True)
        shutil.rmtree(base_dir, ignore_errors=True)
    result = {"base": args.base, "engine": args.engine, "rounds": args.rounds}
    for mode in sorted(set(modes.values())):
        qs = [i for i in modes if modes[i] == mode]
        b = {i: statistics.median(times["base"][i]) for i in qs}
        o = {i: statistics.median(times["ours"][i]) for i in qs}
        ratio = statistics.median(b[i] / o[i] for i in qs)
        bt, ot = (sum(tokens[name][i] for i in qs) for name in ("base", "ours"))
        result[mode] = {"questions": len(qs), "median_speedup": round(ratio, 3),
                        "base_seconds": round(sum(b.values()), 2), "ours_seconds": round(sum(o.values()), 2),
                        "base_tokens": bt, "ours_tokens": ot}  # fmt: skip
        print(f"{args.engine}, {mode} ({len(qs)} questions): this checkout {ratio:.3f}x the speed of {args.base} "
              f"(median over questions); {sum(b.values()):.2f} s -> {sum(o.values()):.2f} s and {bt} -> {ot} "
              f"tokens in all")  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
