"""What the reduced draft vocabulary buys: one draft-head step with the full output layer against
reduced ones, side by side in one run, at the row counts a draft tree uses.

    python benchmarks/draft_head.py [--dtype auto|bf16|fp32] [--vocab 49152,16384,8192,4096] [--rows 1,4,16]

The head is random (its speed does not depend on its weights); the base model supplies the shapes
and the output-layer rows. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import add_dtype_option, chosen_dtype  # noqa: E402  (a sibling script)

from specsot_mq.draft import DraftConfig, DraftHead  # noqa: E402
from specsot_mq.loader import load_model  # noqa: E402
from specsot_mq.model import Step  # noqa: E402
from specsot_mq.pull import resolve_model  # noqa: E402


def step_ms(head: DraftHead, rows: int, repeats: int = 30) -> float:
    """Median ms of one draft forward of `rows` new tokens after a 200-entry context."""
    h = head.cfg.layer["hidden_size"]
    cache = head.new_cache(1, 256)
    tokens = torch.randint(0, 1000, (1, rows))
    feats = torch.randn(1, rows, h, dtype=head.dtype)
    with torch.inference_mode():
        head(torch.randint(0, 1000, (1, 200)), torch.randn(1, 200, h, dtype=head.dtype), cache,
             Step.fresh(torch.arange(200)[None]))  # fmt: skip
        times = []
        for _ in range(repeats + 3):
            start = time.perf_counter()
            head(tokens, feats, cache, Step([0], [200], torch.arange(200, 200 + rows)[None]))
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[3:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    add_dtype_option(p)
    p.add_argument("--vocab", default="49152,16384,8192,4096")
    p.add_argument("--rows", default="1,4,16")
    args = p.parse_args()
    dtype = chosen_dtype(args)
    base = load_model(resolve_model(args.model), dtype=dtype)
    vocabs = [min(int(v), base.cfg.vocab_size) for v in args.vocab.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    results = {}
    for v in vocabs:
        head = DraftHead(DraftConfig.for_base(base.cfg, v)).to(base.dtype).attach(base).eval().prepack()
        results[v] = {r: step_ms(head, r) for r in rows}
    full = max(vocabs)
    table = Table(title=f"draft step, ms ({args.dtype}, {torch.get_num_threads()} threads)")
    table.add_column("draft vocab")
    for r in rows:
        table.add_column(f"{r} rows", justify="right")
    for v in vocabs:
        table.add_row(str(v), *(f"{results[v][r]:.2f} ({results[full][r] / results[v][r]:.1f}x)" for r in rows))
    Console().print(table)
    print(json.dumps({"dtype": args.dtype, "ms": {str(v): {str(r): round(m, 3) for r, m in d.items()} for v, d in results.items()}}))


if __name__ == "__main__":
    main()
