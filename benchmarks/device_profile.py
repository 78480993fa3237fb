"""Measure a device's profile for devices.json: what the point scheduler reads about a device.

On the device named (--device cpu, cuda, cuda:N), with the default model (or --model):
  bandwidth_gb_s  read bandwidth now (a sum over 1 GiB, as decode.py measures it)
  memory_gb       the GPU's memory, or the host's
  compute         decode throughput in tokens/s over all sequences together, at max_parallel
  max_parallel    the batch (1, 2, 4, ... up to --max-batch) past which decoding more sequences
                  together adds less than --gain to the total tokens/s

    python benchmarks/device_profile.py --device cuda [--name h100] [--write devices.json] [--tokens 64]

Prints a table of tokens/s per batch and one JSON line: the profile; --write puts it into the file
under "profiles" as --name (default: the device's kind, cpu or cuda), keeping the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import add_dtype_option, chosen_dtype, load_prompts, machine, measure_bandwidth, run_script  # noqa: E402

from specsot_mq.generate import Generator  # noqa: E402
from specsot_mq.loader import load_model  # noqa: E402
from specsot_mq.pull import resolve_model  # noqa: E402
from specsot_mq.sampling import SamplingParams  # noqa: E402
from specsot_mq.tokenizer import load_tokenizer  # noqa: E402


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 1e9
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    add_dtype_option(p)
    p.add_argument("--name", default=None, help="the profile's name in devices.json (default: cpu or cuda)")
    p.add_argument("--write", type=Path, default=None, help="a devices.json to put the profile into")
    p.add_argument("--tokens", type=int, default=64, help="tokens each sequence decodes per batch measured")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--gain", type=float, default=1.1, help="least gain in total tokens/s that doubling the batch must give")
    args = p.parse_args(argv)
    if args.tokens < 2 or args.max_batch < 1 or args.gain <= 1:
        p.error("--tokens must be at least 2, --max-batch at least 1 and --gain above 1")
    device = torch.device(args.device)
    dtype = chosen_dtype(args)
    folder = resolve_model(args.model)
    model = load_model(folder, dtype=dtype, device=device, quantize=args.quantize)
    prompts, _ = load_prompts(None, args.max_batch)
    gen = Generator(model, load_tokenizer(folder), max_len=512 + args.tokens, num_slots=args.max_batch)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    rates, batch = {}, 1
    while batch <= args.max_batch:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        gen.generate_many(batch_prompts, params)  # warm: a GPU captures this batch's steps here
        done = gen.generate_many(batch_prompts, params)
        seconds = max(c.seconds - c.prefill_seconds for c in done)
        rates[batch] = sum(len(c.token_ids) - 1 for c in done) / seconds
        batch *= 2
    best = 1
    for b in sorted(rates)[1:]:
        if rates[b] < args.gain * rates[best]:
            break
        best = b
    profile = {"compute": round(rates[best], 1), "memory_gb": round(memory_gb(device), 1),
               "bandwidth_gb_s": round(measure_bandwidth(device=device) / 1e9, 1), "max_parallel": best}  # fmt: skip
    table = Table(title=f"decode tokens/s over a batch | {machine(args)} | {args.dtype}")
    for col in ("batch", "tokens/s", "x batch 1"):
        table.add_column(col, justify="right")
    for b, r in rates.items():
        table.add_row(str(b), f"{r:.1f}", f"{r / rates[1]:.2f}", style="bold" if b == best else None)
    Console(stderr=True).print(table)
    name = args.name or device.type
    if args.write:
        data = json.loads(args.write.read_text()) if args.write.exists() else {"profiles": {}, "devices": {}}
        data.setdefault("profiles", {})[name] = profile
        args.write.write_text(json.dumps(data, indent=2) + "\n")
    result = {"name": name, "profile": profile, "rates": {str(b): round(r, 1) for b, r in rates.items()},
              "device": machine(args)}  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    run_script(main)
