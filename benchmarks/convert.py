"""A GGUF file's first open: its conversion into a model folder, this checkout against the code at
git revision REV, side by side.

Each round converts the file into a new folder in a fresh process (what `specsot pull FILE.gguf`
runs: gguf_convert.convert_gguf), once with this checkout's code and, with --against, once with
REV's (a temporary worktree first on the process's PYTHONPATH), taking turns. Prints per way the
median seconds of the whole process and of the conversion inside it (its imports included), its
peak memory, the ratio REV / this; then whether the two folders hold the same config, the same
weights file and tokenizers that give the same ids and text on a few texts. The last line is JSON.

    python benchmarks/convert.py [--gguf FILE] [--against REV] [--rounds 3]

Without --gguf, the default model's file (downloaded as `specsot pull` downloads it).
"""

from __future__ import annotations

import argparse
import hashlib
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
CHILD = """
import json, resource, sys, time
from pathlib import Path
start = time.perf_counter()
from specsot_mq.gguf_convert import convert_gguf
convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]), progress=False)
print(json.dumps({"convert_s": time.perf_counter() - start,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""
TEXTS = ["Skeleton-of-Thought: outline first,\n then expand 3 points! ünïcödé 🚀", "In 2024, 365.25 days; x=12345",
         "<|im_start|>user\nHi<|im_end|>\n", "def f(x):\n    return x**2\n", "日本語のテキスト。", "end.\n\n- item"]  # fmt: skip


def convert(gguf: Path, out: Path, tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", CHILD, str(gguf), str(out)], capture_output=True, text=True, env=env, cwd=tree)
    if run.returncode:
        sys.exit(f"benchmarks/convert.py: converting with {tree} failed:\n{run.stderr[-2000:]}")
    return {"process_s": time.perf_counter() - start, **json.loads(run.stdout.strip().splitlines()[-1])}


def same_folders(a: Path, b: Path) -> dict:
    from specsot_mq.tokenizer import load_tokenizer

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    ta, tb = load_tokenizer(a), load_tokenizer(b)
    tokens = all(ta.encode(t, s) == tb.encode(t, s) for t in TEXTS for s in (True, False))
    text = all(ta.decode(ta.encode(t)) == tb.decode(ta.encode(t)) for t in TEXTS)
    chat = [{"role": "user", "content": "Hi"}]
    template = ta.apply_chat_template(chat, add_generation_prompt=True) == tb.apply_chat_template(chat, add_generation_prompt=True)
    return {"config": json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text()),
            "weights": digest(a / "model.safetensors") == digest(b / "model.safetensors"),
            "tokenizer": tokens and text and template and ta.special == tb.special}  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, help="the file (default: the default model's)")
    p.add_argument("--against", metavar="REV", help="also convert with the code at this git revision")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="specsot-convert-"))
    trees = {"this": ROOT}
    try:
        gguf = args.gguf
        if gguf is None:
            from specsot_mq.pull import DEFAULT_MODEL, download_gguf

            gguf = download_gguf(DEFAULT_MODEL, work / "file", progress=False)
        if not Path(gguf).is_file():
            sys.exit(f"benchmarks/convert.py: --gguf {gguf}: no such file")
        if args.against:
            trees[args.against] = work / "rev"
            added = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(trees[args.against]), args.against],
                                   capture_output=True, text=True)  # fmt: skip
            if added.returncode:
                sys.exit(f"benchmarks/convert.py: --against {args.against}: {added.stderr.strip()}")
        def folder(way: str, r: int) -> Path:  # round r's output of one way (a REV may hold "/")
            return work / f"{way.replace('/', '_')}-{r}"

        runs = {way: [] for way in trees}
        for r in range(args.rounds):
            for way, tree in trees.items():
                runs[way].append(convert(Path(gguf), folder(way, r), tree))
                print(f"round {r + 1}/{args.rounds} {way:>10}: {runs[way][-1]['process_s']:.2f} s", file=sys.stderr)
        result = {"gguf": Path(gguf).name, "size_mb": round(Path(gguf).stat().st_size / 2**20, 1), "rounds": args.rounds}
        print(f"\n{result['gguf']} ({result['size_mb']} MB), median of {args.rounds}:")
        print(f"{'code':>12} {'process s':>10} {'convert s':>10} {'peak MB':>8}")
        for way, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in ("process_s", "convert_s", "peak_mb")}
            result[way] = {k: round(v, 3) for k, v in med.items()}
            print(f"{way:>12} {med['process_s']:>10.2f} {med['convert_s']:>10.2f} {med['peak_mb']:>8.0f}")
        if args.against:
            ratio = result[args.against]["process_s"] / result["this"]["process_s"]
            result["rev_over_this"] = round(ratio, 2)
            result["same"] = same_folders(folder("this", 0), folder(args.against, 0))
            print(f"{args.against} / this: {ratio:.2f}x; the same folder: {result['same']}")
        print(json.dumps(result))
        return result
    finally:
        if args.against:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "rev")], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
