"""Where one forward of the base model spends its time, at the shapes decoding uses.

For each shape (B rows x T new tokens over a K-token cache; a causal mask over the new tokens
when T > 1, as a draft chain has, rows at different lengths when B > 1, in consecutive cache
slots or in every other one, and rows whose slots hold copies of one prompt prefix, read from one
slot as a question's points read theirs) it times the whole
forward, then the same forward again module by module with its linear layers (by kind), its
attention and its KV-cache writes timed call by call (medians over the runs, as for the whole
forward). With the native kernels the first forward runs all layers in one call with one team
of threads; the second runs the same arithmetic through a call (and a parallel region) per
module, which is slower: its total is a column of its own, and the rest is that total less the
parts (norms, rope, Python; with the native kernels, the attention column holds the one call that
also rotates q and k and writes the cache, and cache writes are 0). Next to it, the floor: the
weight bytes one forward reads over the memory bandwidth measured in the same run. A table of all the linear layers alone at
k = 1, 2, 4, 8, 16 and 32 rows, as loaded (quantized) and widened to fp32 and bf16, beside the
bandwidth floor and the compute floor (k x parameters at the int8 multiply-add rate of the
kernels' instruction set measured here, `native().int8_peak()`, for quantized weights; 2 k x
parameters at the fp32 matmul rate for widened ones), with ours in G multiply-adds a second,
and the whole forward of k new tokens (what a k-row verify costs: with the native kernels the
linears run inside one call for all layers, without a parallel region per linear);
and after the forward table, picking the greedy tokens from
the logits, by argmax and by what the decoders use (sampling.greedy_tokens: the kernels' scan on
float32 logits, else torch.max). A
second table, once per batch size: drawing a token per row at temperature 1, top-p 0.95 (from
the logits of the model writing its own answer to an MT-bench question), by sorting the whole
vocabulary and torch.multinomial against the Sampler (top-p over the top 1024 first, an
inverse-CDF draw).

    python benchmarks/step.py [--dtype auto|bf16|fp32] [--threads N] [--runs 20] [--model PATH]
    python benchmarks/step.py --device cuda [--runs 20]     # a GPU: the cost curve alone (--curve on a CPU)

On a GPU (or with --curve) it times only one step over rows x new tokens, captured as CUDA graphs
and eager, each against one row's one token: the cost curve that says what a draft tree's rows
and the points' batch cost there.

The last stdout line is one JSON object: per shape, ms of the forward and of each part; per
batch size, ms of each way of sampling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import add_dtype_option, chosen_dtype, cpu_name, load_prompts, machine, measure_bandwidth, weight_bytes  # noqa: E402

from specsot_mq import model as model_module  # noqa: E402
from specsot_mq.kv_cache import KVCache  # noqa: E402
from specsot_mq.loader import load_model  # noqa: E402
from specsot_mq.model import Step  # noqa: E402
from specsot_mq.pull import resolve_model  # noqa: E402
from specsot_mq.quant import QLinear, native  # noqa: E402
from specsot_mq.sampling import Sampler, SamplingParams, greedy_tokens  # noqa: E402

# (B, T, slot stride): plain decode, EAGLE verifies of the default 4-node tree and larger ones, SoT
# points batched plain and with small trees; and rows in every other cache slot (a running batch
# whose finished sequences left gaps: their keys and values are gathered, not read in place), at
# SoT's and at train-draft's batch sizes
SHAPES = [(1, 1, 1), (1, 5, 1), (1, 9, 1), (1, 17, 1), (4, 1, 1), (5, 1, 1), (5, 3, 1), (8, 1, 1), (8, 2, 1),
          (8, 1, 2), (32, 1, 1), (32, 1, 2)]
# and rows whose slots hold copies of one prompt's first SHARED entries (a question's points), which
# they read from one slot (Step.sources), beside the same rows reading their own slots
SHARED_SHAPES = [(5, 1, 1), (8, 1, 1)]
SHARED = 250
CONTEXT = 300  # cached tokens before the step (rows at different lengths: 300, 293, 286, ...)
KINDS = ("qkv", "o", "gate_up", "down", "lm_head")
LINEARS = (model_module.Linear, QLinear)
ROWS = (1, 2, 4, 8, 16, 32)  # the linears-alone table: a step, verifies, the points phase, up to prefill-like
OTHER = ("attention", "cache writes")


@contextmanager
def timed_parts(model, totals: dict):
    """Adds the seconds of each linear (by kind), attention call and cache write to totals while inside."""
    kind_of = {id(m): name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LINEARS)}
    forwards = {cls: cls.forward for cls in LINEARS}
    attention, write = model_module.attention, KVCache.write

    def timed(cls):
        def linear(self, x, **kwargs):
            start = time.perf_counter()
            out = forwards[cls](self, x, **kwargs)
            totals[kind_of[id(self)]] += time.perf_counter() - start
            return out

        return linear

    def attend(*args):
        start = time.perf_counter()
        out = attention(*args)
        totals["attention"] += time.perf_counter() - start
        return out

    class TimedKernels:
        """The native kernels, their attention calls timed (with the fused rope and cache write)."""

        def __init__(self, kernels):
            self.kernels = kernels

        def attend_cached(self, *args):
            start = time.perf_counter()
            out = self.kernels.attend_cached(*args)
            totals["attention"] += time.perf_counter() - start
            return out

        def __getattr__(self, name):
            return getattr(self.kernels, name)

    native_for = model_module._native_for

    def timed_native_for(x):
        kernels = native_for(x)
        return None if kernels is None else TimedKernels(kernels)

    def store(*args):
        start = time.perf_counter()
        write(*args)
        totals["cache writes"] += time.perf_counter() - start

    for cls in LINEARS:
        cls.forward = timed(cls)
    model_module.attention, KVCache.write, model_module._native_for = attend, store, timed_native_for
    # A quantized layer normally runs as one native call; run it module by module here (the same
    # arithmetic) so that each part can be timed.
    layer_weights = model_module.DecoderLayer.native_weights
    model_module.DecoderLayer.native_weights = lambda self: None
    try:
        yield
    finally:
        for cls in LINEARS:
            cls.forward = forwards[cls]
        model_module.attention, KVCache.write, model_module._native_for = attention, write, native_for
        model_module.DecoderLayer.native_weights = layer_weights


def step_inputs(b: int, t: int, vocab: int, gen: torch.Generator):
    """(ids, positions, mask, cache lengths) of one step: row r continues a cache of 300 - 7r."""
    lengths = [CONTEXT - 7 * r for r in range(b)]
    ids = torch.randint(0, vocab, (b, t), generator=gen)
    positions = torch.stack([torch.arange(n, n + t) for n in lengths])
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, t, t) if t > 1 else None
    return ids, positions, mask, lengths


def time_shape(model, cache, b: int, t: int, stride: int, runs: int, gen: torch.Generator, shared: bool = False) -> dict:
    ids, positions, mask, lengths = step_inputs(b, t, model.cfg.vocab_size, gen)
    slots = range(0, b * stride, stride)

    # every slot holds the 300-token prompt: any shorter length is valid; rows sharing its first
    # SHARED entries read them from the first row's slot, as the slot manager's prefix_sources says
    sources = ([slots[0]] * b, [0] + [SHARED] * (b - 1)) if shared else None
    step = Step(list(slots), lengths, positions, mask, sources=sources)

    def forward():
        return model(ids, cache, step).logits

    for _ in range(3):
        forward()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        forward()
        samples.append(time.perf_counter() - start)
    parts, runs_parts = defaultdict(float), []  # each part's seconds in each run; medians below, like the forward's
    with timed_parts(model, parts):
        for _ in range(runs):
            parts.clear()
            start = time.perf_counter()
            forward()
            parts["modules"] = time.perf_counter() - start
            runs_parts.append(dict(parts))
    ms = {k: statistics.median(r.get(k, 0.0) for r in runs_parts) * 1e3 for k in (*KINDS, *OTHER, "modules")}
    # Picking the greedy tokens from the logits (after the forward, in every verify): argmax
    # against what the decoders use (sampling.greedy_tokens).
    logits = forward()
    for name, pick in (("argmax", lambda: logits.argmax(-1)), ("greedy_tokens", lambda: greedy_tokens(logits))):
        ms[name] = statistics.median(_seconds(pick) for _ in range(runs)) * 1e3
    total = statistics.median(samples) * 1e3
    linears = sum(ms[k] for k in KINDS)
    rest = ms["modules"] - linears - sum(ms[k] for k in OTHER)
    return {"b": b, "t": t, "slot_stride": stride, "shared_prefix": SHARED if shared else 0, "forward_ms": round(total, 2), "modules_ms": round(ms["modules"], 2),
            "linears_ms": round(linears, 2),
            **{f"{k.replace(' ', '_')}_ms": round(ms[k], 2) for k in OTHER}, "rest_ms": round(rest, 2),
            "argmax_ms": round(ms["argmax"], 2), "greedy_tokens_ms": round(ms["greedy_tokens"], 2),
            "linear_ms_by_kind": {k: round(ms[k], 2) for k in KINDS}}  # fmt: skip


def runs_native(model) -> bool:
    """Whether the model's linears run the native quantized kernels."""
    return any(isinstance(m, QLinear) and m.parts is not None for m in model.modules())


