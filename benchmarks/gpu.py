"""The prepared GPU check: the CUDA tests and the GPU benchmarks in one run, one JSON line out.

Runs, each as its own process with a time limit, so one failure leaves the rest standing:
  tests     tests/test_cuda.py and tests/test_cuda_graphs.py
  decode    decode.py --device cuda: our plain greedy decode (captured steps) against transformers
            `generate`, one sequence, and the bandwidth floor
  eager     the same decode with SPECSOT_CUDA_GRAPHS=0 (what --no-cuda-graphs runs)
  eagle     eagle.py --device cuda: EAGLE against our plain decode, with a sweep of tree shapes
  sot       sot.py --device cuda on the general questions: SpecSoT's answer latency against
            transformers `generate`
  ask       what `specsot ask --device cuda` runs (load_generator + SoTEngine), warm: the third of
            three answers to the README's question is timed
  exact     fp32 on the GPU: EAGLE greedy decoding of the default model, one sequence and four
            together, gives plain greedy decoding's tokens
  curve     step.py --device cuda: one step's time over rows x new tokens, captured and eager
  train     `specsot train-draft --device cuda`: templated questions of every kind (--prompts mixed)
            written by --workers processes for
            --data-seconds, then --epochs of training (the recipe of the shipped head: 24 epochs at
            lr 2e-3, about 6 minutes on an H200); the head goes to --head-out
  head      eagle.py --device cuda with the head just trained (the shipped one compared): a chain
            of 4, the default tree, a chain of 2 and one guess, each without prompt lookup, then the
            default tree with it and the chooser
  direct    the same on held-out questions a router answers directly (maths, code, estimates, facts):
            router_heldout.jsonl --label direct, a chain of 4 and the default tree
  stages    `specsot run --devices 127.0.0.1#0`: the stage processes on the GPU answer two questions
            (run from /tmp: on a host where the project is installed with `pip --target`, the
            checkout's own specsot_mq/ would hide the installed one's stages)
  profile   device_profile.py --device cuda: the GPU's devices.json profile, measured

    python benchmarks/gpu.py [--only decode,eagle] [--out results.json] [--budget 450]
    python benchmarks/gpu.py --only train,head,tests,stages,profile --head-out $OUT/head.safetensors
    # 20,000 questions of every kind in two commands: the data (and one epoch), then the training
    python benchmarks/gpu.py --only train --workers 6 --data-seconds 330 --epochs 1 --budget 580
    rm /tmp/gpu-train/checkpoint-*; python benchmarks/gpu.py --only train,head,direct --data-seconds 0.01 --epochs 10 --budget 580 --head-out $OUT/head.safetensors

A GPU host that reaches no package registry needs the default model's folder under
$SPECSOT_HOME/models (benchmarks/README.md says how it travels) and the wheels of the packages its
image lacks. The last stdout line is one JSON object with every part's figures (or its error).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "benchmarks/general_questions.jsonl"
SHIPPED = ROOT / "specsot_mq/drafts/smollm2-135m-instruct.safetensors"
SPECSOT = [shutil.which("specsot") or "specsot"]  # the installed command (the checkout's cli/ is specsot_mq.cli there)
ASK = "Give me three tips for staying healthy."


def last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def run(name: str, argv: list[str], limit: float, env: dict | None = None) -> dict:
    """One part as a process: its last JSON line, or what went wrong, and its seconds."""
    start = time.perf_counter()
    print(f"== {name}: {' '.join(argv)}", flush=True)
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=limit, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {limit:.0f} s", "wall_s": round(time.perf_counter() - start, 1)}
    print(done.stdout[-3000:], done.stderr[-2000:], sep="\n", flush=True)
    result = last_json(done.stdout) or {}
    if done.returncode:
        result["error"] = f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1][:300] if done.stderr.strip() else ''}"
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def ask_warm(device: str) -> dict:
    """`specsot ask`'s path, warm: three answers to the README question, the last timed."""
    import torch

    from specsot_mq.cuda_graphs import capture_report
    from specsot_mq.decode_params import TreeParams
    from specsot_mq.loader import load_generator
    from specsot_mq.sampling_params import SamplingParams
    from specsot_mq.sot.engine import SoTEngine
    from specsot_mq.sot.flow import SoTConfig, answer_tokens

    gen = load_generator(None, device=device, num_slots=8, tree=TreeParams())
    engine = SoTEngine(gen, SoTConfig())
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        answer = engine.generate(ASK, SamplingParams(max_tokens=256))
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    graphs = capture_report(gen.cache) if gen.cache.graphs is not None else None
    return {"answers_s": [round(s, 3) for s in seconds], "warm_s": round(seconds[-1], 3), "mode": answer.mode,
            "tokens": answer_tokens(answer), "cuda_graphs": graphs, "text": answer.answer[:400]}  # fmt: skip


