"""EAGLE speculative decoding against plain decoding and transformers `generate`, in one run.

For each prompt (first turns of MT-bench questions by default), greedy, EOS ignored so every run
makes exactly --new-tokens tokens: transformers `generate`, our plain decode, our decode with
prompt lookup alone (no head), and our EAGLE decode with the default tree. Reports decode tokens/s
of each, the mean acceptance length tau (= 1 + accepted / verify steps, vLLM's definition),
acceptance per tree depth, the time split between drafting and verifying, and a sweep over tree
shapes as a table. The head itself is measured by the sweep's first two rows, drafted every step
with no prompt lookup and no chooser: a chain of 4 (4x4x1: its depth-1 rate is the first guess's
acceptance) and the default tree's shape (2x1x2); beside them, the share of the main run's steps
(one sequence) that the speed chooser gave the tree.

    python benchmarks/eagle.py [--limit 5] [--new-tokens 256] [--dtype auto|bf16|fp32] [--sweep 8x4x3,12x5x4+8]
                               [--questions benchmarks/router_heldout.jsonl --label direct]  # what a router answers directly
                               [--compare-draft PATH]   # the sweep runs a second head too, side by side

A tree is NODESxDEPTHxTOPK, with +N for N prompt-lookup tokens grafted on each tree (4x2x2 alone
has none); a tree named here is drafted at every step. Without --tree the main row is the default,
TreeParams() (2x1x2+2, each step taking the way that has been fastest lately: SpeedChooser). EOS is ignored, so a small model's answers run into loops,
which prompt lookup drafts well: sot.py's EAGLE row, with the CLI's loop stop, is the sober figure.

The last stdout line is one JSON object with at least tau, eagle_vs_hf and eagle_vs_plain.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import (add_dtype_option, chosen_dtype, floor_line, load_prompts, load_transformers, machine,  # noqa: E402
                    load_with_draft, run_hf, run_script, same_prefix, warmup_tokens)  # (a sibling script)

from specsot_mq.draft import DraftHead  # noqa: E402
from specsot_mq.errors import SpecSotError  # noqa: E402
from specsot_mq.generate import Generator  # noqa: E402
from specsot_mq.loader import resolve_draft  # noqa: E402
from specsot_mq.sampling import SamplingParams  # noqa: E402
from specsot_mq.speculative import TreeParams  # noqa: E402
from specsot_mq.tokenizer import chat_prompt_ids  # noqa: E402


def parse_tree(text: str) -> TreeParams:
    """NODESxDEPTHxTOPK, optionally +LOOKUP (prompt-lookup tokens grafted on each tree); every step
    drafts such a tree (no SpeedChooser), so that the sweep compares tree shapes."""
    try:
        shape, _, lookup = text.lower().partition("+")
        nodes, depth, topk = (int(x) for x in shape.split("x"))
        return TreeParams(nodes, depth, topk, lookup=int(lookup or 0), adaptive=False)
    except ValueError:
        raise SpecSotError(f"tree '{text}' is not NODESxDEPTHxTOPK[+LOOKUP] (e.g. 12x5x4, 4x2x2+4): fix --tree or --sweep") from None


def tree_name(t: TreeParams) -> str:
    return f"{t.num_draft_tokens}x{t.depth}x{t.topk}" + (f"+{t.lookup}" if t.lookup else "") + (" adaptive" if t.adaptive else "")


def run_eagle(gen: Generator, ids: list[int], n: int):
    """One EAGLE generation; returns (tokens, decode seconds, the decoder's stats)."""
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    decoder = gen.new_decoder(params)
    done = gen.generate(ids, params, decoder=decoder)
    return done.token_ids, done.seconds - done.prefill_seconds, decoder.stats


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default="auto", help="draft head: auto (shipped) or a .safetensors path")
    p.add_argument("--questions", type=Path, default=None)
    p.add_argument("--limit", type=int, default=5)
    p.add_argument("--label", default=None, help="only the questions of this label (router_heldout.jsonl: direct, plan)")
    p.add_argument("--new-tokens", type=int, default=256)
    add_dtype_option(p)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--tree", default=None, help="main tree NODESxDEPTHxTOPK[+LOOKUP] (default: TreeParams())")
    p.add_argument("--sweep", default="4x4x1,2x1x2,4x2x2,4x2x2+4,6x2x3+8,12x5x4+8",
                   help="trees for the sweep table ('' = none)")
    p.add_argument("--compare-draft", default=None, help="a second head (.safetensors): the sweep runs it too")
    p.add_argument("--json-only", action="store_true")
    args = p.parse_args(argv)
    out = Console(quiet=args.json_only, soft_wrap=True)
    torch.set_num_threads(args.threads)
    dtype = chosen_dtype(args)
    prompts, source = load_prompts(args.questions, args.limit, label=args.label)
    main_tree = parse_tree(args.tree) if args.tree else TreeParams()
    sweep = [parse_tree(t) for t in args.sweep.split(",") if t.strip()]
    n = args.new_tokens

    folder, tokenizer, model, head, draft_path = load_with_draft(args.model, args.draft, dtype, args.quantize, args.device)
    prompt_ids = [chat_prompt_ids(tokenizer, q) for q in prompts]
    max_len = max(map(len, prompt_ids)) + n + 64
    plain = Generator(model, tokenizer, max_len=max_len)
    # No head, prompt lookup alone (what a model without a draft head gets), as long as the main tree's.
    lookup_tree = TreeParams(lookup=main_tree.lookup or TreeParams().lookup)
    lookup = Generator(model, tokenizer, max_len=max_len, tree=lookup_tree)
    heads = {draft_path.stem: head}
    if args.compare_draft:
        other = resolve_draft(args.compare_draft, folder)
        label = other.stem if other.stem != draft_path.stem else f"{other.parent.name}/{other.stem}"
        heads[label] = DraftHead.load(other, model).prepack()
    main_run = (draft_path.stem, tree_name(main_tree))
    runs = [(h, tree_name(t)) for h in heads for t in sweep]  # the sweep: every head with every tree
    trees = {tree_name(t): t for t in [main_tree, *sweep]}
    eagle = {run: Generator(model, tokenizer, max_len=max_len, draft=heads[run[0]], tree=trees[run[1]])
             for run in [main_run, *runs]}  # fmt: skip
    for g in eagle.values():  # the head itself is measured, even where it does not pay (Generator.new_decoder)
        g.retire_head = False
    hf = load_transformers(folder, dtype, args.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    floor_text, floor = floor_line(model, dtype, args.device)
    out.print(
        f"{machine(args)} | {args.dtype} | {floor_text} | "
        f"{len(prompts)} prompts ({source}{f', label {args.label}' if args.label else ''}), {n} new tokens | draft {draft_path.name} "
        f"(vocab {head.cfg.draft_vocab_size}) | tree {main_tree}"
    )
    rows = {"hf": [], "plain": [], "lookup": [], "eagle": []}
    stats, same, lookup_stats = [], [], []
    sweep_rows = {run: [] for run in runs}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True, disable=args.json_only) as bar:  # fmt: skip
        task = bar.add_task("warm-up", total=1 + len(prompts) * (4 + len(runs)))
        warm = warmup_tokens(plain, n)
        plain.generate(prompt_ids[0], SamplingParams(max_tokens=warm, ignore_eos=True))
        lookup.generate(prompt_ids[0], SamplingParams(max_tokens=warm, ignore_eos=True))
        for g in eagle.values():
            run_eagle(g, prompt_ids[0], warm)
        run_hf(hf, prompt_ids[0], 8, pad_id)
        bar.advance(task)
        for i, ids in enumerate(prompt_ids):
            bar.update(task, description=f"prompt {i + 1}: transformers")
            hf_sample = run_hf(hf, ids, n, pad_id)
            rows["hf"].append(hf_sample.decode_s)
            bar.advance(task)
            bar.update(task, description=f"prompt {i + 1}: plain")
            done = plain.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True))
            rows["plain"].append(done.seconds - done.prefill_seconds)
            bar.advance(task)
            bar.update(task, description=f"prompt {i + 1}: lookup, no head")
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            copier = lookup.new_decoder(params)
            copied = lookup.generate(ids, params, decoder=copier)
            rows["lookup"].append(copied.seconds - copied.prefill_seconds)
            lookup_stats.append(copier.stats)
            bar.advance(task)
            bar.update(task, description=f"prompt {i + 1}: eagle")
            tokens, seconds, st = run_eagle(eagle[main_run], ids, n)
            rows["eagle"].append(seconds)
            stats.append(st)
            same.append(same_prefix(tokens, done.token_ids))
            bar.advance(task)
            for run in runs:
                bar.update(task, description=f"prompt {i + 1}: sweep {run[1]}")
                _, seconds, st = run_eagle(eagle[run], ids, n)
                sweep_rows[run].append((seconds, st))
                bar.advance(task)

    def rate(decode_s: list[float]) -> float:
        return len(decode_s) * (n - 1) / sum(decode_s)

    hf_tok_s, plain_tok_s, eagle_tok_s = rate(rows["hf"]), rate(rows["plain"]), rate(rows["eagle"])
    lookup_tok_s = rate(rows["lookup"])
    steps = sum(s.steps for s in stats)
    tau = 1 + sum(s.accepted for s in stats) / steps
    deepest = max(len(s.accepted_at_depth) for s in stats)
    depth_rate = [sum((s.accepted_at_depth + [0] * deepest)[d] for s in stats) / steps for d in range(deepest)]
    lookup_rate = sum(s.lookup_accepted for s in stats) / steps
    lookup_tau = 1 + sum(s.accepted for s in lookup_stats) / sum(s.steps for s in lookup_stats)
    draft_s, verify_s = sum(s.draft_seconds for s in stats), sum(s.verify_seconds for s in stats)

    table = Table(title=f"greedy decode, {args.dtype}, {torch.get_num_threads()} threads, {n} tokens x {len(prompts)} prompts")
    for c in ("engine", "tok/s", "vs transformers", "vs plain"):
        table.add_column(c, justify="left" if c == "engine" else "right")
    for name, r in (("transformers generate", hf_tok_s), ("ours, plain", plain_tok_s),
                    ("ours, prompt lookup alone (no head)", lookup_tok_s), ("ours, EAGLE", eagle_tok_s)):
        table.add_row(name, f"{r:.1f}", f"{r / hf_tok_s:.2f}x", f"{r / plain_tok_s:.2f}x")
    out.print(table)
    out.print(
        f"tau {tau:.2f} | accepted at depth " + " ".join(f"{d + 1}:{r:.2f}" for d, r in enumerate(depth_rate))
        + (f" | prompt lookup alone {lookup_rate:.2f} per step" if main_tree.lookup else "")
        + f" | without a head, prompt lookup's tau {lookup_tau:.2f}"
        + f" | drafting {draft_s / (draft_s + verify_s):.0%} of step time, "
        f"{1000 * draft_s / steps:.1f} ms draft + {1000 * verify_s / steps:.1f} ms verify per step"
    )
    out.print(f"EAGLE tokens identical to plain decoding for the first {same} of {n} (per prompt)")
    sweep_out = []
    if sweep:
        st_table = Table(title="tree sweep (nodes x depth x topk [+ prompt-lookup tokens])")
        st_table.add_column("head", no_wrap=True)
        for c in ("tree", "tau", "depth 1 accepted", "tok/s", "vs plain", "ms draft/step", "ms verify/step"):
            st_table.add_column(c, justify="right")
        for (h, name), res in sweep_rows.items():
            s_steps = sum(st.steps for _, st in res)
            s_tau = 1 + sum(st.accepted for _, st in res) / s_steps
            first = sum(st.accepted_at_depth[0] for _, st in res if st.accepted_at_depth) / s_steps
            s_rate = rate([sec for sec, _ in res])
            d_ms = 1000 * sum(st.draft_seconds for _, st in res) / s_steps
            v_ms = 1000 * sum(st.verify_seconds for _, st in res) / s_steps
            st_table.add_row(h, name, f"{s_tau:.2f}", f"{first:.2f}", f"{s_rate:.1f}",
                             f"{s_rate / plain_tok_s:.2f}x", f"{d_ms:.1f}", f"{v_ms:.1f}")  # fmt: skip
            sweep_out.append({"draft": h, "tree": name, "tau": round(s_tau, 3), "depth1_accepted": round(first, 3),
                              "tok_s": round(s_rate, 2), "vs_plain": round(s_rate / plain_tok_s, 3)})  # fmt: skip
        out.print(st_table)
    ways = eagle[main_run].chooser.counts if eagle[main_run].chooser else {"eagle": steps}
    tree_share = ways.get("eagle", 0) / max(1, sum(ways.values()))
    out.print(f"the speed chooser gave the tree {tree_share:.0%} of the main run's one-sequence steps ({ways})")
    result = {
        "tau": round(tau, 3),
        "eagle_vs_hf": round(eagle_tok_s / hf_tok_s, 3),
        "eagle_vs_plain": round(eagle_tok_s / plain_tok_s, 3),
        "eagle_tok_s": round(eagle_tok_s, 2),
        "plain_tok_s": round(plain_tok_s, 2),
        "lookup_alone_tok_s": round(lookup_tok_s, 2),
        "lookup_alone_tau": round(lookup_tau, 3),
        "hf_tok_s": round(hf_tok_s, 2),
        "accepted_per_depth": [round(r, 3) for r in depth_rate],
        "lookup_accepted_per_step": round(lookup_rate, 3),
        "draft_ms_per_step": round(1000 * draft_s / steps, 2),
        "verify_ms_per_step": round(1000 * verify_s / steps, 2),
        "identical_prefix": same,
        "tree": main_run[1],
        "sweep": sweep_out,
        "chooser_tree_share": round(tree_share, 3),
        "chooser_steps": ways,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "new_tokens": n,
        "prompts": len(prompts),
        "draft": draft_path.name,
        "device": machine(args),
        **floor,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    run_script(main)