def gemm_flops(threads: int) -> float:
    """The CPU's float32 matrix-multiply rate (flop/s): best of a few 1024^3 products."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    return 2 * 1024**3 / min(_seconds(lambda: a @ b) for _ in range(5))


def linear_rows(model, runs: int) -> list[dict]:
    """ms of all the linear layers one forward runs (each called once on k rows), as the model
    holds them (quantized or not) and widened to fp32 and bf16 (oneDNN-prepacked), for k in ROWS;
    and of the whole forward of k new tokens on an empty cache, as the model runs it (with the
    native kernels, all its layers in one call: no call per linear)."""
    layers = [m for m in model.modules() if isinstance(m, LINEARS)]
    widened = {}
    for dtype in (torch.float32, torch.bfloat16):
        copies = []
        for m in layers:
            w = m.dequantized() if isinstance(m, QLinear) else m.weight.float()
            lin = model_module.Linear(w.shape[1], w.shape[0], bias=False).to(dtype).requires_grad_(False)
            lin.weight.copy_(w.to(dtype))
            lin.prepack()
            copies.append(lin)
        widened["fp32" if dtype == torch.float32 else "bf16"] = copies
    out = []
    for k in ROWS:
        row = {"k": k}
        for name, mods in (("ours", layers), *widened.items()):
            dtype = torch.bfloat16 if name == "bf16" else model.dtype
            xs = {n: torch.randn(k, n, dtype=dtype) for n in {m.in_features for m in mods}}

            def run():
                for m in mods:
                    m(xs[m.in_features])

            run()
            row[f"{name}_ms"] = round(statistics.median(_seconds(run) for _ in range(max(3, runs // 2))) * 1e3, 2)
        cache = model.new_cache(1, k)
        ids, positions = torch.randint(0, model.cfg.vocab_size, (1, k)), torch.arange(k)[None]

        def forward():
            model(ids, cache, Step.fresh(positions))

        forward()
        row["forward_ms"] = round(statistics.median(_seconds(forward) for _ in range(max(3, runs // 2))) * 1e3, 2)
        out.append(row)
    return out


def time_sampling(text: torch.Tensor, b: int, runs: int) -> dict:
    """One token drawn for each of B rows of `text` (logits the model had while writing its own
    answer: the random ids of the forward shapes give flat distributions, which a sampled answer
    rarely sees), temperature 1, top-p 0.95: sorting every row against the Sampler."""
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.95, seed=0))
    rows = text[:b]
    ways = {"sort_multinomial": lambda: _sort_multinomial(rows, 0.95, sampler.generator), "sampler": lambda: sampler(rows)}
    return {"b": b, **{f"{k}_ms": round(statistics.median(_seconds(f) for _ in range(runs)) * 1e3, 2) for k, f in ways.items()}}


def answer_logits(model, folder, n: int) -> torch.Tensor:
    """The logits [n, V] at each of the first n tokens of the model's own greedy answer to an
    MT-bench question: the distributions a sampled step draws from."""
    from specsot_mq.generate import Generator
    from specsot_mq.tokenizer import load_tokenizer

    question = load_prompts(None, 1)[0][0]
    gen = Generator(model, load_tokenizer(folder), max_len=1024)
    prompt = gen.prompt_ids(question)
    answer = gen.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)).token_ids
    ids = torch.tensor([prompt + answer])
    with torch.inference_mode():
        logits = model(ids, model.new_cache(1, ids.shape[1]), Step.fresh(torch.arange(ids.shape[1])[None])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + n]


def _sort_multinomial(logits: torch.Tensor, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Top-p by sorting every row's whole vocabulary, then torch.multinomial: the textbook way."""
    probs = torch.softmax(logits.float(), dim=-1)
    ranked, order = torch.sort(probs, dim=-1, descending=True)
    ranked = ranked.masked_fill(ranked.cumsum(-1) - ranked >= top_p, 0.0)
    return torch.multinomial(torch.zeros_like(probs).scatter_(-1, order, ranked), 1, generator=gen).squeeze(-1)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


