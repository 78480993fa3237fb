"""A model split by layers over two processes, against the same model whole, in one run (issue 44).

The model (default: SmolLM2-1.7B's shape with random weights in Q4_K_M, as benchmarks/realsize.py
builds it under $SPECSOT_HOME/bench-models, else the default model; --model any name or file) runs
  whole  in one process;
  split  layers [0, a) in one process and [a, n) in a range server (specsot_mq/remote_range.py),
         their hidden states and cache operations over ZeroMQ, a where `specsot launch --split
         layers` cuts over two like devices (split.layer_ranges; --cut).
Each measures, greedy with EOS ignored: decode tok/s of one sequence and of --batch sequences
together (all their tokens over the slowest one's decode time), the prefill of a --prompt-tokens
prompt, and every process's resident memory after decoding (the split's two against the whole).
The two run one after the other, never at once. Then, as two devices of one core each (this
process on core 0, the range server on core 1, one thread each), the split's prefill of a
--prefill-tokens prompt in one piece against pipelined in chunks of --prefill-chunk tokens
(split.py: the range here computes chunk i + 1 while the server computes chunk i).

Then KV shipping (specsot_mq/kv_ship.py): the same model whole on two CPU devices of one host
(`specsot launch --devices 127.0.0.1#cpu0,127.0.0.1#cpu1`), --conversations conversations of two
turns, direct: turn 1 a --turn-tokens prompt, turn 2 a short question after it, which the scheduler
sends to the other device. Time to turn 2's first answer text with --kv-ship auto (the rule's
choice, logged: it shipped where stats say kv_shipped_tokens) and --kv-ship never (recomputed).

Then through launches (benchmarks/pipeline.py, its own process): the same model split by layers
over two CPU devices of one host, each given a memory budget of 0.75 times the model's weight
bytes (neither could hold it whole), against the model whole, answers per minute at 1 and 8
clients over --launch-limit questions, draft none on both. And faults (benchmarks/faults.py): the
default model split over four CPU devices with two servers a range (--replicas 2), a range server
killed every 30 s while 200 requests come in at 8 clients. --skip-launch and --skip-faults leave
either out.

--only-ranges: each range's time for a decode step of 1 and of --batch rows on one thread, cut half
way and where layer_ranges cuts (the last range also runs the output layer): the slower of two
ranges sets the pace of a pipeline whose ranges work on different steps at once.

    python benchmarks/split.py [--model FILE.gguf] [--new-tokens 32] [--batch 8] [--prompt-tokens 512] \
        [--prefill-tokens 2000] [--prefill-chunk 128] [--runs 3] [--turn-tokens 1000] [--conversations 3] \
        [--launch-limit 24] [--skip-launch] [--skip-faults]

Ends with one JSON line: both sides' figures, the ratios split / whole, the pipelined prefill's,
KV shipping's, and the launches' and the faults' JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import cpu_name, load_prompts, run_script  # noqa: E402
from realsize import rss_bytes  # noqa: E402

from specsot_mq.pull import resolve_model, specsot_home  # noqa: E402

SCRIPT = str(Path(__file__).resolve())


def default_model() -> str | None:
    files = sorted((specsot_home() / "bench-models" / "smollm2-1.7b").glob("*Q4_K_M.gguf"))
    return str(files[0]) if files else None


def measure(args) -> dict:
    """In this process: the whole model, or layers [0, cut) with the rest at args.address."""
    import torch

    from specsot_mq.generate import Generator
    from specsot_mq.loader import load_model
    from specsot_mq.sampling import SamplingParams
    from specsot_mq.tokenizer import load_tokenizer

    folder = resolve_model(args.model, auto_pull=False)
    if args.address:
        from specsot_mq.remote_range import RemoteRange
        from specsot_mq.split import SplitModel

        local = load_model(folder, layers=(0, args.cut))
        model = SplitModel([local, RemoteRange(args.address, local.cfg, local.dtype, timeout_s=600)])
    else:
        model = load_model(folder)
    prompts, _ = load_prompts(None, args.batch)
    prompts = [prompts[i % len(prompts)] for i in range(args.batch)]
    gen = Generator(model, load_tokenizer(folder), max_len=args.prompt_tokens + args.new_tokens + 16,
                    num_slots=args.batch)  # fmt: skip
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    gen.generate(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    one = gen.generate(prompts[0], params)
    many = gen.generate_many(prompts, params)
    decode_s = max(c.seconds - c.prefill_seconds for c in many)
    ids = torch.randint(10, model.cfg.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    gen.generate(ids.tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
    prefill_s = time.perf_counter() - start
    return {"decode_tok_s": round(one.tokens_per_second, 2),
            "batch_tok_s": round(sum(len(c.token_ids) - 1 for c in many) / decode_s, 2),
            "prefill_tok_s": round(args.prompt_tokens / prefill_s, 1), "rss_mb": round(rss_bytes() / 2**20, 1),
            "layers": model.cfg.num_layers}  # fmt: skip


def measure_prefill(args) -> dict:
    """In this process, on one core: layers [0, cut) here and the rest at args.address (also on a
    core of its own), a --prefill-tokens prompt's prefill in one piece and pipelined in chunks."""
    import statistics

    import torch

    from specsot_mq.loader import load_model
    from specsot_mq.model import Step
    from specsot_mq.remote_range import RemoteRange
    from specsot_mq.split import SplitModel

    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    local = load_model(resolve_model(args.model, auto_pull=False), layers=(0, args.cut))
    model = SplitModel([local, RemoteRange(args.address, local.cfg, local.dtype, timeout_s=600)])
    t = args.prefill_tokens
    ids = torch.randint(10, model.cfg.vocab_size, (1, t), generator=torch.Generator().manual_seed(0))
    step = Step.fresh(torch.arange(t)[None], logit_rows=[t - 1])

    def prefill(chunk: int) -> float:
        model.prefill_chunk = chunk
        cache = model.new_cache(1, t)
        start = time.perf_counter()
        with torch.inference_mode():
            model(ids, cache, step)
        return time.perf_counter() - start

    chunks = [0, args.prefill_chunk]
    prefill(args.prefill_chunk)  # warm-up
    runs = {c: [] for c in chunks}
    for _ in range(args.runs):  # alternating, so neither finds the machine warmer
        for c in chunks:
            runs[c].append(prefill(c))
    one, piped = (statistics.median(runs[c]) for c in chunks)
    return {"prefill_tokens": t, "chunk": args.prefill_chunk, "one_piece_s": round(one, 3), "pipelined_s": round(piped, 3),
            "pipelined_speedup": round(one / piped, 3)}  # fmt: skip


