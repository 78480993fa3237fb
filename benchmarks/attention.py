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
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import add_dtype_option, chosen_dtype  # noqa: E402  (a sibling script)

from specsot_mq.model import attention, attention_bias  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 30, 9, 3, 64, 1024
# (B, T, K): plain decode, EAGLE trees of 4/8/16 nodes, SoT branches batched, one BIM step
SHAPES = [(1, 1, 300), (1, 4, 300), (1, 8, 300), (1, 16, 300), (4, 1, 300), (8, 1, 300), (8, 4, 300),
          (16, 4, 300), (1, 32, 700), (1, 1, 900)]  # fmt: skip


def two_matmuls(q, keys, values, bias):
    """The former way: the q heads sharing a kv head become rows of one matmul per kv head, against
    a contiguous copy of the keys (bias [B, 1, 1, T, K])."""
    b, t, h, d = q.shape
    kv, g = keys.shape[1], h // keys.shape[1]
    q = q.reshape(b, t, kv, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv, g * t, d)
    scores = torch.matmul(q, keys.contiguous().transpose(-1, -2))
    if bias is not None:
        scores = (scores.view(b, kv, g, t, -1) + bias).view(b, kv, g * t, -1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values).view(b, kv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h * d)


def torch_gqa(q, keys, values, bias):
    """torch's fused attention with its own grouped-query support (bias [B, 1, T, K])."""
    b, t, h, d = q.shape
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=bias, scale=1.0, enable_gqa=True)
    return out.transpose(1, 2).reshape(b, t, h * d)


# name: (way, query rows per kv head that its bias is laid out for: 0 = the former [B, 1, 1, T, K])
WAYS = {"matmuls": (two_matmuls, 0), "GQA": (torch_gqa, 1), "grouped": (attention, HEADS // KV_HEADS)}


def time_step(fn, q, cache_k, cache_v, bias, k_len: int, runs: int) -> float:
    """Median ms of one step: every layer's attention over its own cache views."""
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        for layer in range(LAYERS):
            fn(q, cache_k[layer, : q.shape[0], :, :k_len], cache_v[layer, : q.shape[0], :, :k_len], bias)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def biases(b: int, t: int, k_len: int, dtype, gen) -> dict:
    """Each way's bias for one shape (None for a plain step: every entry visible). A tree or rows of
    different lengths hide some entries; the model builds its bias once per step, as here."""
    if t == 1 and b == 1:
        return dict.fromkeys(WAYS)
    hidden = torch.rand(b, t, k_len, generator=gen) < 0.2
    hidden[..., -1] = False
    starts = [k_len - t] * b
    out = {}
    for name, (_, groups) in WAYS.items():
        bias = attention_bias(~hidden, starts, t, k_len, None, max(groups, 1), dtype, torch.device("cpu"))
        out[name] = bias[:, :, None] if groups == 0 else bias
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_dtype_option(p)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = chosen_dtype(args)
    gen = torch.Generator().manual_seed(0)
    max_b = max(b for b, _, _ in SHAPES)
    cache_k, cache_v = (torch.randn(LAYERS, max_b, KV_HEADS, CAPACITY, HEAD_DIM, generator=gen).to(dtype)
                        for _ in range(2))  # fmt: skip
    table = Table(title=f"attention, one step (30 layers), {args.dtype}, {args.threads} threads, median of {args.runs}")
    table.add_column("B x T, K", justify="right")
    for name in WAYS:
        table.add_column(f"{name} ms", justify="right")
    for name in list(WAYS)[1:]:
        table.add_column(f"{name} x", justify="right")
    rows = []
    for b, t, k_len in SHAPES:
        q = (torch.randn(b, t, HEADS, HEAD_DIM, generator=gen) / 8).to(dtype)  # as the model has it
        bias = biases(b, t, k_len, dtype, gen)
        views = cache_k[0, :b, :, :k_len], cache_v[0, :b, :, :k_len]
        want = two_matmuls(q, *views, bias["matmuls"]).float()
        for name, (fn, _) in WAYS.items():
            err = (fn(q, *views, bias[name]).float() - want).abs().max().item()
            assert err < (0.05 if dtype == torch.bfloat16 else 1e-4), f"{name} disagrees with two matmuls by {err}"
        ms = {name: time_step(fn, q, cache_k, cache_v, bias[name], k_len, args.runs) for name, (fn, _) in WAYS.items()}
        base = ms["matmuls"]
        rows.append({"b": b, "t": t, "k": k_len, "ms": {n: round(v, 2) for n, v in ms.items()},
                     "speedup": {n: round(base / v, 2) for n, v in ms.items()}})  # fmt: skip
        table.add_row(f"{b} x {t}, {k_len}", *(f"{v:.2f}" for v in ms.values()),
                      *(f"{base / v:.2f}x" for v in list(ms.values())[1:]))  # fmt: skip
    Console(stderr=True).print(table)
    print(json.dumps({"dtype": args.dtype, "threads": args.threads, "shapes": rows}))


if __name__ == "__main__":
    main()