CURVE_ROWS, CURVE_TOKENS = (1, 2, 4, 8, 16, 32), (1, 4, 16, 64)


def cost_curve(args, dtype) -> dict:
    """One step's time over rows x new tokens (a GPU's cost curve: what a draft tree's rows and
    the points' batch cost), captured (CUDA graphs) and eager, each against one row's one token."""
    device = torch.device(args.device)
    model = load_model(resolve_model(args.model), dtype=dtype, device=device, quantize=args.quantize)
    shapes = [(b, t) for b in CURVE_ROWS for t in CURVE_TOKENS if b * t <= 1024]
    result = {"device": machine(args), "dtype": args.dtype, "shapes": []}
    with torch.inference_mode():
        for graphs in (True, False):
            cache = model.new_cache(max(CURVE_ROWS), CONTEXT + 128, graphs=graphs)
            for b, t in shapes:
                ids = torch.randint(0, model.cfg.vocab_size, (b, t))
                step = Step(list(range(b)), [CONTEXT] * b, torch.arange(CONTEXT, CONTEXT + t).expand(b, t))

                def forward():
                    model(ids, cache, step)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)

                forward()  # (a captured step's graph is captured here)
                ms = statistics.median(_seconds(forward) for _ in range(args.runs)) * 1e3
                result["shapes"].append({"b": b, "t": t, "captured": graphs, "ms": round(ms, 3)})
    one = {g: next(r["ms"] for r in result["shapes"] if r["captured"] == g and r["b"] == r["t"] == 1) for g in (True, False)}
    table = Table(title=f"one step, ms (x one row's one token) | {result['device']} | {args.dtype}")
    table.add_column("rows x tokens")
    for title in ("captured" if device.type == "cuda" else "bucketed (as captured on a GPU)", "eager"):
        table.add_column(title, justify="right")
    for b, t in shapes:
        cells = [next(r["ms"] for r in result["shapes"] if (r["b"], r["t"], r["captured"]) == (b, t, g)) for g in (True, False)]
        table.add_row(f"{b} x {t}", *(f"{ms:.2f} ({ms / one[g]:.2f}x)" for ms, g in zip(cells, (True, False))))
    Console(stderr=True).print(table)
    print(json.dumps(result))
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_dtype_option(p)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--model", default=None, help="model folder (default: the pulled default model)")
    p.add_argument("--curve", action="store_true", help="only the cost curve over rows x tokens (always on a GPU)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = chosen_dtype(args)
    if args.curve or torch.device(args.device).type == "cuda":
        return cost_curve(args, dtype)
    model = load_model(resolve_model(args.model), dtype=dtype, quantize=args.quantize)
    cache = model.new_cache(max(b * stride for b, _, stride in SHAPES), CONTEXT + 32)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        prompt = torch.randint(0, model.cfg.vocab_size, (1, CONTEXT), generator=gen)
        model(prompt, cache, Step.fresh(torch.arange(CONTEXT)[None], logit_rows=[CONTEXT - 1]))
        cache.copy(0, range(1, cache.num_slots), CONTEXT)
        bandwidth = measure_bandwidth()
        with Progress(console=Console(stderr=True), transient=True) as bar:
            shapes = [(*shape, False) for shape in SHAPES] + [(*shape, True) for shape in SHARED_SHAPES]
            for b, t, stride, shared in bar.track(shapes, description="shapes"):
                rows.append(time_shape(model, cache, b, t, stride, args.runs, gen, shared))
        linears = linear_rows(model, args.runs)
        flops = gemm_flops(args.threads)
        # the quantized kernels' ceiling: int8 multiply-adds per second on every thread
        int8_rate = native().int8_peak() * args.threads if runs_native(model) else None
    sizes = sorted({b for b, _, _ in SHAPES})
    text = answer_logits(model, resolve_model(args.model), sizes[-1])
    sampling = [time_sampling(text, b, args.runs) for b in sizes]
    _, nbytes = weight_bytes(model, dtype)
    floor_ms = nbytes / bandwidth * 1e3

    table = Table(title=f"one forward, {args.dtype}, {args.threads} threads, median of {args.runs} | {cpu_name()} | "
                        f"weights {nbytes / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s read: floor {floor_ms:.1f} ms")  # fmt: skip
    for col in ("B x T", "forward ms", "by module ms", "linears ms", "attention ms", "cache writes ms", "rest ms",
                "linears", "x floor", "argmax ms", "greedy ms"):
        table.add_column(col, justify="right")
    for r in rows:
        ms = [r[k] for k in ("forward_ms", "modules_ms", "linears_ms", "attention_ms", "cache_writes_ms", "rest_ms")]
        shape = f"{r['b']} x {r['t']}" + (" (every 2nd slot)" if r["slot_stride"] == 2 else "")
        shape += f" (sharing {r['shared_prefix']})" if r["shared_prefix"] else ""
        table.add_row(shape, *(f"{v:.2f}" for v in ms), f"{100 * r['linears_ms'] / r['modules_ms']:.0f}%",
                      f"{r['forward_ms'] / floor_ms:.2f}", f"{r['argmax_ms']:.2f}", f"{r['greedy_tokens_ms']:.2f}")  # fmt: skip
    Console(stderr=True, width=150).print(table)
    params, _ = weight_bytes(model, dtype)
    ceiling = (f"the kernels' int8 rate ({native().isa()}, {int8_rate / 1e9:.0f} G multiply-adds/s on {args.threads} "
               f"threads): k x {params / 1e6:.0f}M / rate") if int8_rate else \
              f"the fp32 matmul rate ({flops / 1e9:.0f} GFLOP/s): 2 x k x {params / 1e6:.0f}M / rate"  # fmt: skip
    lin = Table(title=f"all linear layers of one forward on k rows, ms | weights as loaded: {nbytes / 1e6:.0f} MB, "
                      f"floor at {bandwidth / 1e9:.1f} GB/s {floor_ms:.2f} ms | compute floor at {ceiling}")  # fmt: skip
    for col in ("k", "ours (as loaded)", "ours G MAC/s", "fp32 widened", "bf16 widened", "bandwidth floor",
                "compute floor", "ours x floor", "whole forward"):
        lin.add_column(col, justify="right")
    for r in linears:
        compute = (r["k"] * params / int8_rate if int8_rate else 2 * r["k"] * params / flops) * 1e3
        r.update(bandwidth_floor_ms=round(floor_ms, 2), compute_floor_ms=round(compute, 2),
                 ours_gmacs=round(r["k"] * params / r["ours_ms"] / 1e6, 1))  # fmt: skip
        lin.add_row(str(r["k"]), f"{r['ours_ms']:.2f}", f"{r['ours_gmacs']:.0f}", f"{r['fp32_ms']:.2f}",
                    f"{r['bf16_ms']:.2f}", f"{floor_ms:.2f}", f"{compute:.2f}",
                    f"{r['ours_ms'] / max(floor_ms, compute):.2f}", f"{r['forward_ms']:.2f}")  # fmt: skip
    Console(stderr=True, width=150).print(lin)
    draws = Table(title="sampling one token per row: temperature 1, top-p 0.95, on the model's own answer logits")
    for col in ("rows", "sort + multinomial ms", "Sampler ms", "x"):
        draws.add_column(col, justify="right")
    for r in sampling:
        draws.add_row(str(r["b"]), f"{r['sort_multinomial_ms']:.2f}", f"{r['sampler_ms']:.2f}",
                      f"{r['sort_multinomial_ms'] / r['sampler_ms']:.1f}")  # fmt: skip
    Console(stderr=True).print(draws)
    result = {"dtype": args.dtype, "threads": args.threads, "cpu": cpu_name(), "weight_mb": round(nbytes / 1e6, 1),
              "bandwidth_gb_s": round(bandwidth / 1e9, 2), "floor_ms": round(floor_ms, 2), "shapes": rows,
              "gemm_gflops": round(flops / 1e9, 1), "int8_gmacs": round(int8_rate / 1e9, 1) if int8_rate else None,
              "kernel_isa": native().isa() if native() is not None else None, "linears_by_rows": linears,
              "sampling": sampling}  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
