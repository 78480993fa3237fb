"""This checkout's native kernels against another commit's, side by side: the whole forward of the
default model on k new rows, by k.

Both sets of kernels are built (the other commit's sources read with `git show`, built once into
the cache like ours) and loaded into this one process, over the same weights and KV cache; for each
k the two forwards run in turn, call after call, and the medians are compared, so the machine's
drift (10-25% between runs here) falls on both alike. A forward is what a decode step, a k-row
verify or a k-row prefill costs: every decoder layer in one native call, then the output layer on
the last row (on every row with --all-logits, as a verify step or sequences decoding together
have it). Prints a table with each side's median ms and the base's over ours (above 1: this
checkout is faster); the last line is JSON.

    python benchmarks/kernels.py [--base HEAD~1] [--rows 1,2,4,6,8,12,16,32] [--runs 40] [--context 300] [--all-logits]

SPECSOT_KERNEL_ISA=avx2 holds both sides to their AVX2 code on an AVX-512 machine.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import cpu_name  # noqa: E402

from specsot_mq import quant  # noqa: E402
from specsot_mq.loader import load_model  # noqa: E402
from specsot_mq.model import DecoderLayer, Step, attention_bias  # noqa: E402
from specsot_mq.pull import resolve_model, specsot_home  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "specsot_mq/kernels"


def build_base(commit: str):
    """The kernels of `commit`, built as a module of their own (quant.build_kernels). Its classes
    (Layer, Head) are bound local to its module (the sources bind them globally, which two loaded
    builds cannot share)."""
    sha = subprocess.run(["git", "rev-parse", "--short=12", commit], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()  # fmt: skip
    folder = specsot_home() / "kernels" / f"base-{sha}"  # its sources, kept for the next run
    folder.mkdir(parents=True, exist_ok=True)
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{commit}:{KERNELS}"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()  # fmt: skip
    for name in names:
        text = subprocess.run(["git", "show", f"{commit}:{KERNELS}/{name}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
        text = re.sub(r'(py::class_<[^>]*>+\(m, "\w+", )"', r'\1py::module_local(), "', text)
        path = folder / name
        if not path.exists() or path.read_text() != text:  # unchanged files keep their times: no rebuild
            path.write_text(text)
    return Older(quant.build_kernels(folder, "specsot_base", announce=f"building the kernels of {commit}..."),
                 quant.native())


class Older:
    """Another commit's kernels as this checkout's model calls them. Kernels from before the fused
    output layer (no `Head`) get a causal forward's attention bias built here, as the model built it
    for them (theirs read a missing bias as every key visible), and this checkout's functions they
    lack (the standalone RMSNorm, the greedy scan); the model runs its norm and output layer outside
    them, as it did then (main() clears its head on their side)."""

    def __init__(self, module, ours):
        self.module, self.ours, self.fused_head = module, ours, hasattr(module, "Head")
        self.groups = 1  # the model's q heads per kv head (main() sets it)

    def __getattr__(self, name):
        return getattr(self.module if hasattr(self.module, name) else self.ours, name)

    def decoder_layers(self, x, layers, first, cos, sin, k, v, slots, starts, bias, save, head=None, rows=(),
                       prefix_src=(), prefix_len=()):  # fmt: skip
        if self.fused_head:
            shared = (prefix_src, prefix_len) if prefix_src else ()  # kernels of 6921578 take none
            return self.module.decoder_layers(x, layers, first, cos, sin, k, v, slots, starts, bias, save, head, rows,
                                              *shared)  # fmt: skip
        if head is not None or prefix_src:
            raise RuntimeError("kernels from before the fused output layer run no head and no shared prefix")
        if bias is None:
            t = x.shape[1]
            bias = attention_bias(None, starts, t, max(starts) + t, None, self.groups, torch.float32, x.device)
        return self.module.decoder_layers(x, layers, first, cos, sin, k, v, slots, starts, bias, save)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD~1")
    p.add_argument("--rows", default="1,2,4,6,8,12,16,32")
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--context", type=int, default=300, help="cache entries before the new rows (0 or more)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--all-logits", action="store_true", help="the output layer on every new row, as a verify step")
    args = p.parse_args(argv)
    if args.context < 0:
        p.error(f"--context must be 0 or more, got {args.context}")
    torch.set_num_threads(args.threads)
    out = Console(soft_wrap=True)
    ours = quant.native()
    if ours is None:
        sys.exit("benchmarks/kernels.py compares native kernels, and this machine has none (see the line above)")
    kernels = {"base": build_base(args.base), "ours": ours}
    model = load_model(resolve_model(None), dtype=torch.float32, quantize="auto")
    kernels["base"].groups = model.cfg.q_per_kv
    if hasattr(kernels["base"], "set_prefetch_min_rows"):  # the loader set ours (quant.set_prefetch)
        kernels["base"].set_prefetch_min_rows(ours.prefetch_min_rows())
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    linears = [m for m in model.modules() if isinstance(m, quant.QLinear)]
    stacks = {}  # each side's native layers over the same packed weights
    for name, kernel in kernels.items():
        quant._native = kernel
        for module in layers + linears:  # each side's own Weights (a linear keeps the ones it made)
            module.__dict__.pop("_native", None)
        for linear in linears:
            linear.kernel = kernel
        stacks[name] = [layer.native_weights() for layer in layers], [linear.native_weights() for linear in linears]

    def use(name: str) -> None:
        """Every layer and linear of the model on one side's kernels."""
        quant._native = kernels[name]
        for layer, weights in zip(layers, stacks[name][0]):
            layer.__dict__["_native"] = weights
        for linear, weights in zip(linears, stacks[name][1]):
            linear.kernel, linear.__dict__["_native"] = kernels[name], weights
        model.__dict__.pop("_native", None)
        if not getattr(kernels[name], "fused_head", True):
            model.__dict__["_native"] = None  # no Head: its output layer runs on its own (qlinear)

    rows = [int(k) for k in args.rows.split(",")]
    cache = model.new_cache(1, args.context + max(rows))
    ids = torch.randint(0, model.cfg.vocab_size, (1, args.context + max(rows)))
    times = {(side, k): [] for side in kernels for k in rows}
    with torch.inference_mode():
        use("ours")
        if args.context:  # (0: the rows start an empty cache, as a prompt's prefill does)
            model(ids[:, : args.context], cache, Step.fresh(torch.arange(args.context)[None], logit_rows=[args.context - 1]))
        for k in track(rows, description="forwards by rows", console=out):
            new, positions = ids[:, args.context : args.context + k], torch.arange(args.context, args.context + k)[None]
            rows_out = list(range(k)) if args.all_logits else [k - 1]
            for run in range(-5, args.runs):  # 5 untimed rounds first: the threads and caches warm up
                for side in kernels:
                    use(side)
                    start = time.perf_counter()
                    model(new, cache, Step([0], [args.context], positions, logit_rows=rows_out))
                    if run >= 0:
                        times[(side, k)].append(time.perf_counter() - start)
    quant._native = ours
    title = (f"whole forward of k new rows over {args.context} cached, logits of {'every' if args.all_logits else 'the last'}"
             f" row, median ms ({args.runs} runs each, in turn)")
    table = Table(title=title)
    for col in ("k", f"base ({args.base})", "ours", "base / ours"):
        table.add_column(col, justify="right")
    result = {"base": args.base, "cpu": cpu_name(), "kernel_isa": ours.isa(), "threads": args.threads,
              "all_logits": args.all_logits, "rows": []}
    for k in rows:
        base, mine = (statistics.median(times[(side, k)]) * 1e3 for side in ("base", "ours"))
        table.add_row(str(k), f"{base:.2f}", f"{mine:.2f}", f"{base / mine:.3f}")
        result["rows"].append({"k": k, "base_ms": round(base, 3), "ours_ms": round(mine, 3),
                               "speedup": round(base / mine, 3)})  # fmt: skip
    out.print(f"CPU {cpu_name()} | kernels {ours.isa()} | threads {args.threads}")
    out.print(table)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
