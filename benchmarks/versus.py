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

`--launch` compares the two launched as topologies (`specsot launch`, each tree's own code and
stage processes, both up at once) under `--clients` concurrent clients: the questions go in rounds
of `--per-round` new ones (a stage's History would copy its answer to a question asked again),
each round answered by one launch, then the other, the order flipped every round; it prints each
round's answers per minute and the median over rounds of ours over the base's:

    python benchmarks/versus.py --launch --base HEAD~1 [--clients 8] [--per-round 16] [--limit 80]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
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


@contextmanager
def checked_out(base: str):
    """(a temporary worktree of commit `base`, the cache its processes use: another commit may
    store the model folder in another format), removed afterwards."""
    from specsot_mq.pull import specsot_home

    base_dir = Path(tempfile.mkdtemp(prefix="specsot-versus-"))
    try:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_dir), base], check=True,
                       capture_output=True, text=True)  # fmt: skip
    except subprocess.CalledProcessError as e:
        shutil.rmtree(base_dir, ignore_errors=True)
        sys.exit(f"benchmarks/versus.py: cannot check out --base {base}: {e.stderr.strip()}")
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", base], capture_output=True,
                         text=True).stdout.strip()  # fmt: skip
    try:
        yield base_dir, specsot_home() / "versus" / sha
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_dir)], capture_output=True)
        shutil.rmtree(base_dir, ignore_errors=True)


def tree_env(tree: Path, home: Path | None) -> dict:
    """The environment of a process that runs `tree`'s code (and its stage processes: they inherit it)."""
    env = dict(os.environ, PYTHONPATH=str(tree), GOMP_SPINCOUNT="10000")
    if home is not None:
        env["SPECSOT_HOME"] = str(home)
    return env


class Launched:
    """`specsot launch` of one tree (its cwd, so `python -m` finds that tree's stages), up until close()."""

    def __init__(self, tree: Path, home: Path | None, run_file: Path, max_tokens: int):
        self.run_file = run_file
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", "from specsot_mq.cli.app import main; main()", "launch",
                                      "--run", str(run_file), "--point-tokens", str(max_tokens), "--skeleton-tokens",
                                      str(max_tokens)], cwd=tree, env=tree_env(tree, home), stdout=self.log,
                                     stderr=subprocess.STDOUT)  # fmt: skip
        self.tree = tree

    def info(self, timeout: float = 900) -> dict:
        from specsot_mq.stages.launch import read_run_file

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (info := read_run_file(self.run_file)) is not None:
                return info
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        self.log.seek(0)
        sys.exit(f"benchmarks/versus.py: the launch of {self.tree} did not come up:\n{self.log.read().decode()[-1500:]}")

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def launched(args, questions: Path | None) -> dict:
    """--launch: both trees launched, rounds of new questions at --clients, in turn."""
    import asyncio

    from decode import load_prompts
    from pipeline import answers_per_min

    from specsot_mq.sampling_params import SamplingParams

    prompts, source = load_prompts(questions, args.limit)
    rounds = len(prompts) // args.per_round
    if rounds < 1:
        sys.exit(f"benchmarks/versus.py: {len(prompts)} questions make no round of --per-round {args.per_round}")
    params = SamplingParams(max_tokens=args.max_tokens, repeat_stop=args.repeat_stop)

    def per_minute(info: dict, items: list[str]) -> float:
        return asyncio.run(answers_per_min(info["client_address"], params, args.clients, items, info.get("keys")))

    rows = []
    with checked_out(args.base) as (base_dir, home), tempfile.TemporaryDirectory() as runs:
        print(f"launching {args.base} and this checkout...", file=sys.stderr)
        launches = {"base": Launched(base_dir, home, Path(runs) / "base.json", args.max_tokens),
                    "ours": Launched(ROOT, None, Path(runs) / "ours.json", args.max_tokens)}  # fmt: skip
        try:
            infos = {name: launch.info() for name, launch in launches.items()}
            for info in infos.values():  # warm: kernels, caches, the router
                per_minute(info, ["Say hello.", "Name two colours."])
            for r in range(rounds):
                items = prompts[r * args.per_round : (r + 1) * args.per_round]
                rate = {}
                for name in ("base", "ours") if r % 2 == 0 else ("ours", "base"):
                    rate[name] = per_minute(infos[name], items)
                rows.append(rate)
                print(f"round {r + 1}/{rounds}: {args.base} {rate['base']:.1f}, this checkout {rate['ours']:.1f} answers/min, "
                      f"{rate['ours'] / rate['base']:.3f}x", file=sys.stderr)  # fmt: skip
        finally:
            for launch in launches.values():
                launch.close()
    ratio = statistics.median(r["ours"] / r["base"] for r in rows)
    print(f"launched, {args.clients} clients, {rounds} rounds of {args.per_round} questions ({source}): this checkout "
          f"{ratio:.3f}x the answers per minute of {args.base} (median over rounds)")  # fmt: skip
    result = {"base": args.base, "launch": True, "clients": args.clients, "per_round": args.per_round,
              "median_speedup": round(ratio, 3), "rounds": [{k: round(v, 2) for k, v in r.items()} for r in rows]}  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


class Worker:
    """One tree's engine in a process of its own."""

    def __init__(self, tree: Path, argv: list[str], home: Path | None = None):
        env = tree_env(tree, home)
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
    p.add_argument("--limit", type=int, default=None, help="questions (default 40; with --launch 80)")
    p.add_argument("--per-category", type=int, default=5)
    p.add_argument("--label", default=None, help="only the questions of this label (router_heldout.jsonl: direct, plan)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeat-stop", type=int, default=16)
    p.add_argument("--launch", action="store_true", help="compare the two launched, under --clients concurrent clients")
    p.add_argument("--clients", type=int, default=8, help="with --launch")
    p.add_argument("--per-round", type=int, default=16, help="with --launch: new questions a round")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.limit = args.limit or (80 if args.launch else 40)
    if args.serve:
        return serve(args)
    worker_argv = ["--engine", args.engine, "--limit", str(args.limit), "--per-category", str(args.per_category),
                   "--max-tokens", str(args.max_tokens), "--repeat-stop", str(args.repeat_stop)]  # fmt: skip
    if args.label:  # (a base from before --label cannot take it)
        worker_argv += ["--label", args.label]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode import DEFAULT_QUESTIONS

    questions = args.questions or (DEFAULT_QUESTIONS if DEFAULT_QUESTIONS.is_file() else None)
    if args.launch:
        return launched(args, questions)
    if questions is not None:  # named by path: the base's worktree has no ../shared beside it
        worker_argv += ["--questions", str(questions.resolve())]
    with checked_out(args.base) as (base_dir, home):
        print(f"loading {args.base} and this checkout (each builds its kernels once)...", file=sys.stderr)
        base = Worker(base_dir, worker_argv, home)
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