def exact(device: str, new_tokens: int = 96) -> dict:
    """fp32 on the device: EAGLE greedy decoding, each prompt alone and all together, gives plain
    greedy decoding's tokens."""
    import torch

    from specsot_mq.decode_params import TreeParams
    from specsot_mq.loader import load_generator
    from specsot_mq.sampling_params import SamplingParams

    prompts = [json.loads(line)["question"] for line in QUESTIONS.read_text().splitlines()[:4]]
    params = SamplingParams(max_tokens=new_tokens)
    eagle = load_generator(None, dtype="fp32", device=device, num_slots=4, tree=TreeParams(adaptive=False))
    plain = load_generator(None, dtype="fp32", device=device, num_slots=4, draft="none", tree=TreeParams(lookup=0))
    want = [c.token_ids for c in plain.generate_many(prompts, params)]
    alone = [eagle.generate(p, params).token_ids for p in prompts]
    together = [c.token_ids for c in eagle.generate_many(prompts, params)]
    same = sum(a == w for a, w in zip(alone, want)) + sum(t == w for t, w in zip(together, want))
    return {"same": same, "of": 2 * len(prompts), "dtype": "fp32", "tokens": new_tokens,
            "graphs": bool(eagle.cache.graphs), "torch": torch.__version__}  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--only", default="tests,decode,ask,sot,exact,curve,eagle,eager")
    p.add_argument("--budget", type=float, default=450, help="seconds for the whole check (parts left out past it)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # runs one in-process part (a child)
    p.add_argument("--head-out", default="/tmp/gpu-head.safetensors", help="where train writes its head")
    p.add_argument("--train-questions", type=int, default=20000)
    p.add_argument("--data-seconds", type=float, default=100)
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--workers", type=int, default=4)
    args = p.parse_args(argv)
    if args.part:
        result = {"ask": ask_warm, "exact": exact}[args.part](args.device)
        print(json.dumps(result), flush=True)
        return result
    py = sys.executable
    dev = ["--device", args.device]
    stage_device = "127.0.0.1#0" if args.device.startswith("cuda") else "127.0.0.1#cpu"

    def heads_on(*questions: str) -> list[str]:
        """eagle.py: the head train wrote against the shipped one, on these questions and trees."""
        return [py, "benchmarks/eagle.py", *dev, "--draft", args.head_out, "--compare-draft", str(SHIPPED),
                "--new-tokens", "160", *questions]
    parts = {  # in the order they run: the budget leaves out the last first
        "tests": ([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py", "tests/test_cuda_graphs.py",
                   "-k", "not fused"], 120, None),  # (the fused kernels: their interpreter test is for a CPU)
        "decode": ([py, "benchmarks/decode.py", *dev, "--limit", "2", "--new-tokens", "256", "--runs", "2"], 150, None),
        "ask": ([py, "benchmarks/gpu.py", *dev, "--part", "ask"], 120, None),
        "sot": ([py, "benchmarks/sot.py", *dev, "--questions", str(QUESTIONS), "--limit", "10",
                 "--engines", "hf,eagle,specsot", "--plot", "/tmp/sot.png"], 200, None),
        "exact": ([py, "benchmarks/gpu.py", *dev, "--part", "exact"], 120, None),
        "curve": ([py, "benchmarks/step.py", *dev, "--runs", "10"], 90, None),
        "eagle": ([py, "benchmarks/eagle.py", *dev, "--limit", "2", "--new-tokens", "192",
                   "--sweep", "4x4x1,2x1x2,8x4x2+4,16x5x4+8"], 150, None),
        "eager": ([py, "benchmarks/decode.py", *dev, "--limit", "1", "--new-tokens", "128", "--runs", "1"], 90,
                  {"SPECSOT_CUDA_GRAPHS": "0"}),
        "train": ([*SPECSOT, "train-draft", *dev, "--prompts", "mixed", "--questions", str(args.train_questions),
                   "--batch", "128", "--workers", str(args.workers), "--data-seconds", str(args.data_seconds),
                   "--epochs", str(args.epochs), "--lr", "2e-3", "--work-dir", "/tmp/gpu-train", "--out", args.head_out], 570, None),
        "head": (heads_on("--questions", str(QUESTIONS), "--limit", "3", "--sweep", "4x4x1,2x1x2,2x2x1,1x1x1"), 120, None),
        "direct": (heads_on("--questions", str(ROOT / "benchmarks/router_heldout.jsonl"), "--label", "direct",
                            "--limit", "4", "--sweep", "4x4x1,2x1x2"), 120, None),
        "stages": (["bash", "-c", f"cd /tmp && printf '{ASK}\\nName three planets and one fact about each.\\n' | "
                    f"{' '.join(SPECSOT)} run --devices {stage_device} --run gpu"], 80, None),
        "profile": ([py, "benchmarks/device_profile.py", *dev, "--tokens", "32", "--max-batch", "64"], 70, None),
    }
    wanted = [name for name in parts if name in args.only.split(",")]
    start = time.perf_counter()
    results = {}
    import torch

    if torch.cuda.is_available():
        results["gpu"] = torch.cuda.get_device_name()
    results.update(torch=torch.__version__, cuda=torch.version.cuda)
    for name in wanted:
        left = args.budget - (time.perf_counter() - start)
        if left < 30:
            results[name] = {"error": "left out: the check's time budget ran out"}
            continue
        argv_, limit, env = parts[name]
        results[name] = run(name, argv_, min(limit, left), env)
    results["total_s"] = round(time.perf_counter() - start, 1)
    line = json.dumps(results)
    if args.out:
        args.out.write_text(line + "\n")
    print(line, flush=True)
    return results


if __name__ == "__main__":
    main()
