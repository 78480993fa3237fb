"""Attention over the KV cache, three ways side by side at the shapes decoding uses: `matmuls` (two
matmuls, what the model ran before), `GQA` (torch's fused attention with its grouped-query support)
and `grouped` (fused attention with the q heads that share a kv head laid out as rows of one head:
what the model runs). `x` columns: speedup over `matmuls`.

Each shape is B rows x T new tokens over K cached entries, with the default model's heads (9 query
heads sharing 3 kv heads of 64), read from strided views of a cache longer than K as the model does,
under an additive mask where the step has one (T > 1 or B > 1). The time is one step's worth: all
30 layers. The ways are checked to agree before they are timed.

    python benchmarks/attention.py [--dtype auto|bf16|fp32] [--threads N] [--runs 30]

The last stdout line is one JSON object: per shape, ms of each way and its speedup over two matmuls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from specsot_mq.loader import resolve_dtype

LAYERS, HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 30, 9, 3, 64, 1024
# (B, T, K): plain decode, EAGLE trees of 4/8/16 nodes, SoT branches batched, one BIM step
SHAPES = [(1, 1, 300), (1, 4, 300), (1, 8, 300), (1, 16, 300), (4, 1, 300), (8, 1, 300), (8, 4, 300),
          (16, 4, 300), (1, 32, 700), (1, 1, 900)]  # fmt: skip


def two_matmuls(q, keys, values, bias):
    """The former way: the q heads sharing a kv head become rows of one matmul per kv head."""
    b, h, t, d = q.shape
    kv, g = keys.shape[1], h // keys.shape[1]
    q = q.reshape(b, kv, g * t, d)
    scores = torch.matmul(q, keys.contiguous().transpose(-1, -2))
    if bias is not None:
        scores = (scores.view(b, kv, g, t, -1) + bias[:, :, None]).view(b, kv, g * t, -1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values).view(b, h, t, d)


def fused(q, keys, values, bias):
    """torch's fused attention with its own grouped-query support."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=1.0, enable_gqa=True)


def fused_grouped(q, keys, values, bias):
    """What the model runs: fused attention with the q heads sharing a kv head as rows of one head
    (the mask repeated per row group, once per step in the model)."""
    b, h, t, d = q.shape
    kv, g = keys.shape[1], h // keys.shape[1]
    if bias is not None:
        bias = bias[:, :, None].expand(b, 1, g, t, bias.shape[-1]).reshape(b, 1, g * t, -1)
    out = F.scaled_dot_product_attention(q.reshape(b, kv, g * t, d), keys, values, attn_mask=bias, scale=1.0)
    return out.view(b, h, t, d)


def time_step(fn, q, cache_k, cache_v, bias, k_len: int, runs: int) -> float:
    """Median ms of one step: every layer's attention over its own cache views."""
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        for layer in range(LAYERS):
            fn(q, cache_k[layer, : q.shape[0], :, :k_len], cache_v[layer, : q.shape[0], :, :k_len], bias)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    max_b = max(b for b, _, _ in SHAPES)
    cache_k, cache_v = (torch.randn(LAYERS, max_b, KV_HEADS, CAPACITY, HEAD_DIM, generator=gen).to(dtype)
                        for _ in range(2))  # fmt: skip
    ways = {"matmuls": two_matmuls, "GQA": fused, "grouped": fused_grouped}
    table = Table(title=f"attention, one step (30 layers), {dtype}, {args.threads} threads, median of {args.runs}")
    table.add_column("B x T, K", justify="right")
    for name in ways:
        table.add_column(f"{name} ms", justify="right")
    for name in list(ways)[1:]:
        table.add_column(f"{name} x", justify="right")
    rows = []
    for b, t, k_len in SHAPES:
        q = (torch.randn(b, HEADS, t, HEAD_DIM, generator=gen) / 8).to(dtype)
        bias = None
        if t > 1 or b > 1:  # a tree or rows of different lengths: some entries hidden
            hidden = torch.rand(b, 1, t, k_len, generator=gen) < 0.2
            hidden[..., -1] = False
            bias = torch.zeros(b, 1, t, k_len, dtype=dtype).masked_fill_(hidden, float("-inf"))
        views = cache_k[0, :b, :, :k_len], cache_v[0, :b, :, :k_len]
        want = two_matmuls(q, *views, bias).float()
        for name, fn in ways.items():
            err = (fn(q, *views, bias).float() - want).abs().max().item()
            assert err < (0.05 if dtype == torch.bfloat16 else 1e-4), f"{name} disagrees with two matmuls by {err}"
        ms = {name: time_step(fn, q, cache_k, cache_v, bias, k_len, args.runs) for name, fn in ways.items()}
        base = ms["matmuls"]
        rows.append({"b": b, "t": t, "k": k_len, "ms": {n: round(v, 2) for n, v in ms.items()},
                     "speedup": {n: round(base / v, 2) for n, v in ms.items()}})  # fmt: skip
        table.add_row(f"{b} x {t}, {k_len}", *(f"{v:.2f}" for v in ms.values()),
                      *(f"{base / v:.2f}x" for v in list(ms.values())[1:]))  # fmt: skip
    Console(stderr=True).print(table)
    print(json.dumps({"dtype": str(dtype).removeprefix("torch."), "threads": args.threads, "shapes": rows}))


if __name__ == "__main__":
    main()
