"""End-to-end answer latency: SpecSoT against transformers `generate`, SoT without a draft head, and
EAGLE alone, per question, in one run.

For each question (first turns of MT-bench by default, or JSONL with `question`; --limit N):
  hf      transformers `generate` of the normal answer (chat prompt, greedy, up to --max-tokens)
  eagle   our EAGLE decode of the normal answer
  sot     our Skeleton-of-Thought engine without a draft head (plain decoding in every phase)
  specsot our Skeleton-of-Thought engine with the EAGLE head (the product)
Each is timed from the question to the complete answer. Every engine, transformers included (a
StoppingCriteria), ends an output at the same loop rule as the CLI: --repeat-stop N (default 16)
ends it when its last N tokens already ran earlier in it; --repeat-stop 0 turns that off. Prints a table per question, a summary,
writes a PNG plot (with matplotlib, if installed) and ends with one JSON line holding the medians
of the speedups over all questions and over those routed to SoT.

    python benchmarks/sot.py [--limit 8] [--per-category N] [--max-tokens 256] [--dtype auto|bf16|fp32] [--plot out.png]
        [--prompt-format sot|plan] [--engines hf,specsot] [--repeat-stop 16] [--verify-budget 8]
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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import (add_dtype_option, chosen_dtype, floor_line, load_prompts, load_transformers, machine,  # noqa: E402  (a sibling script)
                    load_with_draft, run_script)

from specsot_mq.generate import Generator  # noqa: E402
from specsot_mq.lookup import History  # noqa: E402
from specsot_mq.stopping import LoopWatch  # noqa: E402
from specsot_mq.sampling import REPEAT_STOP, SamplingParams  # noqa: E402
from specsot_mq.sot.engine import SoTEngine  # noqa: E402
from specsot_mq.sot.flow import SoTConfig, answer_tokens  # noqa: E402
from specsot_mq.speculative import TreeParams  # noqa: E402
from specsot_mq.tokenizer import chat_prompt_ids  # noqa: E402

ENGINES = ("hf", "eagle", "sot", "specsot")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default="auto")
    p.add_argument("--questions", type=Path, default=None)
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--per-category", type=int, default=0,
                   help="at most N questions of each category (MT-bench: --limit 16 --per-category 2 spans all 8)")
    p.add_argument("--max-tokens", type=int, default=256)
    add_dtype_option(p)
    p.add_argument("--max-parallel", type=int, default=8)
    p.add_argument("--sot", default="auto", help="routing for the SoT engines: auto, always, never")
    p.add_argument("--prompt-format", default="sot", help="sot (numbered plan) or plan ([PLAN]/[DIRECT])")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"which of {','.join(ENGINES)} to run (hf always)")
    p.add_argument("--repeat-stop", type=int, default=REPEAT_STOP,
                   help="end an output at its first repeated run of N tokens (a loop), in every engine; 0 = off")
    p.add_argument("--plot", type=Path, default=Path("benchmarks/out/sot.png"))
    p.add_argument("--verify-budget", type=int, default=TreeParams().max_batch_tokens,
                   help="tokens of one batched verify, all sequences together (TreeParams.max_batch_tokens)")
    p.add_argument("--lookup", type=int, default=TreeParams().lookup,
                   help="prompt-lookup tokens grafted on each draft tree (TreeParams.lookup); 0 = off")
    p.add_argument("--json-only", action="store_true")
    args = p.parse_args(argv)
    engines = ["hf", *(e for e in ENGINES[1:] if e in args.engines.split(","))]
    if unknown := set(args.engines.split(",")) - set(ENGINES):
        p.error(f"--engines: unknown {', '.join(sorted(unknown))}; choose from {','.join(ENGINES)}")
    out = Console(quiet=args.json_only, soft_wrap=True)
    dtype = chosen_dtype(args)
    questions, source = load_prompts(args.questions, args.limit, args.per_category)

    folder, tokenizer, model, head, draft_path = load_with_draft(args.model, args.draft, dtype, args.quantize, args.device)
    max_len = 2048
    plain_gen = Generator(model, tokenizer, max_len=max_len, num_slots=args.max_parallel)
    eagle_gen = Generator(model, tokenizer, max_len=max_len, num_slots=args.max_parallel, draft=head,
                          tree=TreeParams(max_batch_tokens=args.verify_budget, lookup=args.lookup))  # fmt: skip
    config = SoTConfig(sot=args.sot, prompt_format=args.prompt_format, max_parallel=args.max_parallel)
    sot, specsot = SoTEngine(plain_gen, config), SoTEngine(eagle_gen, config)
    sot.keep_heads(), specsot.keep_heads()  # as a server answers: the shared prompt beginnings computed already
    hf = load_transformers(folder, dtype, args.device)
    params = SamplingParams(max_tokens=args.max_tokens, repeat_stop=args.repeat_stop)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    phases: dict[str, list] = {}  # SpecSoT's phase stats over the questions: name -> [{"tokens", "steps", "seconds"}]

    # EAGLE and SpecSoT share one generator: each keeps its own History of outputs (prompt lookup's
    # guesses from earlier answers), or SpecSoT's direct answers would copy EAGLE's to the same question
    histories = {"eagle": History(), "specsot": History()}

    def run(engine: str, question: str) -> tuple[float, int, str]:
        """(seconds to the complete answer, tokens generated, mode)."""
        eagle_gen.history = histories.get(engine, eagle_gen.history)
        start = time.perf_counter()
        if engine == "hf":
            ids = torch.tensor([chat_prompt_ids(tokenizer, question)], device=hf.device)
            with torch.inference_mode():
                res = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens,
                                  do_sample=False, pad_token_id=pad_id,
                                  stopping_criteria=[LoopStop(args.repeat_stop)] if args.repeat_stop else None)  # fmt: skip
            return time.perf_counter() - start, res.shape[1] - ids.shape[1], "direct"
        if engine == "eagle":
            done = eagle_gen.generate(question, params)
            return time.perf_counter() - start, len(done.token_ids), "direct"
        answer = (sot if engine == "sot" else specsot).generate(question, params)
        if engine == "specsot" and question != WARM_UP:
            for name, stats in answer.stats.items():
                if isinstance(stats, dict):
                    phases.setdefault(name, []).append(stats)
        return time.perf_counter() - start, answer_tokens(answer), answer.mode

    floor_text, floor = floor_line(model, dtype, args.device)
    out.print(
        f"{machine(args)} | {args.dtype} | {floor_text} | {len(questions)} questions ({source}) "
        f"| max tokens {args.max_tokens} per phase | draft {draft_path.name} | max parallel {args.max_parallel} "
        f"| prompt format {args.prompt_format} | repeat stop {args.repeat_stop} "
        f"| verify budget {args.verify_budget}"
    )
    rows = time_answers(engines, questions, run, args.json_only)

    table = Table(title="seconds to a complete answer (tokens) and speedup over transformers generate")
    table.add_column("question", max_width=24, no_wrap=True, overflow="ellipsis")
    table.add_column("mode")
    for engine in engines:
        table.add_column(engine, justify="right")
    for r in rows:
        hf_s = r["hf"][0]
        cells = [f"{r[e][0]:.1f}s ({r[e][1]})" + ("" if e == "hf" else f" {hf_s / r[e][0]:.2f}x") for e in engines]
        table.add_row(r["question"], mode(r), *cells)
    out.print(table)

    def median_speedup(engine: str, subset) -> float | None:
        values = [r["hf"][0] / r[engine][0] for r in subset]
        return round(statistics.median(values), 3) if values else None

    planned = [r for r in rows if mode(r) == "sot"]
    result = {}
    for engine in [e for e in ("specsot", "sot", "eagle") if e in engines]:
        result[f"{engine}_vs_hf"] = median_speedup(engine, rows)
        result[f"{engine}_vs_hf_sot_routed"] = median_speedup(engine, planned)
    result.update(questions=len(rows), sot_routed=len(planned), dtype=args.dtype, max_tokens=args.max_tokens,
                  threads=torch.get_num_threads(), draft=draft_path.name,
                  prompt_format=args.prompt_format, repeat_stop=args.repeat_stop, verify_budget=args.verify_budget,
                  lookup=args.lookup, device=machine(args), **floor,
                  per_question=[{"question": r["question"], "mode": mode(r),
                                 **{e: {"s": round(r[e][0], 3), "tokens": r[e][1]} for e in engines}} for r in rows])  # fmt: skip
    # Tokens over seconds of all answers: the answers' lengths differ between engines (SoT's are
    # structured, and in bf16 tree shapes change tokens), so rates complement the latency medians.
    result["totals"] = {e: {"tokens": sum(r[e][1] for r in rows), "seconds": round(sum(r[e][0] for r in rows), 2)}
                        for e in engines}  # fmt: skip
    for t in result["totals"].values():
        t["tok_s"] = round(t["tokens"] / t["seconds"], 1) if t["seconds"] else None
    summary = Table(title="median speedup over transformers generate; all answers' tokens over their seconds")
    for col in ("engine", "all questions", "routed to SoT", "tokens", "seconds", "tok/s"):
        summary.add_column(col, justify="left" if col == "engine" else "right")
    for engine in engines:
        speedups = ("-", "-") if engine == "hf" else (str(result[f"{engine}_vs_hf"]), str(result[f"{engine}_vs_hf_sot_routed"]))
        t = result["totals"][engine]
        summary.add_row(engine, *speedups, str(t["tokens"]), f"{t['seconds']:.1f}", str(t["tok_s"]))
    out.print(summary)
    if phases:
        result["specsot_phases"] = phase_table(phases, out)
    _plot(rows, engines, args.plot, out)
    print(json.dumps(result), flush=True)
    return result


WARM_UP = "Say hello."


def time_answers(engines, questions, run, quiet: bool, row_of=lambda q: {}) -> list[dict]:
    """Every engine answers WARM_UP once, then each question in turn, with a progress bar: one row
    per question, {"question": its first 60 characters, **row_of(question), engine: run(engine,
    question)}."""
    rows = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True, disable=quiet) as bar:  # fmt: skip
        task = bar.add_task("warm-up", total=1 + len(questions) * len(engines))
        for engine in engines:
            run(engine, WARM_UP)
        bar.advance(task)
        for i, q in enumerate(questions):
            row = {"question": q[:60], **row_of(q)}
            for engine in engines:
                bar.update(task, description=f"question {i + 1}: {engine}")
                row[engine] = run(engine, q)
                bar.advance(task)
            rows.append(row)
    return rows


def phase_table(phases: dict[str, list], out: Console) -> dict:
    """SpecSoT's time per phase over all questions: seconds, tokens, tokens/s and tau (tokens per
    decoder step of a sequence, over all of the phase's steps); printed as a table, returned for
    the JSON line."""
    table = Table(title="where SpecSoT's time goes (all questions)")
    for col in ("phase", "questions", "seconds", "tokens", "tok/s", "tau"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    summary = {}
    for name, stats in phases.items():
        seconds, tokens = sum(p["seconds"] for p in stats), sum(p["tokens"] for p in stats)
        steps = sum(p["steps"] for p in stats)
        tau = round(tokens / steps, 3) if steps else None
        summary[name] = {"questions": len(stats), "seconds": round(seconds, 2), "tokens": tokens, "tau": tau}
        table.add_row(name, str(len(stats)), f"{seconds:.1f}", str(tokens), f"{tokens / seconds:.1f}" if seconds else "-",
                      "-" if tau is None else f"{tau:.2f}")  # fmt: skip
    out.print(table)
    return summary


class LoopStop:
    """transformers' side of SamplingParams.repeat_stop (one sequence, one generate() call): the
    same LoopWatch as our loop, fed the token each step appends, keeping the token that ends it."""

    def __init__(self, n: int):
        self.watch = LoopWatch(n)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.tensor([self.watch.add(int(input_ids[0, -1]))], device=input_ids.device)


def mode(row) -> str:
    """How the SoT engines answered the question: "sot" (with a plan) or "direct"."""
    return (row.get("specsot") or row.get("sot") or (0, 0, "direct"))[2]


def _plot(rows, engines, path: Path, out: Console) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        out.print("[dim]no plot: pip install matplotlib (or the project's \\[bench] extra)[/]")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    width = 0.8 / len(engines)
    for k, engine in enumerate(engines):
        offset = (k - (len(engines) - 1) / 2) * width
        ax.bar([i + offset for i in range(len(rows))], [r[engine][0] for r in rows], width, label=engine)
    ax.set_xticks(range(len(rows)), [f"Q{i + 1}{'*' if mode(r) == 'sot' else ''}" for i, r in enumerate(rows)])
    ax.set_ylabel("seconds to a complete answer")
    ax.set_title("answer latency per question (* = answered with a plan)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    out.print(f"plot written to {path}")


if __name__ == "__main__":
    run_script(main)
