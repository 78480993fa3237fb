"""Plain greedy decoding: our engine against transformers `generate`, side by side in one run.

Both engines decode the same chat prompts (first turns of MT-bench questions), batch 1, in the same
dtype and thread count, with EOS ignored so every run makes exactly --new-tokens tokens. Both report
decode speed the same way, (new_tokens - 1) / (time after the first token), so prefill never mixes in.
The physical limit is memory bandwidth (measured here, now) over the weight bytes read per token.

    python benchmarks/decode.py [--limit 3] [--new-tokens 128] [--dtype auto|bf16|fp32] [--threads N] [--runs 3]

The last stdout line is one JSON object: ours_tok_s, hf_tok_s, ratio, limit_tok_s and the conditions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from specsot_mq.cuda_graphs import capture_report
from specsot_mq.decode_params import QUANTIZE
from specsot_mq.errors import SpecSotError
from specsot_mq.generate import Generator
from specsot_mq.loader import load_model, resolve_device, resolve_dtype, runs_quantized
from specsot_mq.pull import resolve_model
from specsot_mq.sampling import SamplingParams
from specsot_mq.tokenizer import chat_prompt_ids, load_tokenizer

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared/data/mt_bench_questions.jsonl"
# Used only when the MT-bench file is absent, so the script still runs from a bare checkout.
BUILTIN_PROMPTS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Explain how a hash table works and when it is a poor choice.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
]
WARMUP_TOKENS = 16  # enough to create every oneDNN primitive and fill allocator caches on both sides


def warmup_tokens(gen: Generator, n: int) -> int:
    """Tokens a warm-up of our engine decodes before runs of n: on a GPU all n, so that the CUDA
    graph of every bucket the runs reach is captured before the clock starts (the capture is a
    load cost, reported apart), else WARMUP_TOKENS."""
    return n if gen.cache.graphs is not None else min(WARMUP_TOKENS, n)


@dataclass(slots=True)
class Sample:
    """One timed generation."""

    token_ids: list[int]
    prefill_s: float  # call to first token
    decode_s: float  # first token to last

    @property
    def tok_s(self) -> float:
        return (len(self.token_ids) - 1) / self.decode_s


def load_prompts(path: Path | None, limit: int, per_category: int = 0, label: str | None = None) -> tuple[list[str], str]:
    """The first `limit` prompts and where they came from. MT-bench lines give their first turn;
    other JSONL lines give their `question`. per_category > 0 takes at most that many of each
    line's `category` (MT-bench's first 10 are all writing: a spread needs this); a line without
    one is not capped (the project's question files have none: `--limit 24` takes 24 of them);
    `label` keeps only the lines of that `label` (router_heldout.jsonl's direct or plan)."""
    if path is None and not DEFAULT_QUESTIONS.is_file():
        return BUILTIN_PROMPTS[:limit], "built-in"
    path = path or DEFAULT_QUESTIONS
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise SpecSotError(f"cannot read questions file {path} ({e.strerror}): fix --questions") from None
    prompts, taken = [], {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            question = row["turns"][0] if "turns" in row else row["question"]
            category = row.get("category")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise SpecSotError(
                f"{path}:{number} is not a question: each line must be JSON with 'turns' (MT-bench) or 'question'"
            ) from None
        capped = per_category and category is not None and taken.get(category, 0) >= per_category
        if capped or (label and row.get("label") != label):
            continue
        taken[category] = taken.get(category, 0) + 1
        prompts.append(question)
        if len(prompts) == limit:
            break
    if not prompts:
        raise SpecSotError(f"{path} holds no questions{f' labelled {label}' if label else ''}: give a JSONL file with "
                           "'turns' or 'question' per line")
    return prompts, str(path)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def measure_bandwidth(repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Read bandwidth in bytes/s (on a CPU with the current thread count): best of several sums
    over 1 GiB, far larger than any cache, so every pass streams from memory like a decode step
    does."""
    data = torch.ones(1 << 28, device=device)
    cuda = data.device.type == "cuda"
    best = float("inf")
    for _ in range(repeats + cuda):  # a GPU's first pass loads the kernel
        start = time.perf_counter()
        data.sum()
        if cuda:
            torch.cuda.synchronize(data.device)
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def machine(args: argparse.Namespace) -> str:
    """The machine's line for a table: the CPU and threads, or the GPU with torch's and CUDA's
    versions."""
    device = torch.device(args.device)
    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)} | torch {torch.__version__} | CUDA {torch.version.cuda}"
    return f"CPU {cpu_name()} | threads {torch.get_num_threads()} | torch {torch.__version__}"


def floor_line(model, dtype: torch.dtype, device) -> tuple[str, dict]:
    """The bandwidth floor of one decoded token on `device` (weight bytes over the read bandwidth
    measured now), as a line and as JSON fields."""
    _, nbytes = weight_bytes(model, dtype)
    bw = measure_bandwidth(device=device)
    floor = {"bandwidth_gb_s": round(bw / 1e9, 1), "weight_mb": round(nbytes / 1e6, 1),
             "floor_ms_per_token": round(1000 * nbytes / bw, 3), "floor_tok_s": round(bw / nbytes, 1)}  # fmt: skip
    return (f"bandwidth floor: {floor['weight_mb']} MB per token / {floor['bandwidth_gb_s']} GB/s = "
            f"{floor['floor_ms_per_token']} ms ({floor['floor_tok_s']} tok/s)"), floor  # fmt: skip


def weight_bytes(model, dtype: torch.dtype) -> tuple[int, int]:
    """(parameters, bytes) read per decoded token: every weight once (quantized ones as their packed
    blocks), the output layer in full. The embedding table is left out because a lookup reads one
    row; when it is tied to the output layer the shared tensor is counted once, as the output layer."""
    from specsot_mq.quant import QEmbedding, QLinear

    seen, count, nbytes = set(), 0, 0
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, QEmbedding) or id(m) in seen:
            continue
        seen.add(id(m))
        if isinstance(m, QLinear):  # its packed blocks (or its dequantized weight without the kernels)
            count += m.out_features * m.in_features
            nbytes += sum(p.data.numel() for p in m.parts) if m.parts is not None else m.weight.numel() * m.weight.element_size()
            continue
        for pname, p in m.named_parameters(recurse=False):
            if f"{name}.{pname}" == "embed.weight" or id(p) in seen:
                continue
            seen.add(id(p))
            count += p.numel()
            nbytes += p.numel() * p.element_size()
    return count, nbytes


def load_transformers(folder: Path, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """transformers' own model of a folder, its logging silenced (ours is the one progress bar).
    Loaded in fp32 and cast: the same on every transformers version we support, and the same
    rounding of the fp32 file as our loader applies; quantized weights dequantized."""
    from transformers.utils import logging as hf_logging

    from specsot_mq.loader import transformers_model

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return transformers_model(folder, dtype).to(device)


def load_with_draft(model: str | None, draft: str, dtype: torch.dtype, quantize: str = "auto",
                    device: str | torch.device = "cpu"):  # fmt: skip
    """(folder, tokenizer, our model, its prepacked draft head, the head's file) for the EAGLE
    benchmarks."""
    from specsot_mq.draft import DraftHead
    from specsot_mq.loader import resolve_draft, settle

    folder = resolve_model(model)
    draft_path = resolve_draft(draft, folder)
    if draft_path is None:
        raise SpecSotError(f"no draft head for {folder.name}: train one with `specsot train-draft` or pass --draft")
    ours = load_model(folder, dtype=dtype, quantize=quantize, device=device)
    loaded = folder, load_tokenizer(folder), ours, DraftHead.load(draft_path, ours).prepack(), draft_path
    settle()  # as the product's load_generator leaves the process
    return loaded


def run_ours(gen: Generator, ids: list[int], new_tokens: int) -> Sample:
    done = gen.generate(ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    return Sample(done.token_ids, done.prefill_seconds, done.seconds - done.prefill_seconds)


class FirstTokenClock:
    """A transformers streamer that only timestamps the first new token: generate() hands the
    streamer the prompt first, then each token as it is made."""

    def __init__(self):
        self.calls, self.first_at = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first_at = time.perf_counter()

    def end(self):
        pass


def run_hf(model, ids: list[int], new_tokens: int, pad_id: int) -> Sample:
    input_ids = torch.tensor([ids], device=model.device)
    clock = FirstTokenClock()
    start = time.perf_counter()
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # EOS ignored, as on our side
        do_sample=False,
        pad_token_id=pad_id,
        streamer=clock,
    )
    end = time.perf_counter()
    return Sample(out[0, len(ids) :].tolist(), clock.first_at - start, end - clock.first_at)


def add_dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="the activations' dtype; auto: fp32 with quantized weights, else bf16 where the CPU has "
                        "native bf16 (AVX-512 BF16/AMX), else the one measured faster on this CPU")  # fmt: skip
    p.add_argument("--quantize", choices=QUANTIZE, default="auto",
                   help="auto: the weights as the model ships them (the default model: its GGUF's Q4_1/Q8_0); "
                        "none: dequantized")  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (on CUDA: bf16, weights dequantized, "
                                                   "steps replaying CUDA graphs unless SPECSOT_CUDA_GRAPHS=0)")  # fmt: skip


def chosen_dtype(args: argparse.Namespace) -> torch.dtype:
    """The dtype --dtype names on --device for the model and --quantize asked for; args.dtype
    becomes what auto chose, for the tables."""
    device = resolve_device(args.device)
    quantized = runs_quantized(resolve_model(getattr(args, "model", None)), args.quantize, device)
    dtype = resolve_dtype(args.dtype, device, quantized)
    args.dtype = ("bf16" if dtype == torch.bfloat16 else "fp32") + (" (weights quantized)" if quantized else "")
    return dtype


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model name or folder (default: the default model)")
    p.add_argument("--questions", type=Path, default=None, help="MT-bench JSONL ('turns') or JSONL with 'question'")
    p.add_argument("--limit", type=int, default=3, help="number of prompts")
    p.add_argument("--new-tokens", type=int, default=128)
    add_dtype_option(p)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--runs", type=int, default=3, help="repeat the whole set; medians are reported")
    p.add_argument("--json-only", action="store_true", help="print only the final JSON line")
    args = p.parse_args(argv)
    for name, low in (("limit", 1), ("new_tokens", 2), ("threads", 1), ("runs", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be at least {low}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Console(quiet=args.json_only, soft_wrap=True)  # long lines stay whole in logs and pipes
    torch.set_num_threads(args.threads)
    dtype = chosen_dtype(args)
    prompts, source = load_prompts(args.questions, args.limit)
    n = args.new_tokens

    from transformers import __version__ as hf_version  # heavy import, after the arguments are checked

    folder = resolve_model(args.model)
    tokenizer = load_tokenizer(folder)
    prompt_ids = [chat_prompt_ids(tokenizer, q) for q in prompts]
    ours = load_model(folder, dtype=dtype, quantize=args.quantize, device=args.device)
    gen = Generator(ours, tokenizer, max_len=max(map(len, prompt_ids)) + n)
    hf = load_transformers(folder, dtype, args.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    params, wbytes = weight_bytes(ours, dtype)

    out.print(
        f"{machine(args)} ({os.cpu_count()} cores) | {args.dtype} | transformers {hf_version}\n"
        f"model {folder.name}, {params / 1e6:.1f}M params read per token | {len(prompts)} prompts ({source}), "
        f"{n} new tokens, {args.runs} runs"
    )
    ours_runs: list[list[Sample]] = []
    hf_runs: list[list[Sample]] = []
    total = 2 + 2 * args.runs * len(prompts) + 2
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True, disable=args.json_only,
    ) as bar:  # fmt: skip
        task = bar.add_task("bandwidth", total=total)
        bandwidth = [measure_bandwidth(device=args.device)]
        bar.advance(task)
        bar.update(task, description="warm-up")
        run_ours(gen, prompt_ids[0], warmup_tokens(gen, n))
        run_hf(hf, prompt_ids[0], min(WARMUP_TOKENS, n), pad_id)
        bar.advance(task)
        for r in range(args.runs):
            ours_runs.append([])
            hf_runs.append([])
            for i, ids in enumerate(prompt_ids):
                # Alternate who goes first, so drift on a shared machine hits both engines alike.
                order = ("ours", "hf") if (r + i) % 2 == 0 else ("hf", "ours")
                for engine in order:
                    bar.update(task, description=f"run {r + 1}/{args.runs} prompt {i + 1} {engine}")
                    if engine == "ours":
                        ours_runs[-1].append(run_ours(gen, ids, n))
                    else:
                        hf_runs[-1].append(run_hf(hf, ids, n, pad_id))
                    bar.advance(task)
        bar.update(task, description="bandwidth")
        # Measured again after decoding: the machine is shared, and the limit should use the best seen.
        bandwidth.append(measure_bandwidth(device=args.device))
        bar.advance(task)

    def rate(runs: list[list[Sample]]) -> float:
        """All decoded tokens / the sum over prompts of each prompt's median decode time: one slow
        sample (another process woke up) moves a median, not the total."""
        decode_s = [statistics.median(run[i].decode_s for run in runs) for i in range(len(prompts))]
        return len(prompts) * (n - 1) / sum(decode_s)

    def prefill(runs: list[list[Sample]]) -> float:
        return statistics.median(s.prefill_s for run in runs for s in run)

    ours_tok_s, hf_tok_s = rate(ours_runs), rate(hf_runs)
    bw = max(bandwidth)
    limit = bw / wbytes
    per_prompt = [
        {
            "prompt_tokens": len(ids),
            "ours_tok_s": round(statistics.median(run[i].tok_s for run in ours_runs), 2),
            "hf_tok_s": round(statistics.median(run[i].tok_s for run in hf_runs), 2),
            "ours_prefill_s": round(statistics.median(run[i].prefill_s for run in ours_runs), 4),
            "hf_prefill_s": round(statistics.median(run[i].prefill_s for run in hf_runs), 4),
            # Greedy outputs agree until rounding differences flip a near-tie (common in bf16).
            "same_tokens": same_prefix(ours_runs[0][i].token_ids, hf_runs[0][i].token_ids),
        }
        for i, ids in enumerate(prompt_ids)
    ]

    table = Table(title=f"greedy decode, batch 1, {args.dtype}, {torch.get_num_threads()} threads")
    for column in ("engine", "tok/s", "ms/token", "prefill s"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    table.add_row("specsot (ours)", f"{ours_tok_s:.1f}", f"{1000 / ours_tok_s:.1f}", f"{prefill(ours_runs):.3f}")
    table.add_row("transformers generate", f"{hf_tok_s:.1f}", f"{1000 / hf_tok_s:.1f}", f"{prefill(hf_runs):.3f}")
    table.add_row("bandwidth limit", f"{limit:.1f}", f"{1000 / limit:.1f}", "-", style="dim")
    out.print(table)
    for i, p in enumerate(per_prompt):
        out.print(
            f"prompt {i + 1} ({p['prompt_tokens']} tokens): ours {p['ours_tok_s']:.1f}, transformers "
            f"{p['hf_tok_s']:.1f} tok/s; first {p['same_tokens']} of {n} tokens identical"
        )
    out.print(f"ours / transformers: {ours_tok_s / hf_tok_s:.2f}x")
    graphs = capture_report(gen.cache) if gen.cache.graphs is not None else None
    if graphs:
        out.print(graphs)
    out.print(
        f"limit: {bw / 1e9:.1f} GB/s (best of {', '.join(f'{b / 1e9:.1f}' for b in bandwidth)}) / "
        f"{wbytes / 1e6:.1f} MB per token = {limit:.1f} tok/s; ours at {ours_tok_s / limit:.1%} of it, "
        f"transformers at {hf_tok_s / limit:.1%}"
    )
    result = {
        "ours_tok_s": round(ours_tok_s, 2),
        "hf_tok_s": round(hf_tok_s, 2),
        "ratio": round(ours_tok_s / hf_tok_s, 3),
        "limit_tok_s": round(limit, 1),
        "fraction_of_limit": round(ours_tok_s / limit, 4),
        "hf_fraction_of_limit": round(hf_tok_s / limit, 4),
        "bandwidth_gb_s": round(bw / 1e9, 2),
        "weight_bytes": wbytes,
        "weight_params": params,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "new_tokens": n,
        "prompts": len(prompts),
        "runs": args.runs,
        "cpu": cpu_name(),
        "device": machine(args),
        "cuda_graphs": graphs,
        "torch": torch.__version__,
        "transformers": hf_version,
        "per_prompt": per_prompt,
    }
    print(json.dumps(result), flush=True)  # plain print, last: scripts read the final line
    return result


def run_script(main) -> None:
    """A benchmark's entry point: a user error (bad flag, missing file) is one line and exit 2."""
    try:
        main()
    except SpecSotError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run_script(main)