def child(args, address: str | None = None, pipelined: bool = False) -> dict:
    argv = [sys.executable, SCRIPT, "--child", "--model", args.model, "--cut", str(args.cut), "--batch", str(args.batch),
            "--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens), "--runs", str(args.runs),
            "--prefill-tokens", str(args.prefill_tokens), "--prefill-chunk", str(args.prefill_chunk)]  # fmt: skip
    if address:
        argv += ["--address", address]
    if pipelined:
        argv.append("--pipelined")
    # an idle OpenMP thread spins ~0.1 ms, then sleeps (as in stage processes): the side waiting for
    # the other's reply leaves it the cores
    return run_json(argv, f"the {'split' if address else 'whole'} run", env={**os.environ, "GOMP_SPINCOUNT": "10000"})


def run_json(argv: list[str], what: str, env: dict | None = None, show: bool = False) -> dict:
    """Run a benchmark process and return its last stdout line, the JSON object each ends with;
    `show`: pass its output through (its tables, its progress on stderr), else keep stderr for
    the error a failed run raises."""
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=None if show else subprocess.PIPE, text=True, env=env)
    if show:
        print(done.stdout, end="", flush=True)
    if done.returncode:
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{(done.stderr or '')[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def range_server(args, n: int, core: int | None = None):
    """A range server for layers [cut, n) (on one core of its own where `core` is given): (its
    address, its process), stopped on leaving."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if core is not None else None
    server = subprocess.Popen([sys.executable, "-m", "specsot_mq.remote_range", "--model", args.model, "--layers",
                               f"{args.cut}:{n}", "--bind", address], stderr=subprocess.DEVNULL, env=env,
                              preexec_fn=None if core is None else lambda: os.sched_setaffinity(0, {core}))  # fmt: skip
    try:
        yield address, server
    finally:
        server.terminate()
        server.wait(timeout=60)


def measure_turns(args) -> dict:
    """Turn 2's time to first answer text on the device that did not decode turn 1, per --kv-ship
    mode (module docstring)."""
    import asyncio
    import statistics

    from specsot_mq.client import Client
    from specsot_mq.messages import Answer, AnswerText
    from specsot_mq.sampling import SamplingParams
    from specsot_mq.stages.launch import LaunchOptions, start_topology, wait_ready
    from specsot_mq.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(args.model, auto_pull=False))
    questions, _ = load_prompts(None, 200)
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def first_turn(c: int) -> str:  # a long message of its own per conversation: no stored beginning is shared
        lines, n = [], 0
        for q in questions[c::2] + questions:
            lines.append(f"- {q}")
            n += len(tok.encode(q)) + 2
            if n >= args.turn_tokens:
                break
        return "Here are some questions:\n" + "\n".join(lines) + "\nWhich of them is the hardest to answer?"

    async def conversation(client, c: int) -> tuple[float, int]:
        q1 = first_turn(c)
        first = await client.answer(q1, params, "never", timeout=900)
        if not isinstance(first, Answer):
            raise RuntimeError(f"turn 1 of conversation {c} failed: {first.error}")
        history = [{"role": "user", "content": q1}, {"role": "assistant", "content": first.answer}]
        began, ttft = time.perf_counter(), None
        async for msg in client.ask("Why?", params, "never", timeout=900, history=history):
            if ttft is None and isinstance(msg, AnswerText) and msg.text:
                ttft = time.perf_counter() - began
            if isinstance(msg, Answer):
                return ttft, msg.stats.get("kv_shipped_tokens", 0)
        raise RuntimeError(f"turn 2 of conversation {c} failed")

    out = {}
    for mode in ("auto", "never"):
        launcher, spec = start_topology(LaunchOptions(devices="127.0.0.1#cpu0,127.0.0.1#cpu1", model=args.model,
                                                      draft="none", kv_ship=mode))  # fmt: skip
        try:
            asyncio.run(wait_ready(launcher))

            async def talk():
                async with Client(spec.client_address) as client:
                    return [await conversation(client, c) for c in range(args.conversations)]

            turns = asyncio.run(talk())
        finally:
            launcher.stop()
        out[mode] = {"ttft_s": round(statistics.median(t for t, _ in turns), 3), "ttfts_s": [round(t, 3) for t, _ in turns],
                     "shipped_tokens": [s for _, s in turns]}  # fmt: skip
        print(f"--kv-ship {mode}: turn 2's first text after {out[mode]['ttfts_s']} s; KV shipped for "
              f"{out[mode]['shipped_tokens']} tokens", flush=True)  # fmt: skip
    out["turn_tokens"] = args.turn_tokens
    out["shipped_vs_recomputed"] = round(out["never"]["ttft_s"] / out["auto"]["ttft_s"], 2)
    return out


def range_steps(folder: Path, cuts: dict[str, int], batch: int, runs: int = 25) -> dict:
    """Each range's median time (ms) for a decode step of 1 and of `batch` rows, one thread, at
    each named cut."""
    import torch

    from specsot_mq.config import ModelConfig
    from specsot_mq.loader import load_model
    from specsot_mq.model import Step

    torch.set_num_threads(1)
    n = ModelConfig.from_folder(folder).num_layers

    def step_ms(model, rows: int) -> float:
        cache = model.new_cache(rows, 256)
        x = torch.randint(0, 100, (rows, 1)) if model.first_layer == 0 else torch.randn(rows, 1, model.cfg.hidden_size)
        step, times = Step(list(range(rows)), [100] * rows, torch.full((rows, 1), 100)), []
        with torch.inference_mode():
            for _ in range(runs + 5):  # the first five warm up
                start = time.perf_counter()
                model(x, cache, step)
                times.append(time.perf_counter() - start)
        return round(sorted(times[5:])[runs // 2] * 1000, 2)

    result = {}
    for name, cut in cuts.items():
        ranges = []
        for bounds in ((0, cut), (cut, n)):
            model = load_model(folder, layers=bounds)
            ranges.append({"layers": list(bounds), "ms_1": step_ms(model, 1), f"ms_{batch}": step_ms(model, batch)})
            del model
        result[name] = ranges
    return result


def script_json(script: str, argv: list[str]) -> dict:
    """A sibling benchmark script run in its own process, its output shown (run_json)."""
    cmd = [sys.executable, str(Path(__file__).resolve().parent / script), *argv]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    return run_json(cmd, script, show=True)


def launches(args) -> dict:
    """Answers per minute split over whole through launches (pipeline.py), each split device given
    less memory than the model."""
    got = script_json("pipeline.py", ["--draft", "none", "--split-devices", "127.0.0.1#cpu0,127.0.0.1#cpu1",
                                      "--split-memory", "0.75", "--model", args.model, "--limit", str(args.launch_limit),
                                      "--max-tokens", "32", "--clients", "1,8"])  # fmt: skip
    return {k: v for k, v in got.items() if k.startswith(("split", "pipeline_answers"))}


def faults() -> dict:
    """200 requests at 8 clients with a range server killed every 30 s, two servers a range
    (faults.py, the default model over four CPU devices)."""
    got = script_json("faults.py", ["--split", "layers", "--replicas", "2", "--victims", "range", "--topologies", "p2p",
                                    "--devices", ",".join(f"127.0.0.1#cpu{i}" for i in range(4)), "--no-baseline",
                                    "--questions", str(Path(__file__).resolve().parent / "general_questions.jsonl")])  # fmt: skip
    run = got["p2p"]["faults"]
    return {k: run[k] for k in ("answered", "failed", "lost", "duplicated", "p50", "p95")} | {"kills": len(run["kills"])}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model name, folder or .gguf (default: see above)")
    p.add_argument("--cut", type=int, default=None, help="the first layer of the second process (default: half)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--prefill-tokens", type=int, default=2000, help="the pipelined prefill's prompt")
    p.add_argument("--prefill-chunk", type=int, default=128, help="its chunks' tokens")
    p.add_argument("--runs", type=int, default=3, help="prefills each way (the median counts)")
    p.add_argument("--turn-tokens", type=int, default=1000, help="KV shipping: turn 1's prompt")
    p.add_argument("--conversations", type=int, default=3, help="KV shipping: conversations each way (the median counts)")
    p.add_argument("--only-turns", action="store_true", help="measure KV shipping alone")
    p.add_argument("--only-ranges", action="store_true", help="measure each range's step time alone")
    p.add_argument("--launch-limit", type=int, default=24, help="questions through the launches")
    p.add_argument("--skip-launch", action="store_true", help="leave out answers per minute through launches")
    p.add_argument("--skip-faults", action="store_true", help="leave out the replica-kill soak")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pipelined", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = measure_prefill(args) if args.pipelined else measure(args)
        print(json.dumps(result), flush=True)
        return result
    from specsot_mq.config import ModelConfig
    from specsot_mq.split import layer_ranges, weight_bytes

    args.model = args.model or default_model()
    folder = resolve_model(args.model)  # converted once, before anything is timed
    args.model = args.model or str(folder)
    n = ModelConfig.from_folder(folder).num_layers
    layer, embed, head = weight_bytes(folder)
    balanced = layer_ranges(n, int(layer), [1e15, 1e15], embed, head)[0][1]  # two like devices, room to spare
    args.cut = args.cut or balanced
    if not 0 < args.cut < n:
        p.error(f"--cut {args.cut}: give a layer between 1 and {n - 1}")
    if args.only_ranges:
        steps = range_steps(folder, {"half": n // 2, "layer_ranges": balanced}, args.batch)
        print(f"{Path(args.model).name} | {cpu_name()} | one thread | a decode step's ms (1 row / {args.batch} rows)")
        for name, ranges in steps.items():
            cells = "   ".join(f"{r['layers'][0]}:{r['layers'][1]} {r['ms_1']} / {r[f'ms_{args.batch}']}" for r in ranges)
            slowest = [max(r[key] for r in ranges) for key in ("ms_1", f"ms_{args.batch}")]
            print(f"{name:>13}: {cells}   slower range {slowest[0]} / {slowest[1]}")
        pace = [round(max(r[key] for r in steps["half"]) / max(r[key] for r in steps["layer_ranges"]), 3)
                for key in ("ms_1", f"ms_{args.batch}")]  # fmt: skip
        print(f"the slower range, half over layer_ranges' cut: {pace[0]}x (1 row), {pace[1]}x ({args.batch} rows)")
        result = {"model": Path(args.model).name, "cpu": cpu_name(), "ranges": steps, "half_over_balanced": pace}
        print(json.dumps(result), flush=True)
        return result
    if args.only_turns:
        turns = measure_turns(args)
        print(json.dumps({"model": Path(args.model).name, "cpu": cpu_name(), "kv_shipping": turns}), flush=True)
        return turns
    whole = child(args)
    with range_server(args, n) as (address, server):
        split = child(args, address)
        split["server_rss_mb"] = round(rss_bytes(server.pid) / 2**20, 1)
    if len(os.sched_getaffinity(0)) >= 2:  # two devices of one core each: this process's, the server's
        with range_server(args, n, core=1) as (address, _):
            pipelined = child(args, address, pipelined=True)
    else:
        pipelined = None
    ratios = {k: round(split[k] / whole[k], 3) for k in ("decode_tok_s", "batch_tok_s", "prefill_tok_s")}
    turns = measure_turns(args)
    print(f"{Path(args.model).name} | {cpu_name()} | layers 0:{args.cut} here, {args.cut}:{n} in a range server")
    print(f"{'':26}{'whole':>10}{'split':>10}{'split/whole':>13}")
    for key, label in (("decode_tok_s", "decode tok/s, 1 sequence"), ("batch_tok_s", f"decode tok/s, {args.batch} together"),
                       ("prefill_tok_s", f"prefill tok/s, {args.prompt_tokens}")):  # fmt: skip
        print(f"{label:26}{whole[key]:>10}{split[key]:>10}{ratios[key]:>13}")
    print(f"{'resident MB':26}{whole['rss_mb']:>10}{split['rss_mb']:>10}  + server {split['server_rss_mb']}")
    if pipelined:
        print(f"prefill of {pipelined['prefill_tokens']} tokens over the split, one core each side: one piece "
              f"{pipelined['one_piece_s']} s, pipelined in chunks of {pipelined['chunk']} {pipelined['pipelined_s']} s, "
              f"{pipelined['pipelined_speedup']}x")  # fmt: skip
    print(f"a conversation's turn 2 on the other device, after a {args.turn_tokens}-token turn 1: first text after "
          f"{turns['auto']['ttft_s']} s with --kv-ship auto (KV shipped for {turns['auto']['shipped_tokens']} tokens), "
          f"{turns['never']['ttft_s']} s recomputed, {turns['shipped_vs_recomputed']}x")  # fmt: skip
    launched = None if args.skip_launch else launches(args)
    soak = None if args.skip_faults else faults()
    if launched:
        print(f"through launches, answers per minute split over whole (each device {launched['split_memory_gb']} GB): "
              f"1 client {launched['split_vs_whole_1']}x, 8 clients {launched['split_vs_whole_8']}x")  # fmt: skip
    if soak:
        print(f"a range server killed every 30 s, replicas: {soak['answered']} answered, {soak['failed']} failed, "
              f"{soak['lost']} lost, {soak['duplicated']} duplicated, {soak['kills']} kills")  # fmt: skip
    result = {"model": Path(args.model).name, "cpu": cpu_name(), "cut": args.cut, "layers": n, "whole": whole,
              "split": split, "ratios": ratios, "pipelined_prefill": pipelined, "kv_shipping": turns,
              "launches": launched, "faults": soak}  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    run_script(main)
